"""Which part of each weight a rank holds, and the model as one rank sees it.

Tensor parallelism (tp ranks) splits what the heads and the intermediate dimension index, the
Megatron way, so that each rank's share ends in one all_reduce:

    q_proj / q_b_proj, kv_b_proj      rows by head          (each rank attends with NH / tp heads)
    o_proj                            columns by head       (partial sums: all_reduce)
    gate_proj, up_proj                rows                  (dense MLP, shared experts, and routed
    down_proj                         columns                experts when there is no expert parallelism)

Expert parallelism (ep ranks) gives rank r the routed experts [r * E / ep, (r + 1) * E / ep),
whole. Everything else (embedding, norms, q_a / kv_a, the router, lm_head) is replicated: small
next to the experts, and it keeps every rank's residual stream identical.

A rank reads only its share from the safetensors files: rows are one contiguous byte range of the
memory map, columns one range per row, and another rank's experts are never touched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..errors import ConfigError
from ..tensor import Quant, Tensor

# (pattern of the weight name, the dimension tensor parallelism splits)
_TP_RULES = (
    (re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$"), 0),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.(shared_experts\.)?down_proj\.weight$"), 1),
)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ShardPlan:
    """The share of rank `rank` in a job of tp-way tensor and ep-way expert parallelism (each 1 or
    the job's size)."""

    rank: int
    tp: int = 1
    ep: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep > 1 else 0

    # ------------------------------------------------------------------ the model one rank sees
    def check(self, cfg) -> None:
        """Every split divides evenly, and the model is one this path runs: a clear error otherwise."""
        if cfg.v4 is not None or cfg.dsa is not None:
            raise ConfigError("tensor / expert parallelism runs DeepSeek V2 and V3 models; V3.2 and V4 are not "
                              "split yet: run them on one device (tensor_parallel and expert_parallel 1)")
        need = []
        if self.tp > 1:
            need += [("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size)]
            if cfg.n_shared_experts:
                need.append(("moe_intermediate_size", cfg.moe_intermediate_size))
            if self.ep == 1 and cfg.n_routed_experts:
                need.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        for name, v in need:
            if v % self.tp:
                raise ConfigError(f"tensor_parallel {self.tp} does not divide this model's {name} ({v}): "
                                  f"use a tensor_parallel that does")
        if self.ep > 1 and cfg.n_routed_experts % self.ep:
            raise ConfigError(f"expert_parallel {self.ep} does not divide the model's {cfg.n_routed_experts} routed "
                              f"experts: use an expert_parallel that does")

    def local_config(self, cfg):
        """The config with the dimensions this rank computes: heads and intermediate sizes divided
        by tp. n_routed_experts stays global (the router scores every expert)."""
        if self.tp == 1:
            return cfg
        t = self.tp
        changes = dict(num_attention_heads=cfg.num_attention_heads // t, intermediate_size=cfg.intermediate_size // t)
        if cfg.n_routed_experts and (cfg.n_shared_experts or self.ep == 1):
            # shared experts (and, without expert parallelism, routed ones) split their intermediate dim
            changes["moe_intermediate_size"] = cfg.moe_intermediate_size // t
        local = replace(cfg, **changes)
        # the softmax scale and rope come from the head dims, which do not change
        return local

    def expert_range(self, num_experts: int) -> range:
        """The routed experts this rank holds (global ids)."""
        if self.ep == 1:
            return range(num_experts)
        per = num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    # ------------------------------------------------------------------ one weight
    def split_dim(self, name: str) -> Optional[int]:
        """The dimension of `name` that tensor parallelism splits, or None (whole on every rank)."""
        if self.tp == 1:
            return None
        m = _EXPERT.search(name)
        if m:
            if self.ep > 1:
                return None              # expert parallelism: whole experts
            return 1 if m[2] == "down_proj" else 0
        for pat, dim in _TP_RULES:
            if pat.search(name):
                return dim
        return None

    def owns(self, name: str, num_experts: int) -> bool:
        """Whether this rank loads `name` at all (another rank's routed experts: no)."""
        m = _EXPERT.search(name)
        return m is None or int(m[1]) in self.expert_range(num_experts)

    def local_shape(self, name: str, shape) -> tuple:
        d = self.split_dim(name)
        return tuple(n // self.tp if i == d else n for i, n in enumerate(shape))

    def full_shape(self, name: str, local_shape) -> tuple:
        d = self.split_dim(name)
        if d is None:
            return tuple(local_shape)
        s = list(local_shape)
        s[d] *= self.tp
        return tuple(s)

    def take(self, name: str, t: Tensor) -> Tensor:
        """This rank's part of the whole weight `t` (a host tensor, usually a memory-map view): a
        contiguous copy of just those rows or columns (with the matching scales when quantized)."""
        d = self.split_dim(name)
        if d is None:
            return t
        n = t.shape[d] // self.tp
        return slice_tensor(t, d, self.tp_rank * n, n, name)


def _slice_array(a: np.ndarray, dim: int, start: int, n: int) -> np.ndarray:
    idx = [slice(None)] * a.ndim
    idx[dim] = slice(start, start + n)
    return np.ascontiguousarray(a[tuple(idx)])


def slice_tensor(t: Tensor, dim: int, start: int, n: int, name: str = "tensor") -> Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + n) of a 2-d host tensor as a new contiguous
    host tensor; a quantized tensor keeps its format, which needs the cut on a block boundary."""
    if t.ndim != 2:
        raise ValueError(f"{name}: only 2-d weights are split (shape {list(t.shape)})")
    q = t.quant
    if q is not None and q.block[dim]:     # block 0 = one scale over the whole dimension: any cut keeps it
        block = q.block[dim]
        if start % block or (n % block and start + n != t.shape[dim]):
            raise ConfigError(f"{name} is stored as {q.describe(t.dtype)}: splitting it {'rows' if dim == 0 else 'columns'} "
                              f"[{start}, {start + n}) cuts a quantization block of {block}: use a tensor_parallel "
                              f"that keeps whole blocks, or a bf16 copy of the checkpoint")
    # 4-bit tensors: numpy() unpacks and from_numpy packs again (their files are small; this copy is too)
    out = Tensor.from_numpy(_slice_array(t.numpy(), dim, start, n), t.dtype)
    if q is not None:
        b = q.block[dim] or t.shape[dim]
        s0, sn = (start // b, -(-n // b)) if q.block[dim] else (0, 1)
        scales = Tensor.from_numpy(_slice_array(q.scales.numpy(), dim, s0, sn))
        zeros = Tensor.from_numpy(_slice_array(q.zeros.numpy(), dim, s0, sn)) if q.zeros is not None else None
        out.quant = Quant(scales, q.block, zeros)
    return out


class ShardedCheckpoint:
    """A Checkpoint as one rank loads it: `config` is the rank's local config (ShardPlan.local_config),
    weight() / tensor() take the local shape, check the whole tensor's shape against the
    checkpoint, and return this rank's part. Everything else is the checkpoint's own."""

    def __init__(self, ckpt, plan: ShardPlan):
        self._ckpt, self.plan = ckpt, plan
        self.global_config = ckpt.config
        self.config = plan.local_config(ckpt.config)

    def __getattr__(self, name):
        return getattr(self._ckpt, name)

    def __contains__(self, name: str) -> bool:
        return name in self._ckpt

    def weight(self, name: str, shape, dtype=None) -> Tensor:
        full = self.plan.full_shape(name, shape)
        return self.plan.take(name, self._ckpt.weight(name, full, dtype))

    def tensor(self, name: str, shape, dtype=None) -> Tensor:
        full = self.plan.full_shape(name, shape)
        return self.plan.take(name, self._ckpt.tensor(name, full, dtype))

    def array(self, name: str, shape=None):
        """With a (local) shape: this rank's part, a copy. Without: the whole stored array, a lazy
        memory-map view that reads nothing until indexed (what the loader asks for a dtype)."""
        d = self.plan.split_dim(name)
        if d is None or shape is None:
            return self._ckpt.array(name, shape)
        a = self._ckpt.array(name, self.plan.full_shape(name, shape))
        n = a.shape[d] // self.plan.tp
        return _slice_array(a, d, self.plan.tp_rank * n, n)

    def mark_others_used(self) -> None:
        """Another rank's routed experts count as read (the load's unused-tensor check)."""
        E = self.global_config.n_routed_experts
        self._ckpt.used.update(n for n in self._ckpt.names() if not self.plan.owns(n, E))
