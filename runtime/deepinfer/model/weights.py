"""Typed weight containers of a DeepSeek V2/V3 model and the loader that fills them on a backend.

Names follow the checkpoint (`q_a_proj` -> `q_a`, `kv_a_proj_with_mqa` -> `kv_a`, ...). A linear
weight arrives in the model's precision: as stored, dequantized to a float precision, or quantized
at load with the backend's quantize op (projections, MLP and expert weights only; norms, the
embedding and the router stay in the activation / f32 dtype).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import dtypes as D
from .. import quant_formats as QF
from ..errors import CheckpointError
from ..parallel.shard import ShardedCheckpoint
from ..tensor import Quant, Tensor
from .checkpoint import Checkpoint


@dataclass
class AttentionWeights:
    kv_a: Tensor                    # [Dc + Dr, H]  kv_a_proj_with_mqa
    kv_a_norm: Tensor               # [Dc]
    kv_b: Tensor                    # [NH * (Dn + Dv), Dc]
    kv_b_dense: Tensor              # kv_b un-quantized (mla_decode absorbs it into the query)
    o: Tensor                       # [H, NH * Dv]
    q: Optional[Tensor] = None      # [NH * (Dn + Dr), H]  when q_lora_rank is 0 (V2-Lite)
    q_a: Optional[Tensor] = None    # [q_lora_rank, H]
    q_a_norm: Optional[Tensor] = None
    q_b: Optional[Tensor] = None    # [NH * (Dn + Dr), q_lora_rank]
    q_a_bias: Optional[Tensor] = None
    kv_a_bias: Optional[Tensor] = None
    o_bias: Optional[Tensor] = None
    # q (or q_a) and kv_a stacked by rows: both read the same input, so one linear does both (one
    # weight pass, one launch). q / q_a and kv_a are then views of it. None: not fusable (biases,
    # formats that differ, block rows that straddle the seam).
    x_proj: Optional[Tensor] = None
    indexer: Optional["DSAIndexerWeights"] = None   # V3.2


@dataclass
class DSAIndexerWeights:
    """V3.2's lightning indexer: queries from the q LoRA, one key per token (LayerNorm-ed), per-head
    weights from the layer input (f32, as transformers keeps weights_proj)."""

    wq_b: Tensor                    # [NI * Di, q_lora_rank]
    wk: Tensor                      # [Di, H]
    k_norm: Tensor                  # [Di]
    k_norm_bias: Tensor             # [Di]
    weights_proj: Tensor            # [NI, H]


@dataclass
class MLPWeights:
    gate: Tensor                    # [I, H]
    up: Tensor                      # [I, H]
    down: Tensor                    # [H, I]
    gate_up: Optional[Tensor] = None    # gate and up stacked by rows [2I, H] (gate, up: its views)


@dataclass
class MoEWeights:
    gate: Tensor                    # router [E, H], f32
    gate_bias: Optional[Tensor]     # e_score_correction_bias [E] (noaux_tc) or None
    experts_gate: Optional[list]    # E x [I, H]  (None: the routed experts stream through an ExpertCache)
    experts_up: Optional[list]      # E x [I, H]
    experts_down: Optional[list]    # E x [H, I]
    shared: Optional[MLPWeights]    # the shared experts as one MLP, or None
    # or the shared experts as routed experts that every token takes with weight 1 (n_shared x [I, H],
    # [I, H], [H, I], laid out as the routed ones): moe_experts runs them with the routed (WeightLoader.
    # _shared_as_experts); then `shared` is None
    shared_experts: Optional[tuple] = None
    prefix: str = ""                # checkpoint name prefix of the layer's MLP ("model.layers.3.mlp.")
    streamed: object = None         # model.expert_cache.StreamedLayer when the experts stream
    hash_table: Optional[Tensor] = None   # V4's hash routing: [V, K] int32 experts of each token id


@dataclass
class LayerWeights:
    index: int                      # the layer's KV cache layer
    ln1: Tensor                     # input_layernorm
    ln2: Tensor                     # post_attention_layernorm
    attn: AttentionWeights
    mlp: Optional[MLPWeights] = None    # dense layers
    moe: Optional[MoEWeights] = None    # MoE layers


@dataclass
class MTPWeights:
    """V3's multi-token-prediction layer (model.layers.{L}): its own block, norms and head."""

    layer: LayerWeights
    enorm: Tensor
    hnorm: Tensor
    eh_proj: Tensor                 # [H, 2H]
    head_norm: Tensor
    head: Tensor                    # shared_head.head, or the main lm_head
    embed: Tensor                   # its own embedding, or the main one


