"""Structured output through a live server and the official openai client (issue 46): every schema of
the corpus (tests/data/json_schemas.json: nested objects, arrays, enums, anyOf, bounded numbers,
string formats, $refs...) as response_format json_schema, streamed and not, yields text that parses
and validates with jsonschema; the requests run concurrently, so constrained rows share batches."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from test_serve import NAME, LiveServer, _config  # noqa: E402

CORPUS = json.loads((Path(__file__).resolve().parent / "data" / "json_schemas.json").read_text())


@pytest.fixture(scope="module")
def client():
    s = LiveServer({**_config(), "max_seq_len": 512})
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    s.stop()


def _ask(client, entry, stream: bool, seed: int) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": entry["name"][:64], "schema": entry["schema"],
                                                  "strict": entry.get("strict", True)}}
    kw = dict(model=NAME, messages=[{"role": "user", "content": f"Give {entry['name']} as JSON."}],
              max_tokens=400, temperature=0, seed=seed, response_format=fmt, frequency_penalty=1.0)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def test_the_corpus_is_big_enough():
    assert len(CORPUS) >= 30
    kinds = json.dumps(CORPUS)
    for keyword in ("anyOf", "enum", "minimum", "format", "$ref", "items", "required"):
        assert keyword in kinds, keyword


@pytest.fixture(scope="module")
def compiler():
    from deepinfer.engine import Engine, default_model_dir
    from deepinfer.engine.structured import StructuredCompiler

    tok = Engine.from_pretrained(default_model_dir(), config=_config()).tokenizer
    return tok, StructuredCompiler(tok, 4096, [tok.eos_id])


def _a_valid_prefix(compiler, entry, text: str) -> bool:
    """Whether the grammar of the entry accepts `text` as far as it goes (an output cut by max_tokens)."""
    tok, c = compiler
    m = c.compile({"type": "json_schema", "schema": entry["schema"], "strict": entry.get("strict", True)}).matcher()
    return all(m.accept(t) for t in tok.encode(text, add_bos=False))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_schema_yields_valid_json(client, compiler, stream):
    """Greedy with a frequency penalty (as chat clients send one). An output that ends (finish_reason
    stop) must validate; one the embedded model runs to max_tokens (it writes digits without end where
    a schema's number has no bound on its digits) must be a prefix the grammar accepts, and at least 90%
    of the corpus must end."""
    jobs = [(e, stream, i) for i, e in enumerate(CORPUS)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: _ask(client, *j), jobs))
    bad, cut = [], []
    for (entry, _, _), (text, reason) in zip(jobs, results):
        if reason == "length":
            cut.append(entry["name"])
            if not _a_valid_prefix(compiler, entry, text):
                bad.append(f"{entry['name']}: cut at max_tokens and not a prefix the grammar accepts: {text[:160]!r}")
            continue
        try:
            assert reason == "stop", reason
            cls = jsonschema.validators.validator_for(entry["schema"])
            cls(entry["schema"], format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))
        except (ValueError, AssertionError, jsonschema.ValidationError) as e:
            bad.append(f"{entry['name']}: {type(e).__name__} {str(e)[:120]} in {text[:160]!r} ({reason})")
    assert not bad, "\n".join(bad)
    assert len(cut) <= len(CORPUS) // 10, f"{len(cut)} of {len(CORPUS)} ran to max_tokens: {cut}"


@pytest.mark.parametrize("fmt, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "strng"}}}},
     "response_format", "strng"),
    ({"extra_body": {"structured_outputs": {"regex": "([a-z]"}}}, "structured_outputs.regex", "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}}, "structured_outputs.grammar", "grammar"),
    ({"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}},
     "guided_json", "uniqueItems"),
])
def test_bad_constraints_are_a_400_that_names_the_problem(client, fmt, param, fragment):
    import time
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4, **fmt)
    assert time.monotonic() - t0 < 10             # compiles are bounded: never a hang
    body = e.value.body
    assert body["param"] == param and fragment in body["message"], body
