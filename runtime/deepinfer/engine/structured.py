"""Structured output: per-token masks that keep sampling inside a JSON schema, a regex, a grammar or
a list of choices, on llguidance (lazy Earley parsing over a derivative-based lexer: masks are
computed for the current state only, so compiles stay small and bounded).

    compiler = StructuredCompiler(tokenizer, vocab_size, eos_ids)
    grammar  = compiler.compile({"type": "json_schema", "schema": {...}})   # cached per spec
    matcher  = grammar.matcher()                                             # one per request
    fill_masks([matcher, None, ...], out)      # out: int32 [B, mask_words(vocab_size)], bit v = token v allowed
    matcher.accept(sampled_token)

JSON is compact ("," and ":", no whitespace) unless a schema's own "x-guidance" options say
otherwise: with flexible whitespace a weak model can loop forever in spaces and newlines, "validly".

json_schema is exact by default: a keyword llguidance cannot enforce (uniqueItems, not, if/then,
propertyNames, ...), or a oneOf whose branches it cannot prove disjoint (discriminated unions it can),
is a StructuredError. With "strict": false it is best effort: such keywords are ignored and oneOf is
treated as anyOf; Grammar.warnings says what was relaxed.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from functools import lru_cache
from typing import Optional

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from ..errors import ConfigError

# the fields each kind takes, and their types; name/description ride along from OpenAI's response_format
FIELDS = {
    "json_object": {},
    "json_schema": {"schema": dict, "strict": bool, "name": str, "description": str},
    "regex": {"pattern": str},
    "grammar": {"grammar": str},
    "choice": {"choices": list},
}
KINDS = tuple(FIELDS)
REQUIRED = {"json_schema": ("schema",), "regex": ("pattern",), "grammar": ("grammar",), "choice": ("choices",)}
JSON_OPTIONS = {"whitespace_flexible": False}     # separators: llguidance's "," and ":"
BEST_EFFORT = {"lenient": True, "coerce_one_of": True}
PARALLEL_MIN_CPUS = 4       # fill_masks's default: llguidance's pool only where it has cores to run on
MAX_MESSAGE = 800           # llguidance's messages quote the grammar; a 400 needs the start of it only


class StructuredError(ConfigError):
    """A structured-output spec, schema, regex or grammar that cannot be used; says what and where."""


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredCompiler:
    """Compiles specs (SamplingParams.structured) into Grammars for one tokenizer and logits width.

    Safe to call from several threads: identical specs compiled at once share one compile. A compile
    runs on a small pool and is waited for at most compile_timeout_s; llguidance's own limits (lexer
    fuel, grammar size) end a runaway one in the background."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, compile_timeout_s: float = 5.0,
                 cache_size: int = 64):
        hf = getattr(tokenizer, "_tok", tokenizer)     # deepinfer's Tokenizer wraps an HF tokenizers.Tokenizer
        eos = sorted({int(e) for e in (eos_ids if eos_ids is not None else ())} or
                     ({tokenizer.eos_id} if getattr(tokenizer, "eos_id", None) is not None else set()))
        if not eos:
            raise ConfigError("structured output needs an end-of-sequence token id; the tokenizer has none "
                              "and no eos_ids were given")
        self.tokenizer_vocab = hf.get_vocab_size(with_added_tokens=True)
        if vocab_size < self.tokenizer_vocab:
            raise ConfigError(f"structured output: the logits are {vocab_size} wide but the tokenizer has "
                              f"{self.tokenizer_vocab} tokens; the model and tokenizer do not match")
        if any(not 0 <= e < vocab_size for e in eos):
            raise ConfigError(f"structured output: eos ids {eos} must lie in [0, {vocab_size})")
        self.vocab_size, self.eos_ids, self.compile_timeout_s = vocab_size, tuple(eos), compile_timeout_s
        self._lltok = llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=list(eos))
        # verbose errors would dump parser state and the whole grammar into a request's error
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._allowed = _allowed_row(vocab_size, self.tokenizer_vocab, eos)
        self._cache: OrderedDict = OrderedDict()       # canonical spec -> Future[Grammar]
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="structured-compile")

    def compile(self, spec: dict) -> "Grammar":
        kind = _check_spec(spec)
        key = _canonical(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._build, kind, spec)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            # left in the cache: a repeat waits on the same compile instead of starting another
            raise StructuredError(f"{kind}: compiling took longer than {self.compile_timeout_s:g} s; "
                                  "simplify it") from None
        except StructuredError as e:    # a fresh exception per caller: the cached one is shared
            raise StructuredError(str(e)) from None

    def _build(self, kind: str, spec: dict) -> "Grammar":
        text = BUILDERS[kind](spec)
        ll = llguidance.LLMatcher(self._lltok, text, log_level=0, limits=self._limits)
        if ll.is_error():
            raise StructuredError(f"{kind}: {_hint(kind, spec, _short(ll.get_error()))}")
        return Grammar(ll, kind, self.vocab_size, self._allowed, ll.get_grammar_warnings())


