"""Sampling parameters of a request and the per-token seed that makes seeded sampling reproducible
regardless of which batch, row or step a token is sampled in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .. import validate as V
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
        """Validated options: exact types and ranges, so "8", 8.5, True or NaN never pass as
        something else (NaN as a temperature would silently mean greedy)."""
        known = set(cls.__dataclass_fields__)
        unknown = [k for k in opts if k not in known]
        if unknown:
            raise ConfigError(f"unknown sampling option(s) {', '.join(map(repr, unknown))}; valid: "
                              f"{', '.join(sorted(known))}")
        p = cls(**{k: v for k, v in opts.items() if v is not None})
        V.integer("max_new_tokens", p.max_new_tokens, 0, MAX_NEW_TOKENS)
        p.temperature = V.number("temperature", p.temperature, 0)
        p.top_p = V.number("top_p", p.top_p, 0, 1, lo_open=True)
        V.integer("top_k", p.top_k, 0, INT32_MAX)
        V.integer("seed", p.seed, -(1 << 63), MASK64)
        p.stop = _stop_strings(p.stop)
        if isinstance(p.stop_token_ids, (str, bytes)) or not isinstance(p.stop_token_ids, (list, tuple)):
            raise ConfigError(f"stop_token_ids must be a list of token ids, not {p.stop_token_ids!r}")
        p.stop_token_ids = tuple(V.integer("stop_token_ids[]", t, 0, INT32_MAX) for t in p.stop_token_ids)
        V.optional_integer("logprobs", p.logprobs, 0, 20)
        V.boolean("ignore_eos", p.ignore_eos)
        return p


# the sample op reads top_k as int32; longer outputs than this are not a request but a mistake
INT32_MAX = (1 << 31) - 1
MAX_NEW_TOKENS = INT32_MAX


def _stop_strings(stop) -> tuple:
    """A str or a list/tuple of non-empty str, as a tuple."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings, not {type(stop).__name__} {stop!r}")
    for s in stop:
        if not isinstance(s, str):
            raise ConfigError(f"stop must hold strings only, not {type(s).__name__} {s!r}")
        V.utf8("a stop string", s, err=ConfigError)
    return tuple(s for s in stop if s)
