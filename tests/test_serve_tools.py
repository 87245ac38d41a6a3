"""Tool calling and reasoning through a live server and the official openai client (issue 46 items 3 and
4), on tiny models that carry DeepSeek-R1's and DeepSeek-V3.1's published chat templates and special
tokens, and a tiny V3.2 checkpoint whose prompts DeepSeek's DSML encoding renders
(tests/family_chat_models.py, engine.dsml_encoding): tool_choice "required" and a named function always yield calls
whose arguments validate against the tool's parameters, streamed or not (the grammar forces them even
though the model never learned tools); reasoning_content is split from content, also when the
template opened <think> in the prompt; a response_format applies after the reasoning; V3.1's
thinking switch reaches the template."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from family_chat_models import family_model  # noqa: E402
from test_serve import NAME, LiveServer, _config  # noqa: E402

from deepinfer.engine.tokenizer import Tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["r1", "v31", "v32"])
def family(request, tmp_path_factory, tiny_checkpoint):
    # V3.2: a tiny V3.2 checkpoint with no template; the DSML encoder renders its prompts
    weights = tiny_checkpoint("v32")[0] if request.param == "v32" else None
    d = family_model(tmp_path_factory.mktemp("fam"), request.param, weights_from=weights)
    s = LiveServer({**_config(), "max_seq_len": 1536}, model=str(d))
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    client.server_url = s.url
    yield request.param, client, Tokenizer(d)
    s.stop()


def _think_end_bias(tok) -> dict:
    """Bias that closes the reasoning at once (the tiny model would reason until max_tokens)."""
    ids = tok.encode("</think>", add_bos=False)
    assert len(ids) == 1
    return {str(ids[0]): 100}


def _kw(fam, tok, **kw):
    """R1's template opens <think> in the prompt: close it at once so the calls come within max_tokens;
    V3.1's chat mode (thinking off, its default) has no reasoning."""
    if fam == "r1":
        kw["logit_bias"] = _think_end_bias(tok)
    return dict(model=NAME, messages=ASK, max_tokens=400, temperature=0.7, **kw)


def _check_calls(calls, allowed):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == c.function.name)
        assert c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_always_calls_a_tool_with_valid_arguments(family, seed):
    fam, client, tok = family
    r = client.chat.completions.create(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed,
                                       **_kw(fam, tok))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert len(c.message.tool_calls) == 1
    _check_calls(c.message.tool_calls, {"get_weather", "get_time"})
    assert c.message.content is None


def test_parallel_calls_each_validate(family):
    """With parallel_tool_calls the tiny model may go on calling until max_tokens: every call it
    finished validates, and there is more than one."""
    fam, client, tok = family
    r = client.chat.completions.create(tools=TOOLS, tool_choice="required", seed=11, **_kw(fam, tok))
    c = r.choices[0]
    calls = c.message.tool_calls
    done = calls if c.finish_reason == "tool_calls" else calls[:-1]
    assert len(calls) > 1 and done
    _check_calls(done, {"get_weather", "get_time"})


def test_a_named_function_is_the_one_called(family):
    fam, client, tok = family
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, seed=5,
                                       **_kw(fam, tok))
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_calls(calls, {"get_time"})


def test_streamed_tool_calls_add_up_to_the_whole_response(family):
    fam, client, tok = family
    kw = _kw(fam, tok, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=9)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, reason, pieces = {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or ():
                if d.id:
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
                pieces += 1
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert pieces > len(calls)          # the arguments arrived in several deltas


def test_tool_choice_none_and_bad_choices(family):
    fam, client, tok = family
    r = client.chat.completions.create(tools=TOOLS, tool_choice="none", **_kw(fam, tok))
    assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="not one of the tools"):
        client.chat.completions.create(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}},
                                       **_kw(fam, tok))
    with pytest.raises(openai.BadRequestError, match="use one of them"):
        client.chat.completions.create(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"},
                                       **_kw(fam, tok))


