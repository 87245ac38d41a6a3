"""The OpenAI API as real clients send it (issue 46), on one live server: sampling controls
(penalties, logit_bias, min_tokens), structured outputs (response_format, structured_outputs,
guided_*), strict types, chat logprobs (streaming too), /tokenize and /detokenize, priority, and a
LobeChat payload. Every refusal is a 400 naming the parameter.

Tests named test_engine_* check what the engine does with the controls (a biased token wins, the
output follows a JSON schema...), the rest the request plumbing."""
from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve import NAME, LiveServer, _config  # noqa: E402

from deepinfer.engine import Engine, default_model_dir  # noqa: E402
from deepinfer.serve.app import ServerLimits  # noqa: E402

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = LiveServer(_config(), ServerLimits(max_body_bytes=64 << 10, max_prompt_tokens=200))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return Engine.from_pretrained(default_model_dir(), config=_config()).tokenizer


def post(server, path, body):
    # json.dumps escapes a lone surrogate (httpx's own encoder would fail on it)
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=120,
                      headers={"content-type": "application/json"})


def chat(server, **fields):
    return post(server, "/v1/chat/completions", {"model": NAME, "messages": HI, "max_tokens": 4, **fields})


def completion(server, **fields):
    return post(server, "/v1/completions", {"model": NAME, "prompt": "def f(x):", "max_tokens": 4, **fields})


# ----------------------------------------------------------------------------------- sampling controls
CONTROLS = dict(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={"5": 2.5, "7": -1},
                min_tokens=2, priority=0)


@pytest.mark.parametrize("route", [chat, completion])
def test_sampling_controls_are_accepted(server, route):
    r = route(server, temperature=0.7, seed=3, **CONTROLS)
    assert r.status_code == 200, r.text


def test_sampling_controls_through_the_openai_client(client):
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=4, presence_penalty=1.0,
                                       frequency_penalty=1.0, logit_bias={"5": 3}, temperature=0,
                                       extra_body={"repetition_penalty": 1.2, "min_tokens": 1})
    assert r.choices[0].finish_reason in ("stop", "length")


# (fields, the parameter the 400 names, a fragment of its message)
REFUSED = [
    ({"presence_penalty": 2.5}, "presence_penalty", "2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "100"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "vocabulary"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5", "number"),
    ({"min_tokens": -1}, "min_tokens", "0"),
    ({"min_tokens": 5}, "min_tokens", "max_tokens"),            # > max_tokens 4
    ({"top_k": 1 << 31}, "top_k", "top_k"),                       # passes pydantic, refused by SamplingParams
    ({"stop": ["\ud800"]}, "stop", "surrogate"),                  # a lone surrogate: not UTF-8
    ({"priority": 1}, "priority", "arrival order"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     ""),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "schema object"),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml", ""),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_json": 5}, "guided_json", ""),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["x"]}}, "structured_outputs.choice",
     "structured_outputs.regex and structured_outputs.choice"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", ""),
]


@pytest.mark.parametrize("fields,param,fragment", REFUSED, ids=[p for _, p, _ in REFUSED])
@pytest.mark.parametrize("route", [chat, completion])
def test_bad_values_are_400s_naming_the_parameter(server, route, fields, param, fragment):
    r = route(server, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_engine_refusals_name_the_request_parameter():
    """An engine message that starts with a SamplingParams field is about the request's name for it."""
    from deepinfer.serve.request_params import refusal

    e = refusal("max_new_tokens must be between 0 and 9, not 10", {"max_new_tokens": "max_completion_tokens"})
    assert (e.param, e.message) == ("max_completion_tokens", "max_completion_tokens must be between 0 and 9, not 10")
    assert refusal("a stop string holds a lone surrogate U+D800 at character 0", {}).param == "stop"
    assert refusal("logit_bias['x'] must be a number", {}).param == "logit_bias"
    assert refusal("structured must be a dict", {"structured": "guided_json"}).param == "guided_json"
    # a message about several fields (or none) names no one of them
    assert refusal("penalties, logit_bias, min_tokens and structured output need ABI 1.7", {}).param is None
    assert refusal("token id 9 is outside the vocabulary", {}, "prompt").param == "prompt"


def test_chat_logprob_fields_are_checked(server):
    for fields, param in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                          ({"top_logprobs": 2}, "top_logprobs"),                   # without logprobs: true
                          ({"logprobs": "true"}, "logprobs")]:
        r = chat(server, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ----------------------------------------------------------------------------------- strict types
@pytest.mark.parametrize("field,value", [("temperature", "0.5"), ("top_p", "1"), ("max_tokens", "4"),
                                         ("max_tokens", 4.0), ("stream", "true"), ("n", True), ("seed", "1"),
                                         ("presence_penalty", "0"), ("ignore_eos", 1), ("min_tokens", "1"),
                                         ("priority", "0"), ("logprobs", "2"), ("temperature", True)])
def test_strict_types(server, field, value):
    route = completion if field == "logprobs" else chat
    r = route(server, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_an_int_where_a_float_belongs_is_fine(server):
    for route in (chat, completion):
        assert route(server, temperature=1, top_p=1, presence_penalty=0, frequency_penalty=0).status_code == 200


def test_null_is_the_default(server):
    nulls = dict.fromkeys(["n", "stream", "stop", "max_tokens", "temperature", "presence_penalty", "seed", "logprobs",
                           "top_logprobs", "min_tokens", "priority", "ignore_eos", "response_format", "logit_bias"])
    assert chat(server, **nulls).status_code == 200
    assert completion(server, **{**nulls, "max_tokens": None, "echo": None}).status_code == 200


def test_stream_options_are_strict(server):
    r = chat(server, stream=True, stream_options={"include_usage": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_usage"


# ----------------------------------------------------------------------------------- structured outputs
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CONSTRAINTS = [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"structured_outputs": {"regex": "[0-9]{3}"}},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"json_object": True}},
    {"guided_json": SCHEMA},
    {"guided_regex": "[0-9]{3}"},
    {"guided_grammar": 'root ::= "yes" | "no"'},
    {"guided_choice": ["yes", "no"]},
]


@pytest.mark.parametrize("fields", CONSTRAINTS, ids=[next(iter(f)) + ":" + str(next(iter(f.values())))[:24]
                                                     for f in CONSTRAINTS])
@pytest.mark.parametrize("route", [chat, completion])
def test_structured_output_requests_are_accepted(server, route, fields):
    r = route(server, **fields)
    assert r.status_code == 200, r.text


def test_engine_json_schema_output_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.chat.completions.create(
        model=NAME, messages=HI, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_engine_json_object_output_parses(client):
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_engine_choice_output_is_one_of_the_choices(client):
    r = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["apple", "banana"]}})
    assert r.choices[0].text in ("apple", "banana")


