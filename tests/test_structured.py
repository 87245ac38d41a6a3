"""Structured output (engine/structured.py) on the embedded model's tokenizer.

Every schema of data/json_schemas.json, and a set of regexes, grammars and choices, is walked at
random: fill the mask, pick an allowed token, accept it, until eos. The text must then parse and
validate (jsonschema) or fullmatch. The logits rows are wider than the vocabulary (the vocab
fixture), so every step also checks that no id past the tokenizer's is ever allowed."""
from __future__ import annotations

import datetime
import json
import re
import threading
import time
import zlib
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from deepinfer.engine import Tokenizer, default_model_dir
from deepinfer.engine.structured import StructuredCompiler, StructuredError, fill_masks, mask_words
from deepinfer.errors import ConfigError

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text(encoding="utf-8"))
WALKS_PER_SCHEMA = 4
MAX_WALK = 400


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def vocab(tok):
    return tok.vocab_size + 45      # a padded logits row, and not a multiple of 32


@pytest.fixture(scope="module")
def compiler(tok, vocab):
    return StructuredCompiler(tok, vocab, [tok.eos_id])


@pytest.fixture(scope="module")
def weights(tok):
    """Each token's first character (its byte, in byte-level BPE's alphabet) and a bonus for those
    that close a string, object or array. A walk picks a first character uniformly, then a token
    starting with it (see walk): picking among thousands of letter tokens directly, a walk would
    seldom reach the one '"' or '@' or '!' it needs to end."""
    pieces = [tok._tok.id_to_token(i) or " " for i in range(tok.vocab_size)]
    first = np.array([ord(p[0]) for p in pieces])
    bonus = np.array([{'"': 8.0, "}": 2.0, "]": 2.0}.get(p[0], 1.0) for p in pieces])
    return first, bonus


def allowed_ids(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert not bits[vocab:].any(), "padding bits past vocab_size are set"
    return np.flatnonzero(bits)


def walk(grammar, rng, tok, vocab, weights) -> str:
    m = grammar.matcher()
    row = np.zeros(mask_words(vocab), np.int32)
    tokens = []
    for step in range(MAX_WALK):
        m.fill_mask(row)
        allowed = allowed_ids(row, vocab)
        assert allowed.size, f"empty mask after {tok.decode(tokens)!r}: {m.error}"
        assert allowed.max() < tok.vocab_size, "an id past the tokenizer's vocabulary is allowed"
        if m.is_finished():
            assert list(allowed) == [tok.eos_id]
        others = allowed[allowed != tok.eos_id]
        if others.size == 0 or (others.size < allowed.size and rng.random() < 0.5):
            assert m.accept(tok.eos_id) and m.is_finished()
            return tok.decode(tokens)
        first, bonus = weights
        codes = first[others]
        w = bonus[others] / np.bincount(codes)[codes]
        t = int(rng.choice(others, p=w / w.sum()))
        assert m.accept(t), m.error
        tokens.append(t)
    pytest.fail(f"walk did not end in {MAX_WALK} tokens: {tok.decode(tokens)!r}")


# jsonschema checks date-time and time only with optional packages; RFC 3339's grammar is enough here.
# llguidance's dates are a regex: February 29 passes in every year (a known gap, not checked here)
RFC3339_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date-time")(lambda s: not isinstance(s, str) or
                            re.fullmatch(r"\d{4}-\d\d-\d\d[Tt ]" + RFC3339_TIME, s) is not None)
FORMATS.checks("date")(lambda s: not isinstance(s, str) or _iso_date(s.replace("-02-29", "-02-28")))
FORMATS.checks("time")(lambda s: not isinstance(s, str) or re.fullmatch(RFC3339_TIME, s) is not None)


def _iso_date(s: str) -> bool:
    try:
        return re.fullmatch(r"\d{4}-\d\d-\d\d", s) is not None and bool(datetime.date.fromisoformat(s))
    except ValueError:
        return False


def is_compact(text: str) -> bool:
    """No whitespace outside string literals."""
    return not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', text))


def json_spec(entry: dict) -> dict:
    spec = {"type": "json_schema", "schema": entry["schema"]}
    if "strict" in entry:
        spec["strict"] = entry["strict"]
    return spec


# ------------------------------------------------------------------------------------------- walks
def test_the_corpus_is_broad():
    assert len(SCHEMAS) >= 30 and len({e["name"] for e in SCHEMAS}) == len(SCHEMAS)