def test_r1_reasoning_is_split_from_the_answer(family):
    fam, client, tok = family
    if fam != "r1":
        pytest.skip("R1's template opens <think> in the prompt")
    r = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=12, temperature=0)
    m = r.choices[0].message
    assert m.reasoning_content and not m.content      # the tiny model never closes its reasoning
    # a json_object format applies after the reasoning: the bias closes it at once, the answer is JSON
    r = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=200, temperature=0.5, seed=4,
                                       logit_bias=_think_end_bias(tok), response_format={"type": "json_object"},
                                       frequency_penalty=1.0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # streamed: reasoning deltas first, no tag in either field
    text, reasoning = "", ""
    for chunk in client.chat.completions.create(model=NAME, messages=ASK, max_tokens=12, temperature=0,
                                                stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            text += ch.delta.content or ""
    assert reasoning == m.reasoning_content and text == "" and "<think>" not in reasoning


def test_thinking_switch_reaches_the_template(family):
    fam, client, tok = family
    if fam == "r1":
        pytest.skip("R1 always thinks")
    on = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, temperature=0,
                                        extra_body={"chat_template_kwargs": {"thinking": True}})
    off = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, temperature=0)
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content
    assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning_content", None)
    v4 = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, temperature=0,
                                        extra_body={"thinking": {"type": "enabled"}})
    assert v4.choices[0].message.reasoning_content == on.choices[0].message.reasoning_content


# ----------------------------------------------------------------------------- Anthropic's /v1/messages
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def _anthropic(client):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=client.server_url, api_key="none", max_retries=0, timeout=300)


def _a_kw(fam, tok, **kw):
    """R1 opens <think> in the prompt: Anthropic's prefill (a last assistant message) closes it."""
    msgs = [*ASK, {"role": "assistant", "content": "</think>"}] if fam == "r1" else ASK
    return dict(model=NAME, max_tokens=400, messages=msgs, tools=A_TOOLS, extra_body={"temperature": 0.7}, **kw)


def test_anthropic_tool_use_blocks_validate(family):
    fam, client, tok = family
    a = _anthropic(client)
    r = a.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True}, **_a_kw(fam, tok))
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1, r.content
    tool = next(t for t in A_TOOLS if t["name"] == uses[0].name)
    jsonschema.validate(uses[0].input, tool["input_schema"])
    assert uses[0].id.startswith("toolu_")
    # the same streamed: the SDK rebuilds the block from input_json_delta events
    with a.messages.stream(tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                           **_a_kw(fam, tok)) as st:
        final = st.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and all(u.name == "get_time" for u in uses)
    jsonschema.validate(uses[0].input, A_TOOLS[1]["input_schema"])


def test_anthropic_tool_result_round_trip(family):
    """A conversation carrying the call and its tool_result renders through the family's template."""
    fam, client, tok = family
    a = _anthropic(client)
    msgs = [*ASK, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"}]}]
    n = a.messages.count_tokens(model=NAME, messages=msgs, tools=A_TOOLS).input_tokens
    assert n > a.messages.count_tokens(model=NAME, messages=ASK, tools=A_TOOLS).input_tokens
    r = a.messages.create(model=NAME, max_tokens=8, messages=msgs, tools=A_TOOLS, tool_choice={"type": "none"})
    assert r.stop_reason in ("end_turn", "max_tokens") and not any(b.type == "tool_use" for b in r.content)


def test_anthropic_thinking_block(family):
    fam, client, tok = family
    if fam == "r1":
        pytest.skip("R1 always thinks")
    a = _anthropic(client)
    r = a.messages.create(model=NAME, max_tokens=8, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024},
                          extra_body={"temperature": 0})
    assert r.content[0].type == "thinking" and r.content[0].thinking
    off = a.messages.create(model=NAME, max_tokens=8, messages=ASK, extra_body={"temperature": 0})
    assert [b.type for b in off.content] == ["text"]