class Grammar:
    """A compiled spec; immutable and shared by every request that asked for it."""

    def __init__(self, proto, kind: str, vocab_size: int, allowed: np.ndarray, warnings=()):
        self._proto, self.kind, self.vocab_size, self._allowed = proto, kind, vocab_size, allowed
        self.warnings = list(warnings)     # what a best-effort ("strict": false) schema left unenforced

    def matcher(self) -> "Matcher":
        return Matcher(self._proto.deep_copy(), self.vocab_size, self._allowed)    # a copy: ~10 us


class Matcher:
    """One request's position in its grammar. Not thread-safe: fill its mask and accept its tokens
    one after the other (the mask may be filled on a worker thread, but not while accept runs)."""

    def __init__(self, ll, vocab_size: int, allowed: np.ndarray):
        self._ll, self.vocab_size, self._allowed = ll, vocab_size, allowed
        self._bad_token: Optional[str] = None
        self._accepted = 0          # llguidance turns a rollback past the start into an error state

    @property
    def error(self) -> Optional[str]:
        return self._bad_token or (_short(self._ll.get_error()) if self._ll.is_error() else None)

    def fill_mask(self, row: np.ndarray) -> None:
        """Bit (v & 31) of row[v >> 5] = 1 where token v may come next, 0 elsewhere. In an error or
        stopped state only the eos ids are allowed."""
        _check_rows(row.reshape(1, -1) if row.ndim == 1 else row, 1, self._allowed.size)
        self._ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)   # drops the GIL
        np.bitwise_and(row, self._allowed, out=row)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and the matcher in an error state) if it was not allowed."""
        if not 0 <= token < self.vocab_size:
            self._bad_token = f"token {token} is outside the vocabulary [0, {self.vocab_size})"
            return False
        if self._bad_token or not self._ll.consume_token(int(token)):
            return False
        self._accepted += 1
        return True

    def is_finished(self) -> bool:
        """The grammar is complete and only eos may follow, or the matcher stopped (eos, error)."""
        return bool(self._bad_token) or self._ll.is_stopped()

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (rejected draft tokens). An error state is not undone."""
        if not 0 <= n <= self._accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self._accepted} were accepted")
        if not self._ll.rollback(int(n)):
            raise ValueError(f"cannot roll back {n} tokens: {self.error}")
        self._accepted -= n

    def valid_prefix_len(self, tokens) -> int:
        """How many of `tokens` the grammar accepts in a row from here, without advancing (drafts)."""
        return self._ll.validate_tokens([int(t) for t in tokens])


def fill_masks(matchers: list, out: np.ndarray, vocab_size: Optional[int] = None,
               parallel: Optional[bool] = None) -> float:
    """Row i of out (int32 [B, W]) = the mask of matchers[i]; a None row allows every id below
    vocab_size (taken from the matchers when not given; all bits when neither says). Returns the
    seconds spent.

    parallel: compute the rows on llguidance's thread pool (default: with 2+ constrained rows on a
    machine of PARALLEL_MIN_CPUS or more; on 2 loaded CPUs its hand-offs gave millisecond tails).
    Either way llguidance computes with the GIL released, so this may run on a worker thread while
    the main thread runs the model; the matchers must not be accepting tokens meanwhile."""
    t0 = time.perf_counter()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    free = [i for i, m in enumerate(matchers) if m is None]
    if rows:
        allowed = matchers[rows[0]]._allowed
        vocab_size = vocab_size or matchers[rows[0]].vocab_size
        _check_rows(out, len(matchers), allowed.size)
        if len({id(matchers[i]) for i in rows}) < len(rows):
            raise ValueError("a matcher appears in two rows; each row needs its own (Grammar.matcher())")
        if parallel is None:
            parallel = len(rows) > 1 and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS
        if parallel:
            llg_np.fill_next_token_bitmask_par(_executor(), [(matchers[i]._ll, i) for i in rows], out)
        else:
            for i in rows:
                matchers[i]._ll.unsafe_compute_mask_ptr(out[i].ctypes.data, out[i].nbytes)
        head = out[:len(matchers)]      # free rows are overwritten below: AND them all in place
        np.bitwise_and(head, allowed, out=head)
    if free:
        out[free] = _full_row(vocab_size, out.shape[1]) if vocab_size else -1
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- the spec kinds
def _check_spec(spec) -> str:
    """The spec's kind, once its fields are present and of the right types."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise StructuredError(f"structured output must be a dict with a 'type' ({', '.join(KINDS)}), not {spec!r:.100}")
    kind = spec["type"]
    if kind not in FIELDS:
        raise StructuredError(f"unknown structured output type {kind!r}; use one of {', '.join(KINDS)}")
    fields = FIELDS[kind]
    unknown = sorted(set(spec) - set(fields) - {"type"})
    if unknown:
        raise StructuredError(f"{kind}: unknown field(s) {', '.join(map(repr, unknown))}; "
                              f"it takes {', '.join(map(repr, fields)) or 'no fields'}")
    for name in REQUIRED.get(kind, ()):
        if spec.get(name) is None:
            raise StructuredError(f"{kind}: missing {name!r}")
    for name, typ in fields.items():
        if spec.get(name) is not None and not isinstance(spec[name], typ):
            raise StructuredError(f"{kind}: {name!r} must be {_TYPE_NAMES[typ]}, not {type(spec[name]).__name__}")
    return kind


_TYPE_NAMES = {dict: "an object", bool: "true or false", str: "a string", list: "a list"}


def _canonical(spec: dict) -> str:
    # top-level keys sorted; nested order kept: a schema's property order is the output's order
    try:
        return json.dumps({k: spec[k] for k in sorted(spec)}, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StructuredError(f"{spec['type']}: not plain JSON ({e})") from None


def _json_schema(spec: dict) -> str:
    schema = spec["schema"]
    _check_schema(schema)
    options = {**JSON_OPTIONS, **(BEST_EFFORT if spec.get("strict") is False else {})}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema, allow_nan=False), defaults=options)
    except ValueError as e:
        raise StructuredError(f"json_schema: {e}") from None


def _check_schema(schema: dict) -> None:
    """The schema against its draft's meta-schema (2020-12 unless $schema says otherwise), so a
    mistake is reported with where it is. Formats are not checked: patterns are ECMA/Rust regexes,
    which Python's re would misjudge."""
    import jsonschema        # ~50 ms to import; only requests with a schema need it
    from jsonschema.exceptions import best_match

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    e = best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if e is None:
        return
    where = e.json_path
    if where.endswith(".type") or re.search(r"\.type\[\d+\]$", where):
        raise StructuredError(f"json_schema: at {where}: unknown type {e.instance!r:.60}; use one of "
                              "string, number, integer, boolean, object, array, null")
    raise StructuredError(f"json_schema: at {where}: {e.message:.300}")