@pytest.mark.parametrize("entry", SCHEMAS, ids=[e["name"] for e in SCHEMAS])
def test_json_schema_walks_validate(entry, compiler, tok, vocab, weights):
    grammar = compiler.compile(json_spec(entry))
    rng = np.random.default_rng(zlib.crc32(entry["name"].encode()))
    for _ in range(WALKS_PER_SCHEMA):
        text = walk(grammar, rng, tok, vocab, weights)
        assert is_compact(text), text
        value = json.loads(text)
        jsonschema.validate(value, entry["schema"], format_checker=FORMATS)


def test_json_object_walks_give_objects(compiler, tok, vocab, weights):
    grammar = compiler.compile({"type": "json_object"})
    rng = np.random.default_rng(1)
    for _ in range(8):
        text = walk(grammar, rng, tok, vocab, weights)
        assert isinstance(json.loads(text), dict) and is_compact(text), text


REGEXES = [r"\d{3}-\d{4}", r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)", r"(yes|no|maybe)", r"0x[0-9a-f]{1,8}",
           r"[A-Z][a-z]*( [A-Z][a-z]*){0,3}", r"(ab|cd)*e"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_match(pattern, compiler, tok, vocab, weights):
    grammar = compiler.compile({"type": "regex", "pattern": pattern})
    rng = np.random.default_rng(len(pattern))
    for _ in range(6):
        text = walk(grammar, rng, tok, vocab, weights)
        assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)     # \d is [0-9], as in JSON Schema


LARK = (r'''start: "(" num ("," num)* ")"
num: /[0-9]{1,4}/''', r"\(\d{1,4}(,\d{1,4})*\)")
GBNF = (r'''root ::= greeting " " name "!"
greeting ::= "hello" | "hi"
name ::= [a-z]+''', r"(hello|hi) [a-z]+!")
GBNF_JSONISH = (r'''root   ::= "{" pair ("," pair)* "}"
pair   ::= key ":" value
key    ::= "\"" [a-z]+ "\""
value  ::= [0-9]+ | "true" | "false"''', r'\{"[a-z]+":(\d+|true|false)(,"[a-z]+":(\d+|true|false))*\}')


@pytest.mark.parametrize("grammar,pattern", [LARK, GBNF, GBNF_JSONISH], ids=["lark", "gbnf", "gbnf_jsonish"])
def test_grammar_walks_match(grammar, pattern, compiler, tok, vocab, weights):
    g = compiler.compile({"type": "grammar", "grammar": grammar})
    rng = np.random.default_rng(3)
    for _ in range(6):
        text = walk(g, rng, tok, vocab, weights)
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("choices", [["yes", "no"], ["yes", "yes please", "y"], ["café", "日本", 'say "hi"\n', ""],
                                     [f"item-{i}" for i in range(5000)]], ids=["two", "prefixes", "odd", "5000"])
def test_choice_walks_pick_one(choices, compiler, tok, vocab, weights):
    g = compiler.compile({"type": "choice", "choices": choices})
    rng = np.random.default_rng(len(choices))
    seen = set()
    for _ in range(12):
        text = walk(g, rng, tok, vocab, weights)
        assert text in choices, text
        seen.add(text)
    assert len(seen) > 1


