"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against the official `anthropic`
client on one live server: a message equals the offline engine's chat, streaming gives Anthropic's
event sequence and the same text, stop_sequences / max_tokens give their stop_reason, a last
assistant message is continued (prefill), and every error has Anthropic's shape.

This client version takes temperature / top_p / top_k only through extra_body."""
from __future__ import annotations

import json
import time

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve import NAME, LiveServer, _config  # noqa: E402

from deepinfer.engine import Engine, default_model_dir  # noqa: E402
from deepinfer.serve.app import ServerLimits  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server():
    s = LiveServer(_config(), ServerLimits(max_body_bytes=64 << 10, max_prompt_tokens=200))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return Engine.from_pretrained(default_model_dir(), config={**_config(), "enable_prefix_cache": False})


def prompt_ids(offline, messages, prefill=""):
    tok = offline.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True) + prefill, add_bos=False)


def test_create_equals_the_offline_chat(client, offline):
    r = client.messages.create(model=NAME, max_tokens=12, messages=HI, **GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == NAME and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == offline.chat(HI, max_new_tokens=12)
    assert r.usage.input_tokens == len(prompt_ids(offline, HI)) and 0 < r.usage.output_tokens <= 12
    assert r.stop_reason == ("max_tokens" if r.usage.output_tokens == 12 else "end_turn") and r.stop_sequence is None


def test_system_as_a_string_or_text_blocks(client, offline):
    system = "You are terse."
    a = client.messages.create(model=NAME, max_tokens=8, messages=HI, system=system, **GREEDY)
    b = client.messages.create(model=NAME, max_tokens=8, messages=HI, **GREEDY,
                               system=[{"type": "text", "text": "You are ", "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "terse."}])
    want = offline.chat([{"role": "system", "content": system}, *HI], max_new_tokens=8)
    assert a.content[0].text == b.content[0].text == want
    assert a.usage.input_tokens == b.usage.input_tokens


def test_text_blocks_in_messages(client):
    a = client.messages.create(model=NAME, max_tokens=6, messages=HI, **GREEDY)
    b = client.messages.create(model=NAME, max_tokens=6, **GREEDY,
                               messages=[{"role": "user", "content": [{"type": "text", "text": "h"},
                                                                      {"type": "text", "text": "i"}]}])
    assert a.content[0].text == b.content[0].text


def test_stream_gives_the_same_message(client):
    whole = client.messages.create(model=NAME, max_tokens=10, messages=HI, **GREEDY)
    with client.messages.stream(model=NAME, max_tokens=10, messages=HI, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stream_event_sequence(server):
    """Anthropic's sequence on the wire: each `event:` line names the type its data carries."""
    body = {"model": NAME, "max_tokens": 6, "messages": HI, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in datas]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start, delta = datas[0]["message"], datas[-2]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in datas[3:-3])
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] <= 6


def test_stop_sequences(client):
    kw = dict(model=NAME, messages=HI, max_tokens=24, **GREEDY)
    full = client.messages.create(**kw).content[0].text
    stop = full.strip()[3:6]
    if len(stop) < 3:
        pytest.skip("reply too short")
    r = client.messages.create(**kw, stop_sequences=["never-there", stop])
    assert r.content[0].text == full[:full.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with client.messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert final.content[0].text == r.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_count_tokens(client, offline):
    system = "Be brief."
    n = client.messages.count_tokens(model=NAME, messages=HI, system=system).input_tokens
    used = client.messages.create(model=NAME, max_tokens=1, messages=HI, system=system).usage.input_tokens
    assert n == used == len(prompt_ids(offline, [{"role": "system", "content": system}, *HI]))


def test_a_last_assistant_message_is_continued(client, offline):
    msgs = [*HI, {"role": "assistant", "content": "def"}]
    r = client.messages.create(model=NAME, max_tokens=8, messages=msgs, **GREEDY)
    [want] = offline.generate_ids([prompt_ids(offline, HI, "def")], max_new_tokens=8)
    assert r.content[0].text == offline.tokenizer.decode(want)
    assert r.usage.input_tokens == len(prompt_ids(offline, HI, "def"))


def test_optional_fields_are_accepted(client):
    r = client.messages.create(model=NAME, max_tokens=4, messages=HI, metadata={"user_id": "u-1"},
                               service_tier="standard_only", thinking={"type": "disabled"},
                               extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20})
    assert r.usage.output_tokens <= 4


def _refused(client, status=400, **kw):
    body = {"model": NAME, "max_tokens": 4, "messages": HI, **kw}
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**body)
    assert e.value.status_code == status
    assert e.value.body["type"] == "error" and set(e.value.body["error"]) == {"type", "message"}
    return e.value.body["error"]


def test_errors_have_the_anthropic_shape(client):
    tools = [{"name": "get_time", "description": "the time", "input_schema": {"type": "object"}}]
    assert "renders no tool calls" in _refused(client, tools=tools)["message"]       # the nano template has none
    err = _refused(client, 404, model="claude-sonnet-4-5")
    assert err["type"] == "not_found_error" and "deepseek-v3-nano" in err["message"]
    err = _refused(client, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert err["type"] == "invalid_request_error" and "image" in err["message"]
    err = _refused(client, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "12:00"}]}])
    assert "renders no tool calls" in err["message"]
    assert "thinking" in _refused(client, thinking={"type": "enabled", "budget_tokens": 2048})["message"]
    assert "max_tokens" in _refused(client, max_tokens=10_000)["message"]
    assert "temperature" in _refused(client, extra_body={"temperature": "0.5"})["message"]     # strict types
    assert "temperature" in _refused(client, extra_body={"temperature": 1.5})["message"]       # Anthropic's [0, 1]
    assert "stop_sequences" in _refused(client, stop_sequences=[str(i) for i in range(20)])["message"]
    assert "trailing whitespace" in _refused(client, messages=[*HI, {"role": "assistant", "content": "x "}])["message"]
    assert "unknown_field" in _refused(client, extra_body={"unknown_field": 1})["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=NAME, messages=HI, tools=tools)


def test_raw_errors_have_the_anthropic_shape(server):
    for path, body, status, kind in [
            ("/v1/messages", {"model": NAME, "messages": HI}, 400, "invalid_request_error"),        # no max_tokens
            ("/v1/messages", {"model": NAME, "max_tokens": 4, "messages": []}, 400, "invalid_request_error"),
            ("/v1/messages/count_tokens", {"model": "nope", "messages": HI}, 404, "not_found_error"),
            ("/v1/messages/nothing", {}, 404, "not_found_error")]:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    r = httpx.post(server.url + "/v1/messages", content=b"{" + b" " * (70 << 10) + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(server.url + "/v1/messages", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server, client):
    with client.messages.stream(model=NAME, max_tokens=200, messages=HI) as s:
        next(iter(s.text_stream))
    t0 = time.time()
    while time.time() - t0 < 30:
        snap = server.aengine.snapshot()
        if (snap["running"], snap["waiting"], snap["kv_blocks_used"]) == (0, 0, 0):
            break
        time.sleep(0.1)
    assert (snap["running"], snap["waiting"], snap["kv_blocks_used"]) == (0, 0, 0)