@dataclass
class ModelWeights:
    embed: Tensor                   # [V, H]
    norm: Tensor                    # [H]
    lm_head: Tensor                 # [V, H]
    layers: list                    # LayerWeights per decoder layer
    mtp: Optional[MTPWeights] = None


# rotary frequency buffers some exports save; rope recomputes them from the config
_INV_FREQ = "rotary_emb.inv_freq"
_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")   # a bounded index: int() refuses 4300+ digits


def _layer_of(name: str) -> Optional[int]:
    m = _LAYER.match(name)
    return int(m[1]) if m else None


def is_mtp_layer(ckpt, i: int) -> bool:
    """Whether layer i of the checkpoint is an MTP layer: V3's fuse the embedding and the hidden
    state with eh_proj, V4's project them apart (e_proj, h_proj)."""
    return f"model.layers.{i}.eh_proj.weight" in ckpt or f"model.layers.{i}.e_proj.weight" in ckpt


def _layout(t: Tensor) -> tuple:
    """What moe_experts requires every expert of a call to share: dtype, shape, quantization block
    and the scales' and zeros' dtypes."""
    q = t.quant
    return (t.dtype.name, tuple(t.shape), None if q is None else
            (tuple(q.block), q.scales.dtype.name, None if q.zeros is None else q.zeros.dtype.name))


