"""EngineConfig: every knob of an engine, from JSON (`--config FILE`) or a dict; unknown keys are errors.

Each nested section is checked by its own parser when the config is made, so a bad value fails here
and not when the engine starts: `expert_cache` by model.expert_cache.ExpertCacheConfig, and
`speculative` by SpecConfig below (MTP speculative decoding; engine.speculative runs it).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from . import validate as V
from .errors import ConfigError
from .model.expert_cache import ExpertCacheConfig
from .quant_formats import PRECISION_PATHS

PRECISIONS = ("auto", "fastest") + tuple(PRECISION_PATHS)
# bounds that no real deployment reaches but that keep sizes computed from them far from overflow
MAX_BATCH = 1 << 16
MAX_SEQ_LEN = 1 << 24          # 16M tokens, beyond every DeepSeek context
MAX_KV_TOKENS = 1 << 40
MAX_BLOCK_SIZE = 1 << 16
MAX_DRAFT = 8                  # MTP draft tokens per step (speculative.num_draft)


@dataclass
class EngineConfig:
    backend: Optional[str] = None        # "reference", "cpu", "cuda", a path to a .so, or None = best found
    # one of PRECISIONS. "auto": the checkpoint's own precision when it fits memory, else the most
    # accurate path that fits; "fastest": the fastest path that fits; or a format, forced
    precision: str = "auto"
    group_size: int = 64                 # int4 group size when the engine quantizes weights itself
    # int8 / int4 / w8a8 / w4a8 only: also quantize the output layer (lm_head) to int8 per channel,
    # as llama.cpp's Q8_0 / Q4_0 files do (Q8_0 / Q6_K there). Off by default: the head stays as
    # stored, the most accurate choice; on, decode reads about 1 byte instead of 2 per head weight
    # (V2-Lite: 210 MB less per token)
    quantize_lm_head: bool = False
    memory_budget_bytes: Optional[int] = None   # None: the device's free memory
    max_batch: int = 8                   # sequences running together (the scheduler's max_num_seqs)
    max_seq_len: int = 2048              # longest prompt + generation
    # KV cache capacity in tokens. None: kv_cache_memory_fraction of the memory free after a warm-up
    # step (host backends stop at max_batch * max_seq_len tokens)
    kv_cache_tokens: Optional[int] = None
    kv_cache_memory_fraction: float = 0.9
    kv_block_size: int = 16              # tokens per cache block
    max_num_batched_tokens: Optional[int] = None   # prompt tokens per prefill step (None: max(512, max_batch))
    enable_prefix_cache: bool = True     # share the KV of equal prompt prefixes (full blocks) between requests
    # device backends replay each decode step as one captured graph; true runs every op from Python
    # (the debug path: an op's failure names the op)
    enforce_eager: bool = False
    max_queue: int = 1024                # requests waiting for admission before add_request refuses more
    # "fcfs": requests run in arrival order; "priority": by each request's priority (lower first, then
    # arrival), and a waiting request preempts running ones of a lower priority (vLLM's policy)
    scheduling_policy: str = "fcfs"
    num_threads: int = 0                 # host threads for the CPU backend (0: all)
    device_id: int = 0
    fallback: bool = False               # run ops the backend lacks on the reference (logged)
    activation_dtype: str = "auto"       # "f32", "bf16" or "auto" (f32 on CPU backends)
    # MTP speculative decoding (engine.speculative): {"method": "mtp", "num_draft": K (1..8, default
    # 2), "confidence": "auto" (the throughput scheduler) or a survival threshold in [0, 1) (0: always
    # K drafts)}. {} (default): off. {"mtp": false} skips loading the MTP head (saves its memory)
    speculative: dict = field(default_factory=dict)
    # routed MoE experts on demand (model.expert_cache): {"capacity": fraction of all routed expert
    # bytes or bytes, "source": "host" | "disk", "prefetch": bool, "policy": "lfru" | "lru", "fill":
    # bool, "pause_free": bool}. None: every
    # expert is loaded at start. {"capacity": 1.0} is lazy loading (experts load when first routed).
    # Unset source / prefetch are chosen per backend (ExpertCacheConfig says how)
    expert_cache: Optional[dict] = None
    # several processes on one model (deepinfer.parallel; started by mpirun, or by `deepinfer run|serve
    # --tensor-parallel N`): attention heads and dense MLPs split over tensor_parallel ranks, routed
    # experts over expert_parallel ranks. Each is 1 or the job's size. Rank r uses device device_id + r
    tensor_parallel: int = 1
    expert_parallel: int = 1
    verbose: bool = False               # log backend, precision choice and plan sizes to stderr
    revision: Optional[str] = None      # branch, tag or commit when the model is a hub id (org/name)

    @classmethod
    def from_any(cls, cfg=None, **overrides) -> "EngineConfig":
        if cfg is None:
            data = {}
        elif isinstance(cfg, EngineConfig):
            data = asdict(cfg)
        elif isinstance(cfg, dict):
            data = dict(cfg)
        elif isinstance(cfg, (str, Path)):
            data = V.read_json(cfg, "engine config", err=ConfigError)
            if not isinstance(data, dict):
                raise ConfigError(f"config file {cfg} must hold a JSON object of engine settings, not a "
                                  f"{type(data).__name__}")
        else:
            raise ConfigError(f"config must be a dict, a path or an EngineConfig, not {type(cfg).__name__}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = [k for k in data if k not in known]
        if unknown:
            raise ConfigError(f"unknown engine config key(s) {', '.join(map(repr, unknown))}; valid keys: "
                              f"{', '.join(sorted(known))}")
        c = cls(**data)
        c.validate()
        return c

    def validate(self) -> None:
        """Every value has exactly the type and range it needs; nothing is coerced (a bool is not an
        int, "no" is not false, 256.7 is not 256) and nothing out of range is quietly ignored."""
        if self.backend is not None:
            V.text("backend", self.backend)
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if V.integer("group_size", self.group_size) not in (32, 64, 128):
            raise ConfigError(f"group_size must be 32, 64 or 128, not {self.group_size}")
        V.optional_integer("memory_budget_bytes", self.memory_budget_bytes, 1)
        V.integer("max_batch", self.max_batch, 1, MAX_BATCH)
        V.integer("max_seq_len", self.max_seq_len, 1, MAX_SEQ_LEN)
        V.optional_integer("kv_cache_tokens", self.kv_cache_tokens, 1, MAX_KV_TOKENS)
        V.number("kv_cache_memory_fraction", self.kv_cache_memory_fraction, 0, 1, lo_open=True)
        V.integer("kv_block_size", self.kv_block_size, 1, MAX_BLOCK_SIZE)
        V.optional_integer("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_KV_TOKENS)
        for k in ("enable_prefix_cache", "enforce_eager", "fallback", "verbose", "quantize_lm_head"):
            V.boolean(k, getattr(self, k))
        V.integer("max_queue", self.max_queue, 0)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', not {self.scheduling_policy!r}")
        V.integer("num_threads", self.num_threads, 0, 4096)
        V.integer("device_id", self.device_id, 0, 4096)
        tp = V.integer("tensor_parallel", self.tensor_parallel, 1, 4096)
        ep = V.integer("expert_parallel", self.expert_parallel, 1, 4096)
        if tp > 1 and ep > 1 and tp != ep:
            raise ConfigError(f"tensor_parallel {tp} and expert_parallel {ep}: each is 1 or the number of ranks, "
                              f"so two above 1 must be equal")
        if max(tp, ep) > 1 and self.expert_cache is not None:
            raise ConfigError("expert_cache with tensor_parallel / expert_parallel: the ranks already split the "
                              "experts; drop expert_cache or run on one rank")
        if max(tp, ep) > 1 and self.speculative and self.speculative.get("method"):
            raise ConfigError("speculative decoding with tensor_parallel / expert_parallel is not supported yet: "
                              "drop speculative or run on one rank")
        if self.activation_dtype not in ("auto", "f32", "bf16"):
            raise ConfigError(f"activation_dtype must be auto, f32 or bf16, not {self.activation_dtype!r}")
        if self.revision is not None:
            V.text("revision", self.revision)
        if self.expert_cache is not None:
            ExpertCacheConfig.parse(self.expert_cache)
        if not isinstance(self.speculative, dict):
            raise ConfigError(f"speculative must be an object such as {{\"method\": \"mtp\", \"num_draft\": 2}}, "
                              f"not {self.speculative!r}")
        SpecConfig.parse(self.speculative)

    @property
    def world_size(self) -> int:
        """The ranks this config runs on (1: one process)."""
        return max(self.tensor_parallel, self.expert_parallel)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass
class SpecConfig:
    """The `speculative` section of an EngineConfig, parsed; None (from parse) when speculation is off."""

    method: str = "mtp"
    num_draft: int = 2
    confidence: object = "auto"     # "auto" (throughput scheduler) or a survival threshold in [0, 1)

    @classmethod
    def parse(cls, spec: Optional[dict]) -> Optional["SpecConfig"]:
        """None when speculation is off (no method); ConfigError for anything malformed."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative must be an object such as {{\"method\": \"mtp\", \"num_draft\": 2}}, "
                              f"not {spec!r}")
        known = {"method", "num_draft", "confidence", "mtp"}
        unknown = sorted(map(str, set(spec) - known))
        if unknown:
            raise ConfigError(f"unknown speculative option(s) {unknown}; valid: method (\"mtp\"), num_draft "
                              f"(1..{MAX_DRAFT}), confidence (\"auto\" or a threshold in [0, 1)), mtp (load the MTP "
                              f"head: false saves its memory and turns speculation off)")
        if "mtp" in spec:
            V.boolean("speculative.mtp", spec["mtp"])
        if "method" not in spec:
            if set(spec) - {"mtp"}:
                raise ConfigError("speculative: set \"method\": \"mtp\" to speculate (num_draft and confidence "
                                  "need it)")
            return None
        if spec["method"] != "mtp":
            raise ConfigError(f"speculative.method {spec['method']!r} is not supported: only \"mtp\" (DeepSeek's "
                              f"multi-token prediction module)")
        if spec.get("mtp", True) is False:
            raise ConfigError("speculative: method \"mtp\" needs the MTP head; drop \"mtp\": false")
        c = cls()
        c.num_draft = V.integer("speculative.num_draft", spec.get("num_draft", c.num_draft), 1, MAX_DRAFT)
        conf = spec.get("confidence", "auto")
        if conf != "auto":
            if isinstance(conf, str):
                raise ConfigError(f"speculative.confidence must be \"auto\" or a number in [0, 1), not {conf!r}")
            conf = V.number("speculative.confidence", conf, 0, 1)
            if conf >= 1:
                raise ConfigError(f"speculative.confidence must be below 1 (a survival probability threshold; 1 "
                                  f"would admit nothing), not {conf}")
        c.confidence = conf
        return c
