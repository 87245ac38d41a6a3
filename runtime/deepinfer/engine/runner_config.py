"""RunnerConfig: how a ModelRunner is sized and typed (engine.model_runner).

The engine builds one from its EngineConfig (engine.runner_factory.load_runner); tests and
benchmarks build one directly: ModelRunner(checkpoint, backend, RunnerConfig(max_batch=2, ...)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import quant_formats as QF

PRECISIONS = (None,) + tuple(QF.PRECISION_PATHS)


@dataclass
class RunnerConfig:
    max_batch: int = 8
    max_seq_len: Optional[int] = None               # None: the model's max positions, at most 4096
    num_cache_blocks: Optional[int] = None          # KV blocks; None: see kv_cache_memory_fraction
    block_size: int = 16                            # tokens per KV block
    dtype: str = "f32"                              # activations: "f32" or "bf16"
    load_mtp: bool = True                           # load the MTP layer when the checkpoint has one
    precision: Optional[str] = None                 # weight format of the quantizable linears (None: as stored)
    group_size: int = 64                            # quantization group when quantizing at load
    max_num_batched_tokens: Optional[int] = None    # None: max(512, max_batch)
    # num_cache_blocks None and this set: the KV cache takes this part of the memory free after
    # a warm-up step; both None: max_batch full-length sequences
    kv_cache_memory_fraction: Optional[float] = None
    enable_prefix_cache: bool = True
    enforce_eager: bool = False                     # never capture graphs
    quantize_lm_head: bool = False
    expert_cache: object = None                     # model.expert_cache.ExpertCacheConfig.parse's input
    # the shared experts run inside moe_experts, as routed experts every token takes (where the
    # weights' layout allows it: model.weights.WeightLoader._shared_as_experts); False: as their own MLP
    shared_experts_routed: bool = True

    def check(self) -> None:
        """The errors a malformed runner config raises before anything is loaded."""
        if self.dtype not in ("f32", "bf16"):
            raise ValueError(f"activation dtype must be 'f32' or 'bf16', not {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {PRECISIONS}")