# -------------------------------------------------------------------------------------- bad inputs
BAD = [
    ({"type": "json_schema", "schema": {"type": "strng"}}, "at $.type: unknown type 'strng'"),
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"x": {"type": "strng"}}}},
     "at $.properties.x.type: unknown type 'strng'"),
    ({"type": "json_schema", "schema": {"properties": {"a": {"maxItems": "3"}}}}, "at $.properties.a.maxItems"),
    ({"type": "json_schema", "schema": {"type": "object", "required": "a"}}, "at $.required"),
    ({"type": "json_schema", "schema": {"type": "array", "minItems": 5, "maxItems": 3}}, "minItems (5) is greater"),
    ({"type": "json_schema", "schema": {"type": "number", "minimum": float("nan")}}, "not plain JSON"),
    ({"type": "json_schema", "schema": {"type": "string", "format": "bogus"}}, "Unknown format: bogus"),
    ({"type": "json_schema", "schema": {"$ref": "https://example.com/s.json"}}, "https://example.com/s.json"),
    ({"type": "json_schema", "schema": "{}"}, "'schema' must be an object"),
    ({"type": "json_schema"}, "json_schema: missing 'schema'"),
    ({"type": "json_schema", "schema": {}, "strict": "yes"}, "'strict' must be true or false"),
    ({"type": "json_schema", "schema": {}, "schma": {}}, "unknown field(s) 'schma'"),
    ({"type": "regex", "pattern": "a(b"}, "unclosed group"),
    ({"type": "regex", "pattern": "a(?=b)"}, "look-around"),
    ({"type": "regex"}, "regex: missing 'pattern'"),
    ({"type": "grammar", "grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"type": "grammar", "grammar": 'start: /[/'}, "unclosed character class"),
    ({"type": "grammar", "grammar": "root ::= foo"}, "not valid GBNF: Rule 'foo' not found"),
    ({"type": "grammar", "grammar": "root ::= [a-z"}, "not valid GBNF"),
    ({"type": "choice", "choices": []}, "non-empty list of strings"),
    ({"type": "choice", "choices": ["a", 1]}, "non-empty list of strings"),
    ({"type": "xml"}, "unknown structured output type 'xml'"),
    ({"schema": {}}, "must be a dict with a 'type'"),
    ("json", "must be a dict with a 'type'"),
]


@pytest.mark.parametrize("spec,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_specs_name_the_problem(spec, message, compiler):
    with pytest.raises(StructuredError) as e:
        compiler.compile(spec)
    assert message in str(e.value)
    assert isinstance(e.value, ConfigError) and len(str(e.value)) < 1200


UNSUPPORTED = [({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "integer"}}, "not"),
               ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "if"),
               ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
               ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
               ({"type": "array", "contains": {"type": "integer"}}, "contains"),
               ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf")]


@pytest.mark.parametrize("schema,keyword", UNSUPPORTED, ids=[k for _, k in UNSUPPORTED])
def test_unenforceable_keywords_are_refused_unless_strict_is_false(schema, keyword, compiler):
    for strict in ({}, {"strict": True}):
        with pytest.raises(StructuredError) as e:
            compiler.compile({"type": "json_schema", "schema": schema, **strict})
        assert keyword in str(e.value) and '"strict": false' in str(e.value)
    g = compiler.compile({"type": "json_schema", "schema": schema, "strict": False})
    assert g.warnings and any(keyword in w for w in g.warnings)


PATHOLOGICAL = [
    {"type": "regex", "pattern": "(a|b){100000}"},
    {"type": "regex", "pattern": "(.*a){40}"},
    {"type": "regex", "pattern": "[a-z]{1000}{1000}"},
    {"type": "grammar", "grammar": 'start: s\ns: s s | s s s | "a" | '},
    {"type": "json_schema", "schema": {"type": "string", "pattern": "[a-z]+[0-9]*x", "maxLength": 1000000}},
    {"type": "json_schema", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1000000}},
    {"type": "json_schema", "schema": {"$defs": {**{"d0": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        **{f"d{i}": {"anyOf": [{"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"properties": {f"x{i}": {"type": "string"}}}]},
                               {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"properties": {f"y{i}": {"type": "integer"}}}]}]}
           for i in range(1, 20)}}, "$ref": "#/$defs/d19"}},
]


@pytest.mark.parametrize("spec", PATHOLOGICAL, ids=[str(i) for i in range(len(PATHOLOGICAL))])
def test_pathological_specs_are_refused_or_bounded(spec, tok, vocab):
    c = StructuredCompiler(tok, vocab, [tok.eos_id], compile_timeout_s=3.0)
    t0 = time.perf_counter()
    try:
        g = c.compile(spec)
    except StructuredError as e:
        assert str(e)
        assert time.perf_counter() - t0 < 4.0
        return
    assert time.perf_counter() - t0 < 4.0
    m, row = g.matcher(), np.zeros(mask_words(vocab), np.int32)
    for _ in range(20):         # each step is bounded too (llguidance's per-step fuel)
        t = time.perf_counter()
        m.fill_mask(row)
        assert time.perf_counter() - t < 1.0
        ids = allowed_ids(row, vocab)
        if m.is_finished() or not ids.size:
            break
        m.accept(int(ids[len(ids) // 2]))


def test_a_slow_compile_times_out_and_a_repeat_reuses_it(tok, vocab):
    c = StructuredCompiler(tok, vocab, [tok.eos_id], compile_timeout_s=0.001)
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {
        f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 30}}}"} for i in range(2000)}}}
    with pytest.raises(StructuredError, match="longer than 0.001 s"):
        c.compile(spec)
    c.compile_timeout_s = 30.0
    assert c.compile(spec) is c.compile(spec)


# ---------------------------------------------------------------------------------------- matchers
def test_compiles_are_cached(compiler, tok, vocab):
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {"q": {"type": "integer"}}}}
    g = compiler.compile(spec)
    assert compiler.compile(json.loads(json.dumps(spec))) is g
    assert compiler.compile({"schema": spec["schema"], "type": "json_schema"}) is g     # top-level order
    assert compiler.compile({**spec, "strict": False}) is not g
    fresh = StructuredCompiler(tok, vocab, [tok.eos_id])
    spec16 = {"type": "json_schema", "schema": {"type": "array", "items": {"type": "string"}, "maxItems": 16}}
    got = [None] * 16
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, fresh.compile(spec16))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is got[0] for g in got)