def _regex(spec: dict) -> str:
    """Rust regex syntax, always matched whole; \\d and \\w are ASCII as in JSON Schema's patterns
    (Unicode \\d lets a "number" be written in Devanagari digits)."""
    return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec['pattern'], 'dw')}/")


GBNF_RULE = re.compile(r"(?m)^\s*[\w.-]+\s*::=")


def _grammar(spec: dict) -> str:
    """Lark (llguidance's dialect), or GBNF as llama.cpp and vLLM users write it (rules with ::=)."""
    text = spec["grammar"]
    if GBNF_RULE.search(text):
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            text = gbnf_to_lark(text)
        except Exception as e:      # the converter raises plain Exceptions for undefined rules
            raise StructuredError(f"grammar: not valid GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def _choice(spec: dict) -> str:
    choices = spec["choices"]
    if not choices or not all(isinstance(c, str) for c in choices):
        raise StructuredError("choice: 'choices' must be a non-empty list of strings")
    # one terminal: the alternatives go into the lexer's automaton, not into a parser row, whose
    # width llguidance caps (2000 items)
    return llguidance.LLMatcher.grammar_from_lark(
        "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


BUILDERS = dict(json_object=lambda spec: _json_schema({"schema": {"type": "object"}}), json_schema=_json_schema, regex=_regex, grammar=_grammar, choice=_choice)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + " ..."


def _hint(kind: str, spec: dict, message: str) -> str:
    unenforceable = "Unimplemented keys" in message or "oneOf constraints" in message
    if kind == "json_schema" and unenforceable and spec.get("strict") is not False:
        return (message + '; this keyword cannot be enforced exactly: remove it, or pass "strict": false to '
                "ignore such keywords and treat oneOf as anyOf")
    return message


# ------------------------------------------------------------------------------------ mask helpers
def _check_rows(out, rows: int, words: int) -> None:
    if not (isinstance(out, np.ndarray) and out.dtype == np.int32 and out.ndim == 2 and out.flags.c_contiguous):
        raise ValueError("a mask must be a C-contiguous int32 array [rows, mask_words(vocab_size)]")
    if out.shape[1] != words or out.shape[0] < rows:
        raise ValueError(f"mask of shape {out.shape} for {rows} rows of {words} words")


def _bits_below(n: int, words: int) -> np.ndarray:
    bits = np.zeros(words * 32, np.uint8)
    bits[:n] = 1
    row = np.packbits(bits, bitorder="little").view(np.int32)
    row.flags.writeable = False     # shared by every mask filled from it
    return row


def _allowed_row(vocab_size: int, tokenizer_vocab: int, eos) -> np.ndarray:
    """The ids any grammar may allow: the tokenizer's own and the eos ids; never the padding ids
    of a logits row wider than the vocabulary (nor bits past vocab_size)."""
    row = _bits_below(tokenizer_vocab, mask_words(vocab_size)).copy()
    for e in eos:
        row.view(np.uint32)[e >> 5] |= np.uint32(1 << (e & 31))
    row.flags.writeable = False
    return row


@lru_cache(maxsize=8)
def _full_row(vocab_size: int, words: int) -> np.ndarray:
    return _bits_below(min(vocab_size, words * 32), words)


@lru_cache(maxsize=1)
def _executor():
    """llguidance's thread pool for batched masks, made at first use (80% of the CPUs, at most 32)."""
    return llguidance.LLExecutor()
