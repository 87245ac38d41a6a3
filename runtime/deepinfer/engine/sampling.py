"""Sampling: a request's parameters, the per-token seed that makes seeded sampling reproducible
regardless of which batch, row or step a token is sampled in, and the Sampler that runs the
backend's sample op over a step's logits with its parameter and output buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .. import validate as V
from ..errors import ConfigError
from ..tensor import Tensor

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
    # ---- sampling controls (ABI 1.7's sample fields; run on the device inside the sample op)
    presence_penalty: float = 0.0   # OpenAI's: minus this from each token generated at least once, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's: minus this times each token's count in the output, [-2, 2]
    repetition_penalty: float = 1.0  # HF / vLLM's: tokens of prompt or output divided (> 0) or multiplied by it
    logit_bias: Optional[dict] = None   # {token id: bias in [-100, 100]}, added to the logits
    min_tokens: int = 0             # eos and stop tokens are banned until this many tokens were generated
    structured: Optional[dict] = None   # a constraint (engine.structured): {"type": "json_schema" | "json_object"
                                        # | "regex" | "grammar" | "choice", ...}; masks the logits each step
    skip_special_tokens: bool = True    # False: special tokens stay in the text (tool-call markers a parser reads)

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
        p.presence_penalty = V.number("presence_penalty", p.presence_penalty, -2, 2)
        p.frequency_penalty = V.number("frequency_penalty", p.frequency_penalty, -2, 2)
        p.repetition_penalty = V.number("repetition_penalty", p.repetition_penalty, 0, MAX_REPETITION_PENALTY,
                                        lo_open=True)
        p.logit_bias = _logit_bias(p.logit_bias)
        V.integer("min_tokens", p.min_tokens, 0, INT32_MAX)
        V.boolean("skip_special_tokens", p.skip_special_tokens)
        if p.structured is not None and not (isinstance(p.structured, dict) and isinstance(p.structured.get("type"), str)):
            raise ConfigError(f"structured must be a dict with a 'type' (json_schema, json_object, regex, grammar or "
                              f"choice), not {p.structured!r}")
        return p

    @property
    def control_groups(self) -> frozenset:
        """The groups of ABI 1.7's sample fields this request needs: "penalties" (history, prompt_lens,
        penalties), "bias" (bias_ids, bias: logit_bias and min_tokens' bans), "mask" (token_mask)."""
        g = set()
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            g.add("penalties")
        if self.logit_bias or self.min_tokens:
            g.add("bias")
        if self.structured is not None:
            g.add("mask")
        return frozenset(g)

    @property
    def has_controls(self) -> bool:
        """Whether the sample op needs ABI 1.7's fields for this request (penalties, bias, bans, a mask)."""
        return bool(self.control_groups)


# the sample op reads top_k as int32; longer outputs than this are not a request but a mistake
INT32_MAX = (1 << 31) - 1
MAX_NEW_TOKENS = INT32_MAX
MAX_REPETITION_PENALTY = 100.0     # beyond it every seen token is simply banned; a typo, not a request
MAX_LOGIT_BIAS = 300               # OpenAI's limit on logit_bias entries


def _logit_bias(bias) -> Optional[dict]:
    """{token id (int, or a str of one as JSON keys are): bias in [-100, 100]} as {int: float}."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias must be a map of token id to bias, not {type(bias).__name__} {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ConfigError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for k, v in bias.items():
        t = k
        if isinstance(k, str):
            if not k.strip().lstrip("-").isdigit():
                raise ConfigError(f"logit_bias keys must be token ids, not {k!r}")
            t = int(k)
        V.integer("a logit_bias token id", t, 0, INT32_MAX)
        out[t] = V.number(f"logit_bias[{k!r}]", v, -100, 100)
    return out or None


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

class Sampler:
    """One token per row of logits through the backend's sample op, with buffers kept per (rows,
    with_probs): the four parameter arrays go in one copy and the ids come back in one (pinned
    buffers on device backends)."""

    def __init__(self, backend):
        self.backend = backend
        self._bufs: dict = {}

    def sample(self, logits: Tensor, temperature, top_k=None, top_p=None, seeds=None, with_probs: bool = False,
               controls: Optional[dict] = None):
        """The sampled ids as a list; with_probs: (tokens, each token's probability) (ABI 1.2's
        probs; drafts use it as their confidence). controls: ABI 1.7's control tensors
        (engine.sample_controls); a row they leave without a token comes back as -1."""
        B = logits.shape[0]
        bufs = self._bufs.get((B, with_probs))
        if bufs is None:
            bufs = self._bufs[(B, with_probs)] = SampleBuffers(self.backend, B, with_probs)
        bufs.set(temperature, top_k, top_p, seeds)
        bufs.call(logits, controls)()
        return bufs.result()


class SampleBuffers:
    """The sample op's per-row parameters packed in one buffer (temperature f32, top_k i32, top_p
    f32, seeds u64: each block 256-byte aligned) with a host mirror, and its output ids."""

    FIELDS = (("seeds", "uint64"), ("temperature", "f32"), ("top_k", "int32"), ("top_p", "f32"))

    def __init__(self, backend, B: int, with_probs: bool = False):
        self.backend, self.B, self.with_probs = backend, B, with_probs
        self.offsets, off = {}, 0
        for name, dt in self.FIELDS:
            self.offsets[name] = off
            off += -(-B * (8 if dt == "uint64" else 4) // 256) * 256
        device = backend.device != "cpu"
        self.store = backend.empty((off,), "uint8")
        self.host = self.store
        n_out = 2 * B if with_probs else B       # ids, then (with_probs) their f32 probabilities
        self.out = backend.empty((n_out,), "int32")
        self.out_host = self.out
        if device:
            try:
                self.host = backend.host_empty((off,), "uint8")
                self.out_host = backend.host_empty((n_out,), "int32")
            except Exception:   # no pinned memory in this library: pageable copies
                self.host, self.out_host = Tensor.empty((off,), "uint8"), Tensor.empty((n_out,), "int32")
        self.ids = self.out.narrow(0, 0, B)
        self.probs = Tensor(self.out.buffer, (B,), "f32", None, self.out.offset + 4 * B) if with_probs else None
        raw = self.host.numpy()
        self._bound = None
        self._out_view = None
        self._last = None       # the parameters last written (lists copied: callers may reuse theirs)
        self.views, self.params = {}, {}
        for name, dt in self.FIELDS:
            o = self.offsets[name]
            t = Tensor(self.store.buffer, (B,), dt, None, self.store.offset + o)
            self.params[name] = t
            self.views[name] = raw[o:o + t.nbytes].view(t.dtype.np)

    def set(self, temperature, top_k, top_p, seeds) -> None:
        B, v = self.B, self.views
        key = (temperature, top_k, top_p, seeds)
        plain = all(x is None or isinstance(x, list) for x in key)
        if plain and self._last == key and self.host is self.store:
            return    # a greedy decode loop passes the same parameters every step
        self._last = tuple(list(x) if isinstance(x, list) else x for x in key) if plain else None
        v["temperature"][:] = np.asarray(temperature, np.float32).reshape(B)
        v["top_k"][:] = np.asarray(top_k, np.int32).reshape(B) if top_k is not None else 0
        v["top_p"][:] = np.asarray(top_p, np.float32).reshape(B) if top_p is not None else 1.0
        v["seeds"][:] = np.asarray(seeds, np.uint64).reshape(B) if seeds is not None else 0
        if self.host is not self.store:
            self.backend.copy_async(self.store, self.host)

    def call(self, logits: Tensor, controls: Optional[dict] = None):
        """The sample op on `logits`, bound once per logits buffer and set of control tensors: a
        decode step samples the same plan output every time, so the call is marshalled once, not
        once a step. Only the last one is kept (it holds its logits tensor, and so an old arena,
        alive)."""
        controls = controls or {}
        key = (logits.data_ptr, logits.shape, logits.strides, logits.dtype.name,
               tuple((k, id(t)) for k, t in sorted(controls.items())))
        if self._bound is None or self._bound[0] != key:
            extra = {"probs": self.probs} if self.with_probs else {}
            self._bound = (key, self.backend.prepare("sample", logits=logits, out=self.ids, **self.params, **extra,
                                                     **controls))
        return self._bound[1]

    def result(self):
        """The ids as a list; with_probs: (ids, probabilities)."""
        if self.out_host is not self.out:
            self.backend.copy_async(self.out_host, self.out)
            self.backend.synchronize()   # the one host synchronization of a step
        if self._out_view is None:
            self._out_view = self.out_host.numpy()
        ids = self._out_view[:self.B].tolist()
        if not self.with_probs:
            return ids
        return ids, self._out_view[self.B:].view(np.float32).tolist()