def test_ids_past_the_vocabulary_are_never_allowed(compiler, tok, vocab):
    """Even by a grammar that allows any text, and not in fill_masks's unconstrained (None) rows'
    padding; accept refuses them."""
    g = compiler.compile({"type": "regex", "pattern": r"(.|\n){0,50}"})
    m = g.matcher()
    out = np.full((3, mask_words(vocab)), -1, np.int32)
    seconds = fill_masks([m, None, g.matcher()], out)
    assert 0 <= seconds < 1
    constrained, free = allowed_ids(out[0], vocab), allowed_ids(out[1], vocab)
    assert constrained.max() < tok.vocab_size and constrained.size > tok.vocab_size // 2
    assert list(free) == list(range(vocab))         # None: no constraint, every id of the row
    assert np.array_equal(out[0], out[2])
    assert not m.accept(tok.vocab_size + 3) and m.error
    assert not m.accept(-1)
    with pytest.raises(ValueError, match="two rows"):
        fill_masks([m, m], out)


def test_fill_masks_matches_fill_mask(compiler, tok, vocab):
    specs = [{"type": "json_object"}, {"type": "regex", "pattern": "[0-9]+"}, {"type": "choice", "choices": ["x", "yz"]},
             {"type": "json_schema", "schema": SCHEMAS[0]["schema"]}]
    ms = [compiler.compile(s).matcher() for s in specs]
    for m, first in zip(ms, [95, 17, None, 95]):
        if first is not None:
            assert m.accept(tok.encode("{" if first == 95 else "1", add_bos=False)[0])
    batch = np.zeros((6, mask_words(vocab)), np.int32)
    fill_masks([ms[0], None, ms[1], ms[2], ms[3]], batch)
    for i, m in zip([0, 2, 3, 4], ms):
        one = np.zeros(mask_words(vocab), np.int32)
        m.fill_mask(one)
        assert np.array_equal(one, batch[i])
    assert not batch[5].any()               # rows past the matchers are left alone


def test_accept_rollback_and_finish(compiler, tok, vocab):
    m = compiler.compile({"type": "regex", "pattern": "abc[0-9]+"}).matcher()
    row0, row = np.zeros(mask_words(vocab), np.int32), np.zeros(mask_words(vocab), np.int32)
    m.fill_mask(row0)
    ids = tok.encode("abc12", add_bos=False)
    assert all(m.accept(t) for t in ids)
    m.fill_mask(row)
    assert tok.eos_id in allowed_ids(row, vocab) and not m.is_finished()
    m.rollback(len(ids))
    m.fill_mask(row)
    assert np.array_equal(row, row0) and tok.eos_id not in allowed_ids(row, vocab)
    with pytest.raises(ValueError):
        m.rollback(1)
    assert m.valid_prefix_len(tok.encode("abc1x", add_bos=False)) < len(tok.encode("abc1x", add_bos=False))
    assert all(m.accept(t) for t in ids) and m.accept(tok.eos_id) and m.is_finished()
    m.rollback(1)                            # a speculated eos can be taken back
    assert not m.is_finished()
    assert not m.accept(tok.encode("{", add_bos=False)[0])
    assert m.error and "doesn't satisfy the grammar" in m.error and m.is_finished()
    m.fill_mask(row)
    assert list(allowed_ids(row, vocab)) == [tok.eos_id]     # an error state allows only eos


def test_a_finished_grammar_allows_only_eos_and_every_eos_id(tok, vocab):
    c = StructuredCompiler(tok, vocab, [tok.eos_id, 2])
    m = c.compile({"type": "choice", "choices": ["ok"]}).matcher()
    assert all(m.accept(t) for t in tok.encode("ok", add_bos=False))
    row = np.zeros(mask_words(vocab), np.int32)
    m.fill_mask(row)
    assert list(allowed_ids(row, vocab)) == sorted({tok.eos_id, 2}) and m.is_finished()


def test_mask_words_and_bad_setup(tok):
    assert [mask_words(n) for n in (1, 32, 33, 4096, 129280)] == [1, 1, 2, 128, 4040]
    with pytest.raises(ConfigError, match="logits are 4000 wide"):
        StructuredCompiler(tok, 4000, [tok.eos_id])
    with pytest.raises(ConfigError, match="eos ids"):
        StructuredCompiler(tok, tok.vocab_size, [tok.vocab_size + 5])
