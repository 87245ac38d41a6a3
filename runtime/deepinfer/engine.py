"""The engine: tokenizer, batched prefill + decode, sampling, stop handling, streaming, chat.

Policy lives here; the math lives in the model graph (deepinfer.model), which runs every op
through the Backend. The engine only does integer bookkeeping (token ids, positions, seeds).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from .config import EngineConfig
from .errors import CheckpointError, ConfigError

log = logging.getLogger("deepinfer")

MASK64 = (1 << 64) - 1


def default_model_dir() -> Path:
    """The model that ships with deepinfer (runtime/deepinfer/assets/deepseek-v3-nano)."""
    return Path(__file__).resolve().parent / "assets" / "deepseek-v3-nano"


def resolve_model_dir(model=None, revision: Optional[str] = None) -> Path:
    """The directory of a model argument: a directory as is, a hub id's snapshot in the Hugging
    Face cache (model.hub, at `revision`), or the embedded model for None."""
    from .model.hub import resolve_model

    if model:
        return resolve_model(model, revision)
    if revision:
        raise CheckpointError("revision applies to a hub id; the embedded model has none")
    return default_model_dir()


def step_seed(seed: int, row: int, step: int) -> int:
    """A fresh 64-bit seed per (request seed, row, step); the sample op hashes it again (splitmix64)."""
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
        if p.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, not {p.top_k}")
        return p


class Tokenizer:
    """tokenizer.json through `tokenizers`, the chat template from tokenizer_config.json."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json in the model directory")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None
        self.chat_template = self.config.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("this model's tokenizer_config.json has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ConfigError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_str(t) -> Optional[str]:
    if isinstance(t, dict):
        return t.get("content")
    return t


class _Detokenizer:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 and any tail
    that could still become a stop string."""

    def __init__(self, tok: Tokenizer, stops: Sequence[str]):
        self.tok, self.stops = tok, [s for s in stops if s]
        self.ids: list[int] = []
        self.emitted = 0       # characters of text already yielded
        self.stopped = False
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        self.text = text
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                self.stopped = True
                self.text = text[:i]
                return self._take(len(self.text))
        hold = 0
        for s in self.stops:  # keep back a suffix that is a prefix of a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._take(len(text) - hold)

    def flush(self) -> str:
        return "" if self.stopped else self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    row: int
    detok: _Detokenizer
    out_ids: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str = ""


class Engine:
    """Load once, generate many times. Not thread-safe: one generate call at a time."""

    def __init__(self, model_dir: Path, config: EngineConfig, name: Optional[str] = None):
        from .loader import get_backend
        from .model import load_model

        self.model_dir = Path(model_dir)
        self.model_name = name or self.model_dir.name   # what the user called it (a hub id, a path)
        self.config = config
        if config.verbose:  # say which backend, precision and why on stderr
            log.setLevel(logging.INFO)
            if not logging.getLogger().handlers and not log.handlers:
                h = logging.StreamHandler()
                h.setFormatter(logging.Formatter("deepinfer: %(message)s"))
                log.addHandler(h)
        self.tokenizer = Tokenizer(self.model_dir)
        self.backend = get_backend(config.backend, fallback=config.fallback, device_id=config.device_id,
                                   num_threads=config.num_threads)
        self.model = load_model(self.model_dir, self.backend, config)
        self.eos_ids = {i for i in (self.tokenizer.eos_id, getattr(self.model, "eos_token_id", None)) if i is not None}
        log.info("engine: %s on %s (%s)", self.model_dir.name, self.backend.name,
                 getattr(self.model, "precision_note", ""))
        reason = getattr(self.model, "precision_reason", "")
        self.precision_warned = bool(getattr(self.model, "precision_lossy", False)
                                     and config.precision in ("auto", "fastest"))
        if self.precision_warned:
            # a default that changes what the checkpoint computes is never silent
            log.warning("%s", reason)
        elif reason:
            log.info("%s", reason)

    @classmethod
    def from_pretrained(cls, model=None, config=None, **overrides) -> "Engine":
        """`model`: a model directory, a hub id (`org/name`, resolved through the Hugging Face
        cache, see model.hub; `revision` in the config picks a branch, tag or commit), or None for
        the embedded model."""
        cfg = EngineConfig.from_any(config, **overrides)
        model_dir = resolve_model_dir(model, cfg.revision)
        return cls(model_dir, cfg, name=os.fspath(model) if model else None)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: str, **options) -> str:
        return "".join(self.stream(prompt, **options))

    def generate_batch(self, prompts: Sequence[str], **options) -> list[str]:
        """Several prompts of different lengths, prefilled and decoded together."""
        params = SamplingParams.from_options(**options)
        outs = ["" for _ in prompts]
        for row, piece in self._run([self.tokenizer.encode(p) for p in prompts], [params] * len(prompts)):
            outs[row] += piece
        return outs

    def stream(self, prompt: str, callback: Optional[Callable[[str], None]] = None, **options) -> Iterator[str]:
        params = SamplingParams.from_options(**options)
        for _, piece in self._run([self.tokenizer.encode(prompt)], [params]):
            if callback:
                callback(piece)
            yield piece

    def chat(self, messages: list[dict], **options) -> str:
        return "".join(self.chat_stream(messages, **options))

    def chat_stream(self, messages: list[dict], **options) -> Iterator[str]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams.from_options(**options)
        for _, piece in self._run([self.tokenizer.encode(text, add_bos=False)], [params]):
            yield piece

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], **options) -> list[list[int]]:
        """Token-level generation (tests compare these with transformers' greedy output)."""
        params = SamplingParams.from_options(**options)
        reqs = self._requests([list(p) for p in prompt_ids], [params] * len(prompt_ids))
        for _ in self._loop(reqs):
            pass
        return [r.out_ids for r in reqs]

    # ------------------------------------------------------------------ the loop
    def _requests(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[_Request]:
        if len(prompts) > self.config.max_batch:
            raise ConfigError(f"{len(prompts)} prompts > max_batch {self.config.max_batch}; raise max_batch")
        reqs = []
        for row, (ids, p) in enumerate(zip(prompts, params)):
            if not ids:
                ids = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else None
                if ids is None:
                    raise ConfigError("empty prompt and the tokenizer has no bos token")
            if len(ids) + p.max_new_tokens > self.config.max_seq_len:
                raise ConfigError(f"prompt of {len(ids)} tokens + max_new_tokens {p.max_new_tokens} > "
                                  f"max_seq_len {self.config.max_seq_len}")
            reqs.append(_Request(ids, p, row, _Detokenizer(self.tokenizer, p.stop)))
        return reqs

    def _run(self, prompts, params) -> Iterator[tuple[int, str]]:
        reqs = self._requests(prompts, params)
        for r, tok in self._loop(reqs):
            piece = r.detok.push(tok) if tok is not None else r.detok.flush()
            if piece:
                yield r.row, piece

    def _loop(self, reqs: list[_Request]) -> Iterator[tuple[_Request, Optional[int]]]:
        """Yields (request, new token) as tokens arrive and (request, None) when a request ends."""
        seq_ids = [self.model.new_sequence() for _ in reqs]
        try:
            active = [r for r in reqs if r.params.max_new_tokens > 0]
            for r in reqs:
                if r.params.max_new_tokens == 0:
                    r.done, r.finish_reason = True, "length"
                    yield r, None
            if not active:
                return
            feed = {id(r): r.prompt_ids for r in active}
            pos = {id(r): 0 for r in active}
            step = 0
            while active:
                sids = [seq_ids[r.row] for r in active]
                tokens = [feed[id(r)] for r in active]
                starts = [pos[id(r)] for r in active]
                logits = self.model.forward(sids, tokens, starts)
                new = self.model.sample(
                    logits,
                    temperature=[r.params.temperature for r in active],
                    top_k=[r.params.top_k for r in active],
                    top_p=[r.params.top_p for r in active],
                    seeds=[step_seed(r.params.seed, r.row, step) for r in active],
                )
                step += 1
                still = []
                for r, t in zip(active, new):
                    pos[id(r)] += len(feed[id(r)])
                    feed[id(r)] = [t]
                    if t in self.eos_ids or t in r.params.stop_token_ids:
                        r.done, r.finish_reason = True, "stop"
                    else:
                        r.out_ids.append(t)
                        yield r, t
                        if r.detok.stopped:
                            r.done, r.finish_reason = True, "stop"
                        elif len(r.out_ids) >= r.params.max_new_tokens:
                            r.done, r.finish_reason = True, "length"
                    if r.done:
                        self.model.free(seq_ids[r.row])
                        yield r, None
                    else:
                        still.append(r)
                active = still
        finally:
            for s in seq_ids:
                self.model.free(s)
