"""The DeepSeek V2/V3 model: config, checkpoint loading, the graph, plans and the paged KV cache."""
from __future__ import annotations

from .checkpoint import Checkpoint, SafetensorsFile, TensorStore
from .config import ModelConfig
from .deepseek import DeepseekModel, SeqInput
from .kv_cache import CacheFullError, PagedKVCache


def load_model(model_dir, backend, engine_config=None) -> DeepseekModel:
    """A DeepseekModel sized and typed from an EngineConfig: max_batch, max_seq_len, kv_cache_tokens,
    kv_block_size, activation_dtype, precision (auto: the checkpoint's own precision when it fits the
    memory budget, else the most accurate path that does; fastest: the fastest that fits; see
    precision.resolve) and group_size. Sets model.precision_reason and model.precision_lossy."""
    ckpt = Checkpoint(model_dir)
    ec = engine_config
    if ec is None:
        return DeepseekModel(ckpt, backend)
    from .. import precision as P
    from .. import quant_formats as QF

    bs = int(getattr(ec, "kv_block_size", 16) or 16)
    scheme = ckpt.config.quant_scheme
    # an int4 checkpoint keeps its own groups; the config's group_size is for quantizing at load
    group = scheme.group_size if scheme is not None and scheme.format == "int4" else ec.group_size
    kw = dict(max_batch=int(ec.max_batch), max_seq_len=int(ec.max_seq_len), block_size=bs, group_size=int(group))
    tokens = getattr(ec, "kv_cache_tokens", None)
    if tokens:
        kw["num_cache_blocks"] = -(-int(tokens) // bs)
    act = getattr(ec, "activation_dtype", "auto")
    kw["dtype"] = P.default_activation_dtype(backend) if act in (None, "auto") else act
    spec = getattr(ec, "speculative", None) or {}
    kw["load_mtp"] = bool(spec.get("mtp", True))
    entries = ckpt.entries()
    shapes = QF.logical_shapes(entries, ckpt.array)
    stored = P.stored_precision(entries, scheme)
    precision, reason = P.resolve(backend, ec, shapes, scheme.to_config() if scheme is not None else None,
                                  stored=stored)
    lossy = P.is_lossy(precision, stored[0])
    if scheme is not None and precision == scheme.format:
        precision = None   # the checkpoint's own format: the weights are used as stored
    model = DeepseekModel(ckpt, backend, precision=precision, **kw)
    model.precision_reason = reason
    model.precision_lossy = lossy   # the weights compute something other than the stored ones
    return model


__all__ = ["Checkpoint", "SafetensorsFile", "TensorStore", "ModelConfig", "DeepseekModel", "SeqInput", "PagedKVCache",
           "CacheFullError", "load_model"]