def copy_bytes(backend, dst: Tensor, src: Tensor) -> None:
    """dst's bytes = src's (both contiguous, same size; 4-bit tensors stay packed)."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy_bytes: {src!r} -> {dst!r} differ in size")
    if dst.on_host and src.on_host:
        dst.byte_view().numpy()[...] = src.byte_view().numpy()
    else:
        backend.copy_async(dst.byte_view(), src.byte_view())


class WeightLoader:
    """Reads a Checkpoint onto a backend in one precision (None: as stored)."""

    def __init__(self, ckpt: Checkpoint, backend, dtype: str, precision: Optional[str], group_size: int,
                 quantize_lm_head: bool = False, stream_experts: bool = False, shard=None,
                 shared_as_routed: bool = False):
        # shard (parallel.shard.ShardPlan): this rank's part of a tensor / expert parallel model; the
        # checkpoint is then read through a view that returns only that part, with the local config
        self.shard = shard
        if shard is not None:
            ckpt = ShardedCheckpoint(ckpt, shard)
        self.ckpt, self.cfg, self.backend, self.dtype = ckpt, ckpt.config, backend, dtype
        # routed experts are left on disk for an ExpertCache (model.expert_cache) to load on demand
        self.stream_experts = bool(stream_experts)
        # the shared experts become routed experts every token takes (where the layouts allow it)
        self.shared_as_routed = bool(shared_as_routed)
        self.quantize_lm_head = quantize_lm_head
        self.precision = precision
        self.weight_format = QF.weight_format_of(precision)
        self.group_size = int(group_size)

    def load(self, load_mtp: bool) -> ModelWeights:
        c = self.cfg
        self.ckpt.used.clear()     # what this load reads, for _check_all_used
        embed, norm, lm_head = self._embed_norm_head()
        if self.stream_experts:
            # the routed experts are read later, by the expert cache; they count as used
            self.ckpt.used.update(n for n in self.ckpt.names() if ".mlp.experts." in n)
        if self.shard is not None:
            self.ckpt.mark_others_used()
        layers = [self._layer(i) for i in range(c.num_hidden_layers)]
        mtp = self._mtp(embed, lm_head) if load_mtp else None   # the MTP head shares the stored lm_head
        if self.quantize_lm_head and lm_head.quant is None:
            lm_head = self._int8_rows(lm_head)
        self._check_all_used()
        return ModelWeights(embed=embed, norm=norm, lm_head=lm_head, layers=layers, mtp=mtp)

    def _embed_norm_head(self) -> tuple:
        """(embedding, final norm, lm_head): the lm_head is the embedding when tied."""
        c, H = self.cfg, self.cfg.hidden_size
        embed = self._t("model.embed_tokens.weight", (c.vocab_size, H),
                        "bf16" if self._keeps_bf16("model.embed_tokens.weight") else None)
        norm = self._t("model.norm.weight", (H,))
        if "lm_head.weight" in self.ckpt:
            lm_head = self._w("lm_head.weight", (c.vocab_size, H))
        elif c.tie_word_embeddings:
            lm_head = embed
        else:
            raise CheckpointError(f"{self.ckpt.dir}: tensor 'lm_head.weight' is missing from the checkpoint")
        return embed, norm, lm_head

    # ------------------------------------------------------------------ what the config left out
    def _check_all_used(self) -> None:
        """A tensor the config does not read means the config describes another model than the
        weights (fewer layers, no shared experts, another routing): running it would compute
        garbage, so it is an error. The known extras: the MTP layers (model.layers.{L}.. per
        num_nextn_predict_layers, each with its eh_proj; read only when MTP is loaded) and rotary
        inv_freq buffers (rope recomputes them from the config)."""
        c, L = self.cfg, self.cfg.num_hidden_layers

        def mtp(i: Optional[int]) -> bool:
            return i is not None and L <= i < L + c.num_nextn_predict_layers and is_mtp_layer(self.ckpt, i)

        left = [n for n in self.ckpt.names() if n not in self.ckpt.used and not n.endswith(_INV_FREQ)]
        unused = sorted((n for n in left if not mtp(_layer_of(n))), key=lambda n: (_layer_of(n) or 0, n))
        if not unused:
            return
        src, shown = c.source, ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        last = max((_layer_of(n) for n in unused if _layer_of(n) is not None), default=-1)
        if last >= L:
            raise CheckpointError(
                f"{src} says {L} layer{'s' if L > 1 else ''} (+ {c.num_nextn_predict_layers} MTP), but the checkpoint "
                f"{self.ckpt.dir} holds model.layers.{last}.* ({shown} are unused): this config.json belongs to "
                f"another model; use the one that came with the weights")
        raise CheckpointError(
            f"{self.ckpt.dir}: {len(unused)} tensors of the checkpoint are not used by the model {src} describes "
            f"({shown}): config.json does not match the weights (compare n_routed_experts, n_shared_experts, "
            f"q_lora_rank, topk_method, first_k_dense_replace); use the config.json that came with them")

    # ------------------------------------------------------------------ one tensor
    def _keeps_bf16(self, name: str) -> bool:
        """A float tensor the precision leaves as it is (lm_head, the embedding table) stays bf16 when
        stored bf16, under every precision but f32 and "as stored with activations' dtype" (None):
        bf16 converts to f32 exactly, so the model computes the same values, and an f32 copy would
        double the bytes decode reads (V2-Lite's lm_head: 420 MB more per token)."""
        return self.weight_format not in (None, "f32") and self.ckpt.array(name).dtype == D.get("bf16").np

    def _w(self, name, shape, part=None) -> Tensor:
        """A linear weight in the model's precision on the backend; part (axis, lo, hi): only those
        rows (axis 0) or columns (1) of a plain float stored weight, converted as the whole would be
        (the shared experts' pieces, _shared_as_experts)."""
        be, fmt = self.backend, self.weight_format
        if not QF.is_quantizable(name, shape) and self._keeps_bf16(name):
            t = self._stored(name, shape, None, part)
            if t.quant is None:
                return be.upload(t)
        if fmt is None or not QF.is_quantizable(name, shape):
            t = self._stored(name, shape, self.dtype, part)
            if t.quant is not None and not QF.is_quantizable(name, shape) and fmt is not None:
                return self.dequantized(be.upload(t), self.dtype)
            return be.upload(t)
        if fmt in ("f32", "bf16"):
            # float precisions keep these weights in that dtype (activations may differ); the stored
            # tensor as it is says whether it is quantized, so a part is copied once, in fmt
            if self.ckpt.weight(name, shape, None).quant is not None:
                return self.dequantized(be.upload(self._stored(name, shape, None, part)), fmt)
            return be.upload(self._stored(name, shape, fmt, part))
        t = self._stored(name, shape, None, part)
        qdt, block = self._quantized_as(fmt)
        if t.quant is not None:
            if t.dtype.name == qdt and tuple(t.quant.block) == block:
                return be.upload(t)
            raise CheckpointError(f"{self.ckpt.file_of(name)}: {name!r} is stored as {t.quant.describe(t.dtype)}; "
                                  f"precision {self.precision} would re-quantize it (load it as stored, bf16 or f32)")
        N, K = t.shape
        grid = (-(-N // block[0]) if block[0] else 1, -(-K // block[1]) if block[1] else 1)
        q = be.empty((N, K), qdt)
        q.quant = Quant(be.empty(grid, "f32"), block)
        be.quantize(x=be.upload(t), out=q, scale_pow2=0)
        return q

    def _stored(self, name, shape, dtype=None, part=None) -> Tensor:
        """The checkpoint's host tensor (ckpt.weight), or a contiguous copy of a part of it: rows
        (axis 0) or columns (axis 1) [lo, hi)."""
        t = self.ckpt.weight(name, shape, dtype)
        if part is None:
            return t
        if t.quant is not None:
            raise ValueError(f"{name}: a slice of a weight stored quantized")
        axis, lo, hi = part
        a = t.numpy()
        return Tensor.from_numpy(np.ascontiguousarray(a[lo:hi] if axis == 0 else a[:, lo:hi]))

    def _quantized_as(self, fmt: str) -> tuple:
        """(storage dtype, quantization block) of a quantized weight format at this load."""
        return {"int8": ("int8", (1, 0)), "int4": ("int4", (1, self.group_size)), "fp8": ("e4m3", (128, 128))}[fmt]

    def _int8_rows(self, w: Tensor) -> Tensor:
        """w quantized to int8 with one scale per row (the backend's quantize op), for the head."""
        N, K = w.shape
        q = self.backend.empty((N, K), "int8")
        q.quant = Quant(self.backend.empty((N, 1), "f32"), (1, 0))
        self.backend.quantize(x=w, out=q, scale_pow2=0)
        return q

    def dequantized(self, t: Tensor, dtype: str) -> Tensor:
        out = self.backend.empty(t.shape, dtype)
        self.backend.dequantize(x=t, out=out)
        return out

    def _t(self, name, shape, dtype=None) -> Tensor:
        return self.backend.upload(self.ckpt.tensor(name, shape, dtype or self.dtype))

    def _opt(self, name, shape, dtype=None) -> Optional[Tensor]:
        return self._t(name, shape, dtype) if name in self.ckpt else None

    # ------------------------------------------------------------------ blocks
    def _attention(self, a: str) -> AttentionWeights:
        c, H, NH = self.cfg, self.cfg.hidden_size, self.cfg.num_attention_heads
        kv_b = self._w(a + "kv_b_proj.weight", (NH * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        w = AttentionWeights(
            kv_a=self._w(a + "kv_a_proj_with_mqa.weight", (c.cache_width, H)),
            kv_a_bias=self._opt(a + "kv_a_proj_with_mqa.bias", (c.cache_width,)),
            kv_a_norm=self._t(a + "kv_a_layernorm.weight", (c.kv_lora_rank,)),
            kv_b=kv_b,
            # mla_decode takes a plain kv_b: dequantize once, on the backend
            kv_b_dense=self.dequantized(kv_b, self.dtype) if kv_b.quant is not None else kv_b,
            o=self._w(a + "o_proj.weight", (H, NH * c.v_head_dim)),
            o_bias=self._opt(a + "o_proj.bias", (H,)))
        if self.shard is not None and self.shard.tp_rank and w.o_bias is not None:
            w.o_bias = None      # o_proj's partial sums are all-reduced: one rank adds the bias
        if c.q_lora_rank:
            w.q_a = self._w(a + "q_a_proj.weight", (c.q_lora_rank, H))
            w.q_a_bias = self._opt(a + "q_a_proj.bias", (c.q_lora_rank,))
            w.q_a_norm = self._t(a + "q_a_layernorm.weight", (c.q_lora_rank,))
            w.q_b = self._w(a + "q_b_proj.weight", (NH * c.qk_head_dim, c.q_lora_rank))
        else:
            w.q = self._w(a + "q_proj.weight", (NH * c.qk_head_dim, H))
        if c.dsa is not None:
            NI, Di, p = c.dsa.index_n_heads, c.dsa.index_head_dim, a + "indexer."
            w.indexer = DSAIndexerWeights(
                wq_b=self._w(p + "wq_b.weight", (NI * Di, c.q_lora_rank)), wk=self._w(p + "wk.weight", (Di, H)),
                k_norm=self._t(p + "k_norm.weight", (Di,)), k_norm_bias=self._t(p + "k_norm.bias", (Di,)),
                weights_proj=self._router_weight(p + "weights_proj.weight", (NI, H)))
        first = "q_a" if c.q_lora_rank else "q"
        if w.q_a_bias is None and w.kv_a_bias is None:
            fused = self.stack_rows(getattr(w, first), w.kv_a)
            if fused is not None:
                w.x_proj, top, w.kv_a = fused
                setattr(w, first, top)
        return w

    def stack_rows(self, a: Tensor, b: Tensor):
        """(fused, view of a, view of b): a and b [Na, K], [Nb, K] copied into one [Na + Nb, K]
        weight, or None when they differ in dtype, columns or quantization, or a's rows end inside a
        quantization block. The originals are released by the caller (nothing keeps them)."""
        if a.dtype != b.dtype or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
            return None
        if not (a.is_contiguous() and b.is_contiguous()) or a.offset or b.offset:
            return None
        qa, qb = a.quant, b.quant
        if (qa is None) != (qb is None):
            return None
        if qa is not None:
            if tuple(qa.block) != tuple(qb.block) or (qa.zeros is None) != (qb.zeros is None):
                return None
            br = qa.block[0] or a.shape[0]
            if a.shape[0] % br or qa.scales.dtype != qb.scales.dtype or qa.scales.shape[1:] != qb.scales.shape[1:]:
                return None
        be, Na, Nb, K = self.backend, a.shape[0], b.shape[0], a.shape[1]

        def stacked(x, y):
            out = be.empty((x.shape[0] + y.shape[0],) + tuple(x.shape[1:]), x.dtype)
            top = Tensor(out.buffer, x.shape, x.dtype, None, out.offset)
            bottom = Tensor(out.buffer, y.shape, y.dtype, None, out.offset + x.nbytes)
            copy_bytes(be, top, x)
            copy_bytes(be, bottom, y)
            return out, top, bottom

        out, top, bottom = stacked(a, b)
        if qa is not None:
            s, s_top, s_bot = stacked(qa.scales, qb.scales)
            z, z_top, z_bot = stacked(qa.zeros, qb.zeros) if qa.zeros is not None else (None, None, None)
            out.quant, top.quant, bottom.quant = Quant(s, qa.block, z), Quant(s_top, qa.block, z_top), \
                Quant(s_bot, qa.block, z_bot)
        be.synchronize()
        return out, top, bottom

    def _mlp(self, p: str, I: int) -> MLPWeights:
        H = self.cfg.hidden_size
        m = MLPWeights(gate=self._w(p + "gate_proj.weight", (I, H)), up=self._w(p + "up_proj.weight", (I, H)),
                       down=self._w(p + "down_proj.weight", (H, I)))
        fused = self.stack_rows(m.gate, m.up)
        if fused is not None:
            m.gate_up, m.gate, m.up = fused
        return m

    # ------------------------------------------------------------------ routed experts, one at a time
    def expert_names(self, prefix: str, e: int) -> tuple:
        """((name, shape) of gate, up, down) of routed expert e of the MoE layer at `prefix`."""
        I, H = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        return tuple((f"{prefix}experts.{e}.{p}_proj.weight", shape)
                     for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))))

    def expert_weight(self, name: str, shape) -> Tensor:
        """One expert weight in the model's precision on the backend (converted as the eager load does)."""
        return self._w(name, shape)

    def stored_weight(self, name: str, shape) -> Optional[Tensor]:
        """The host tensor (a view of the checkpoint's memory map) that the eager load would upload
        unchanged, or None when the load converts it (a cast, a dequantization, a quantization)."""
        fmt = self.weight_format
        if fmt is None:
            t = self.ckpt.weight(name, shape, self.dtype)
        elif fmt in ("f32", "bf16"):
            t = self.ckpt.weight(name, shape, fmt)
            if t.quant is not None:
                return None
        else:
            t = self.ckpt.weight(name, shape)
            qdt, block = self._quantized_as(fmt)
            if t.quant is None or t.dtype.name != qdt or tuple(t.quant.block) != block:
                return None
        return t

    def check_streamed_experts(self, m: str) -> None:
        """Every routed expert the config names is in the checkpoint (an expert cache reads them later;
        their shapes are checked when first loaded)."""
        for e in range(self.cfg.n_routed_experts):
            for name, _ in self.expert_names(m, e):
                if name not in self.ckpt:
                    raise CheckpointError(f"{self.ckpt.dir}: tensor {name!r} is missing from the checkpoint")

    def _moe(self, m: str) -> MoEWeights:
        c, H = self.cfg, self.cfg.hidden_size
        E, I = c.n_routed_experts, c.moe_intermediate_size
        # the routed experts this rank holds (all of them without expert parallelism)
        mine = self.shard.expert_range(E) if self.shard is not None else range(E)
        Ir = I    # a routed expert's intermediate size: whole experts under expert parallelism
        if self.shard is not None and self.shard.ep > 1:
            Ir = self.ckpt.global_config.moe_intermediate_size
        if self.stream_experts:
            self.check_streamed_experts(m)
        w = MoEWeights(
            prefix=m, shared=None,
            # the router's logits are f32 like transformers'. A bf16 router weight stays bf16 when the
            # activations are bf16: transformers upcasts both to f32, which changes no value, and the
            # linear multiplies bf16 exactly into f32 sums (only the summation order differs), at half
            # the bytes and on the tensor-core path. Anything else is kept (or made) f32.
            gate=self._router_weight(m + "gate.weight", (E, H)),
            gate_bias=self._t(m + "gate.e_score_correction_bias", (E,), "f32") if c.topk_method == "noaux_tc" else None,
            experts_gate=None if self.stream_experts else
            [self._w(f"{m}experts.{e}.gate_proj.weight", (Ir, H)) for e in mine],
            experts_up=None if self.stream_experts else
            [self._w(f"{m}experts.{e}.up_proj.weight", (Ir, H)) for e in mine],
            experts_down=None if self.stream_experts else
            [self._w(f"{m}experts.{e}.down_proj.weight", (H, Ir)) for e in mine])
        if c.n_shared_experts:
            w.shared_experts = self._shared_as_experts(m, w, c.n_shared_experts, I)
            if w.shared_experts is None:
                w.shared = self._mlp(m + "shared_experts.", I * c.n_shared_experts)
        return w

    def _shared_as_experts(self, m: str, w: MoEWeights, n: int, I: int) -> Optional[tuple]:
        """The n shared experts of the MoE layer at m as n routed experts (gates, ups, downs): pieces
        j of the shared MLP's intermediate columns [j I, (j + 1) I), which sum to the MLP (silu_mul is
        per column, down sums over them). moe_experts then runs them with the routed experts in one
        op: three launches fewer per layer (gate_up, silu_mul, down), and their sum is rounded once.
        None where that would change what the model computes or how moe_experts runs it: not asked
        for, streamed or expert-parallel experts (the shared MLP runs apart there), a stored format
        other than the routed experts', pieces that split a quantization block or a per-row scale,
        a slice of a weight stored quantized, activations quantized per token."""
        E = len(w.experts_gate or ())
        if not self.shared_as_routed or not E or (self.shard is not None and self.shard.ep > 1):
            return None
        if self.precision is not None and QF.PRECISION_PATHS[self.precision].activations == "int8":
            return None         # the shared MLP's linears quantize their input (w8a8, w4a8); moe_experts does not
        H, p = self.cfg.hidden_size, m + "shared_experts."
        names = [(p + f"{k}_proj.weight", shape) for k, shape in
                 (("gate", (n * I, H)), ("up", (n * I, H)), ("down", (H, n * I)))]
        stored = [self.ckpt.weight(nm, shape) for nm, shape in names]
        routed = [self.ckpt.weight(f"{m}experts.0.{k}_proj.weight", shape) for k, shape in
                  (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))]
        for a, b in zip(stored, routed):
            if a.dtype != b.dtype or (a.quant is None) != (b.quant is None):
                return None
            if a.quant is not None and (n > 1 or tuple(a.quant.block) != tuple(b.quant.block)):
                return None
        if n > 1 and self.weight_format not in (None, "f32", "bf16"):
            rows, cols = self._quantized_as(self.weight_format)[1]
            if (rows > 1 and I % rows) or not cols or I % cols:
                return None     # a piece would get scales of its own: other values than the whole's
        # gate and up: rows of the pieces; down: their columns
        pieces = tuple([self._w(nm, shape, None if n == 1 else (int(k == 2), j * I, (j + 1) * I)) for j in range(n)]
                       for k, (nm, shape) in enumerate(names))
        # the rules above stand in for the loaded layouts moe_experts needs equal (checked here: where
        # they differ, the shared MLP runs on its own, computing the same)
        firsts = (w.experts_gate[0], w.experts_up[0], w.experts_down[0])
        if any(_layout(t) != _layout(f) for loaded, f in zip(pieces, firsts) for t in loaded):
            return None
        return pieces

    def _router_weight(self, name, shape) -> Tensor:
        a = self.ckpt.array(name, shape)
        keep_bf16 = self.dtype == "bf16" and a.dtype == D.get("bf16").np
        return self._t(name, shape, "bf16" if keep_bf16 else "f32")

    def _layer(self, i: int) -> LayerWeights:
        c, H = self.cfg, self.cfg.hidden_size
        p = f"model.layers.{i}."
        w = LayerWeights(index=i, ln1=self._t(p + "input_layernorm.weight", (H,)),
                         ln2=self._t(p + "post_attention_layernorm.weight", (H,)),
                         attn=self._attention(p + "self_attn."))
        if c.is_moe_layer(i):
            w.moe = self._moe(p + "mlp.")
        else:
            w.mlp = self._mlp(p + "mlp.", c.intermediate_size)
        return w

    def _mtp(self, embed: Tensor, lm_head: Tensor) -> MTPWeights:
        c, H = self.cfg, self.cfg.hidden_size
        L = c.num_hidden_layers
        p = f"model.layers.{L}."
        head, embed = self.mtp_head_embed(p, embed, lm_head)
        return MTPWeights(
            layer=self._layer(L),
            enorm=self._t(p + "enorm.weight", (H,)),
            hnorm=self._t(p + "hnorm.weight", (H,)),
            eh_proj=self._w(p + "eh_proj.weight", (H, 2 * H)),
            head_norm=self._t(p + "shared_head.norm.weight", (H,)),
            head=head, embed=embed)

    def mtp_head_embed(self, p: str, embed: Tensor, lm_head: Tensor) -> tuple:
        """The MTP layer's head and embedding: its own copies when the checkpoint has them, else the
        main model's (V3 ships copies, V4 shares them)."""
        c, H = self.cfg, self.cfg.hidden_size
        return ((self._w(p + "shared_head.head.weight", (c.vocab_size, H))
                 if p + "shared_head.head.weight" in self.ckpt else lm_head),
                (self._t(p + "embed_tokens.weight", (c.vocab_size, H))
                 if p + "embed_tokens.weight" in self.ckpt else embed))