def test_engine_regex_output_matches(client):
    r = client.completions.create(model=NAME, prompt="x = ", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)


def test_engine_logit_bias_forces_a_token(client, tokenizer):
    t = tokenizer.encode(" banana", add_bos=False)[-1]
    r = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=6, temperature=0,
                                  logit_bias={str(t): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([t] * 6)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 3.0}}])
def test_engine_penalties_change_the_greedy_text(client, penalty):
    kw = dict(model=NAME, prompt="the the the the", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    kw = {**kw, **penalty, "extra_body": {**kw["extra_body"], **penalty.get("extra_body", {})}}
    assert client.completions.create(**kw).choices[0].text != plain


def test_engine_min_tokens_holds_off_eos(client, tokenizer):
    """eos biased to win at once: without min_tokens the reply is empty, with it exactly that long."""
    kw = dict(model=NAME, prompt="def f(x):", max_tokens=8, temperature=0, logit_bias={str(tokenizer.eos_id): 100})
    r = client.completions.create(**kw)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (0, "stop")
    r = client.completions.create(**kw, extra_body={"min_tokens": 3})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (3, "stop")


# ----------------------------------------------------------------------------------- chat logprobs
def _check_entries(entries, k):
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode("utf-8"))
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == k and tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        if k:     # greedy: the chosen token is the top one
            assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
            assert e.top_logprobs[0].token == e.token


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    _check_entries(content, 3)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    # top_logprobs 0: the chosen tokens' logprobs alone; logprobs off: none at all
    r0 = client.chat.completions.create(model=NAME, messages=HI, max_tokens=8, temperature=0, logprobs=True)
    _check_entries(r0.choices[0].logprobs.content, 0)
    assert [e.logprob for e in r0.choices[0].logprobs.content] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert client.chat.completions.create(model=NAME, messages=HI, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_streaming(client):
    kw = dict(model=NAME, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for c in client.chat.completions.create(**kw, stream=True):
        if c.choices and c.choices[0].logprobs is not None:
            streamed += c.choices[0].logprobs.content
    _check_entries(streamed, 2)
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)


def test_chat_logprobs_with_n(client):
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=4, temperature=1.0, seed=5, n=2,
                                       logprobs=True, top_logprobs=1)
    for c in r.choices:
        assert len(c.logprobs.content) == len(c.message.content and c.logprobs.content)
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 1 for e in c.logprobs.content)


# ----------------------------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_a_prompt(server, tokenizer):
    r = post(server, "/tokenize", {"model": NAME, "prompt": "def f(x):"}).json()
    assert r["tokens"] == tokenizer.encode("def f(x):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and "token_strs" not in r
    r = post(server, "/tokenize", {"prompt": "def f(x):", "add_special_tokens": False,
                                   "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("def f(x):", add_bos=False)
    assert "".join(r["token_strs"]) == "def f(x):"


def test_tokenize_messages_counts_the_chat_prompt(server, client):
    r = post(server, "/tokenize", {"messages": HI, "add_generation_prompt": True}).json()
    used = client.chat.completions.create(model=NAME, messages=HI, max_tokens=1).usage.prompt_tokens
    assert r["count"] == used
    shorter = post(server, "/tokenize", {"messages": HI, "add_generation_prompt": False}).json()
    assert shorter["count"] < r["count"]


def test_detokenize_round_trip(server):
    ids = post(server, "/tokenize", {"prompt": "with open(path) as f:", "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "with open(path) as f:"}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [5, -1]}, "tokens"),
    ("/detokenize", {"tokens": [4096]}, "tokens"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
])
def test_tokenize_errors(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


# ----------------------------------------------------------------------------------- clients as they are
LOBECHAT = {"model": NAME, "stream": True, "temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}


@pytest.mark.parametrize("penalties", [{}, {"presence_penalty": 0.6, "frequency_penalty": 0.3}])
def test_a_lobechat_payload(server, penalties):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LOBECHAT, **penalties, "max_tokens": 8},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] <= 8
    assert any(c["choices"] and c["choices"][0]["finish_reason"] in ("stop", "length") for c in chunks)


def test_logprob_bytes_are_each_tokens_raw_bytes(tokenizer):
    """A character split over tokens shows as U+FFFD in each token's text; the bytes join into it."""
    from deepinfer.serve.logprob_shapes import chat_logprobs

    class Out:
        token_ids = tokenizer.encode("héllo 世界", add_bos=False)
        logprobs = [(-0.5, [(t, -0.5)]) for t in token_ids]

    entries = chat_logprobs(tokenizer, Out)
    assert any(e["token"] == "\ufffd" for e in entries)
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "héllo 世界"
    assert entries[0]["top_logprobs"][0]["bytes"] == entries[0]["bytes"]
