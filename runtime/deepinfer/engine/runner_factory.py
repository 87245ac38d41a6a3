"""load_runner: a ModelRunner sized and typed from an EngineConfig (what the engine and its worker
ranks load), the precision resolved against the memory the backend has (deepinfer.precision).
"""
from __future__ import annotations

from .. import precision as P
from .. import quant_formats as QF
from ..model.checkpoint import Checkpoint
from .model_runner import ModelRunner
from .runner_config import RunnerConfig


def load_runner(model_dir, backend, engine_config=None, group=None) -> ModelRunner:
    """A ModelRunner sized and typed from an EngineConfig: max_batch, max_seq_len, kv_cache_tokens
    (None: sized from the memory free after a warm-up, kv_cache_memory_fraction of it),
    kv_block_size, max_num_batched_tokens, activation_dtype, precision (auto: the checkpoint's own
    precision when it fits the memory budget, else the most accurate path that does; fastest: the
    fastest that fits; see precision.resolve) and group_size. Sets runner.precision_reason and
    runner.precision_lossy."""
    ckpt = Checkpoint(model_dir)
    ec = engine_config
    if ec is None:
        return ModelRunner(ckpt, backend)
    bs = int(getattr(ec, "kv_block_size", 16) or 16)
    scheme = ckpt.config.quant_scheme
    # an int4 checkpoint keeps its own groups; the config's group_size is for quantizing at load
    gsize = scheme.group_size if scheme is not None and scheme.format == "int4" else ec.group_size
    kw = dict(max_batch=int(ec.max_batch), max_seq_len=int(ec.max_seq_len), block_size=bs, group_size=int(gsize),
              max_num_batched_tokens=getattr(ec, "max_num_batched_tokens", None),
              enable_prefix_cache=bool(getattr(ec, "enable_prefix_cache", True)),
              enforce_eager=bool(getattr(ec, "enforce_eager", False)),
              quantize_lm_head=bool(getattr(ec, "quantize_lm_head", False)),
              expert_cache=getattr(ec, "expert_cache", None))
    tokens = getattr(ec, "kv_cache_tokens", None)
    if tokens:
        kw["num_cache_blocks"] = -(-int(tokens) // bs)
    else:
        kw["kv_cache_memory_fraction"] = float(getattr(ec, "kv_cache_memory_fraction", 0.9))
    act = getattr(ec, "activation_dtype", "auto")
    kw["dtype"] = P.default_activation_dtype(backend) if act in (None, "auto") else act
    spec = getattr(ec, "speculative", None) or {}
    kw["load_mtp"] = bool(spec.get("mtp", True))
    entries = ckpt.entries()
    shapes = QF.logical_shapes(entries, ckpt.array)
    if group is not None and group.world > 1:
        # what fits is what one rank holds: its shards, and only its routed experts
        plan, E = group.shard, ckpt.config.n_routed_experts
        shapes = {n: plan.local_shape(n, sh) for n, sh in shapes.items() if plan.owns(n, E)}
    stored = P.stored_precision(entries, scheme)
    precision, reason = P.resolve(backend, ec, shapes, scheme.to_config() if scheme is not None else None,
                                  stored=stored)
    if group is not None and group.world > 1:
        # one precision for the job: rank 0's choice (ranks with less free memory would differ)
        precision, reason = group.from_driver(precision) or None, group.from_driver(reason)
    lossy = P.is_lossy(precision, stored[0])
    if scheme is not None and precision == scheme.format:
        precision = None   # the checkpoint's own format: the weights are used as stored
    runner = ModelRunner(ckpt, backend, RunnerConfig(precision=precision, **kw), group=group)
    runner.precision_reason = reason
    runner.precision_lossy = lossy   # the weights compute something other than the stored ones
    return runner
