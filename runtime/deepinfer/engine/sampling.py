"""Sampling parameters of a request and the per-token seed that makes seeded sampling reproducible
regardless of which batch, row or step a token is sampled in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import ConfigError

MASK64 = (1 << 64) - 1


def step_seed(seed: int, row: int, step: int) -> int:
    """A fresh 64-bit seed per (request seed, row, step); the sample op hashes it again (splitmix64).
    The engine passes the choice index of the request as `row` and the output token's index as
    `step`, so a seeded request samples the same text alone, in any batch, or after preemption."""
    z = (seed * 0x9E3779B97F4A7C15 + row * 0xD1B54A32D192ED03 + step * 0xBF58476D1CE4E5B9 + 1) & MASK64
    z ^= z >> 31
    return z


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0        # <= 0: greedy
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    seed: int = 0
    stop: Sequence[str] = ()        # stop strings (not included in the output)
    stop_token_ids: Sequence[int] = ()   # besides the model's eos
    logprobs: Optional[int] = None  # not None: also report each output token's logprob and this many top alternatives
    ignore_eos: bool = False        # keep going past the eos token (benchmarks)

    @classmethod
    def from_options(cls, **opts) -> "SamplingParams":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigError(f"unknown sampling option(s) {unknown}; valid: {sorted(known)}")
        p = cls(**{k: v for k, v in opts.items() if v is not None})
        if isinstance(p.stop, str):
            p.stop = (p.stop,)
        if p.max_new_tokens < 0:
            raise ConfigError("max_new_tokens must be >= 0")
        if not 0.0 < p.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], not {p.top_p}")
        if p.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, not {p.temperature}")
        if p.logprobs is not None and not 0 <= p.logprobs <= 20:
            raise ConfigError(f"logprobs must be in [0, 20], not {p.logprobs}")
        if p.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, not {p.top_k}")
        return p


