"""EngineConfig: every knob of an engine, from JSON (`--config FILE`) or a dict; unknown keys are errors."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from .errors import ConfigError
from .quant_formats import PRECISION_PATHS

PRECISIONS = ("auto", "fastest") + tuple(PRECISION_PATHS)


@dataclass
class EngineConfig:
    backend: Optional[str] = None        # "reference", "cpu", "cuda", a path to a .so, or None = best found
    # one of PRECISIONS. "auto": the checkpoint's own precision when it fits memory, else the most
    # accurate path that fits; "fastest": the fastest path that fits; or a format, forced
    precision: str = "auto"
    group_size: int = 64                 # int4 group size when the engine quantizes weights itself
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
    num_threads: int = 0                 # host threads for the CPU backend (0: all)
    device_id: int = 0
    fallback: bool = False               # run ops the backend lacks on the reference (logged)
    activation_dtype: str = "auto"       # "f32", "bf16" or "auto" (f32 on CPU backends)
    # {"mtp": false} skips loading the MTP draft head (saves its memory). Speculative decoding with it
    # is not in the engine yet, so no other key is accepted: a knob that did nothing would be a lie.
    speculative: dict = field(default_factory=dict)
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
            p = Path(cfg)
            try:
                data = json.loads(p.read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file {p} not found") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"config file {p} is not valid JSON: {e}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"config file {p} must hold a JSON object")
        else:
            raise ConfigError(f"config must be a dict, a path or an EngineConfig, not {type(cfg).__name__}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown engine config key(s) {unknown}; valid keys: {sorted(known)}")
        c = cls(**data)
        c.validate()
        return c

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.group_size not in (32, 64, 128):
            raise ConfigError(f"group_size must be 32, 64 or 128, not {self.group_size}")
        for k in ("max_batch", "max_seq_len", "kv_block_size"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) <= 0:
                raise ConfigError(f"{k} must be a positive integer, not {getattr(self, k)!r}")
        if not (isinstance(self.kv_cache_memory_fraction, (int, float)) and 0 < self.kv_cache_memory_fraction <= 1):
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], not {self.kv_cache_memory_fraction!r}")
        for k in ("kv_cache_tokens", "max_num_batched_tokens"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ConfigError(f"{k} must be a positive integer or null, not {v!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be true or false, not {self.enforce_eager!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ConfigError(f"max_queue must be a non-negative integer, not {self.max_queue!r}")
        if self.activation_dtype not in ("auto", "f32", "bf16"):
            raise ConfigError(f"activation_dtype must be auto, f32 or bf16, not {self.activation_dtype!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ConfigError(f"revision must be a branch, tag or commit name, not {self.revision!r}")
        unknown_spec = set(self.speculative) - {"mtp"}
        if unknown_spec:
            raise ConfigError(f"unknown speculative option(s) {sorted(unknown_spec)}; valid: mtp (load the MTP "
                              f"head or not); MTP speculative decoding itself is not implemented yet")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)
