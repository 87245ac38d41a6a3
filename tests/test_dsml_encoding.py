"""DeepSeek-V3.2 / V4 prompts (engine.dsml_encoding) and the Tokenizer hook that uses them for a model
that ships no chat template.

V3.2 is checked against the release's own fixture (tests/data/chat_templates/PROVENANCE.md) and the
example in its README. The V4 expectations are what the V4 reference encoder writes for the
conversations of its own tests (encoding/tests/test_input_{1,2}.json, whose outputs ms-swift's
tests/test_align/test_template/test_deepseek_v4_flash.py spells out; the files themselves could not
be fetched); they are built here from the format's parts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepinfer.engine import Tokenizer, default_model_dir
from deepinfer.engine.chat_template import RenderLimits
from deepinfer.engine.dsml_encoding import encode_messages
from deepinfer.errors import ConfigError, InputTypeError
from deepinfer.serve.reasoning import prompt_opens_reasoning
from deepinfer.serve.tool_calls import detect_tool_format, parse_tool_calls

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"


def _fixture():
    data = json.loads((TEMPLATES / "deepseek-v3.2-encoding-test_input.json").read_text(encoding="utf-8"))
    gold = (TEMPLATES / "deepseek-v3.2-encoding-test_output.txt").read_text(encoding="utf-8")
    return data, gold.rstrip("\n")      # DeepSeek's test strips the file's trailing newline


def _call(name, args, call_id=""):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _tool(name):
    return {"type": "function", "function": {"name": name, "description": f"{name} it",
                                             "parameters": {"type": "object", "properties": {}}}}


# ------------------------------------------------------------------------------------------- V3.2
def test_v32_official_fixture_is_reproduced_exactly():
    data, gold = _fixture()
    assert encode_messages(data["messages"], tools=data["tools"], thinking=True) == gold


def test_v32_fixture_with_tools_already_on_the_system_message():
    """DeepSeek's own test attaches the tools to messages[0]; passing them gives the same prompt."""
    data, gold = _fixture()
    messages = [{**data["messages"][0], "tools": data["tools"]}] + data["messages"][1:]
    assert encode_messages(messages, thinking=True) == gold


README = [{"role": "user", "content": "hello"},
          {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
          {"role": "user", "content": "1+1=?"}]


def test_v32_readme_example_thinking_and_chat():
    head = f"{BOS}{USER}hello{ASSISTANT}</think>Hello! I am DeepSeek.{EOS}{USER}1+1=?{ASSISTANT}"
    assert encode_messages(README, thinking=True) == head + "<think>"      # the README's printed output
    assert encode_messages(README, thinking=False) == head + "</think>"
    assert encode_messages(README, thinking=True, add_generation_prompt=False) == head[:-len(ASSISTANT)]


def test_v32_chat_mode_shows_no_reasoning():
    data, gold = _fixture()
    chat = encode_messages(data["messages"], tools=data["tools"], thinking=False)
    assert "<think>" not in chat.split("</functions>")[1]
    assert "Got the weather data" not in chat and "Now I know today" not in chat
    # everything but the reasoning of the turns after the last user message is as in thinking mode
    tail = "the day after tomorrow?" + ASSISTANT
    assert chat.split(tail)[0] == gold.split(tail)[0]


def test_v32_tool_results_then_generation_prompt():
    messages = [{"role": "user", "content": "weather in Paris and Rome?"},
                {"role": "assistant", "content": "", "reasoning_content": "two calls",
                 "tool_calls": [_call("get_weather", {"city": "Paris", "days": 2}, "a"),
                                _call("get_weather", {"city": "Rome", "days": 2}, "b")]},
                {"role": "tool", "tool_call_id": "a", "content": "sunny"},
                {"role": "tool", "tool_call_id": "b", "content": "rain"}]
    calls = (f'\n\n<{D}function_calls>\n'
             f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
             f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n</{D}function_calls>')
    results = "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>\n</function_results>"
    head = f"{BOS}{USER}weather in Paris and Rome?{ASSISTANT}<think>two calls</think>{calls}{EOS}{results}"
    assert encode_messages(messages, thinking=True) == head + "\n\n<think>"
    assert encode_messages(messages, thinking=True, add_generation_prompt=False) == head
    chat = f"{BOS}{USER}weather in Paris and Rome?{ASSISTANT}</think>{calls}{EOS}{results}\n\n</think>"
    assert encode_messages(messages, thinking=False) == chat


def test_v32_tools_without_a_system_message_make_one():
    text = encode_messages([{"role": "user", "content": "hi"}], tools=[_tool("ping")])
    assert text.startswith(BOS + "\n\n## Tools\n\nYou have access to a set of tools")
    assert text.endswith('{"name": "ping", "description": "ping it", "parameters": {"type": "object", '
                         f'"properties": {{}}}}}}\n</functions>\n{USER}hi{ASSISTANT}</think>')


# --------------------------------------------------------------------------------------------- V4
V4_SYSTEM = "You are a helpful assistant."
V4_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a specific location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
        "required": ["location"]}}}
V4_TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "<{D}tool_calls>" block like the following:\n\n<{D}tool_calls>\n<{D}invoke name="$TOOL_NAME">\n'
    f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>\n...\n'
    f'</{D}invoke>\n<{D}invoke name="$TOOL_NAME2">\n...\n</{D}invoke>\n</{D}tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n")
V4_TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def test_v4_thinking_with_tools_keeps_every_turns_reasoning():
    """The reference's test case 1 (its tools on the system message), one more turn added: with tools
    defined, no reasoning is dropped."""
    messages = [{"role": "system", "content": V4_SYSTEM},
                {"role": "user", "content": "What's the weather in Beijing?"},
                {"role": "assistant", "content": "", "reasoning_content":
                    "The user wants to know the weather in Beijing. I should use the get_weather tool.",
                 "tool_calls": [_call("get_weather", {"location": "Beijing", "unit": "celsius"}, "c1")]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 22}'},
                {"role": "assistant", "content": "It is 22°C.", "reasoning": "Got the weather data."},
                {"role": "user", "content": "Thanks"}]
    schema = json.dumps(V4_WEATHER["function"], ensure_ascii=False)
    expected = (f"{BOS}{V4_SYSTEM}\n\n{V4_TOOLS_HEAD}{schema}{V4_TOOLS_TAIL}"
                f"{USER}What's the weather in Beijing?{ASSISTANT}<think>The user wants to know the weather in "
                f"Beijing. I should use the get_weather tool.</think>\n\n<{D}tool_calls>\n"
                f'<{D}invoke name="get_weather">\n<{D}parameter name="location" string="true">Beijing</{D}parameter>\n'
                f'<{D}parameter name="unit" string="true">celsius</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{EOS}'
                f'{USER}<tool_result>{{"temperature": 22}}</tool_result>{ASSISTANT}<think>Got the weather data.'
                f"</think>It is 22°C.{EOS}{USER}Thanks{ASSISTANT}<think>")
    assert encode_messages(messages, tools=[V4_WEATHER], thinking=True, version="v4") == expected


def test_v4_thinking_without_tools_drops_earlier_reasoning():
    """The reference's test case 2."""
    messages = [{"role": "system", "content": V4_SYSTEM}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there! How can I help you?",
                 "reasoning_content": "The user said hello, I should greet back."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris.",
                 "reasoning_content": "The user asks about the capital of France. It is Paris."}]
    head = f"{BOS}{V4_SYSTEM}{USER}Hello{ASSISTANT}</think>Hi there! How can I help you?{EOS}"
    expected = (head + f"{USER}What is the capital of France?{ASSISTANT}<think>The user asks about the capital "
                f"of France. It is Paris.</think>The capital of France is Paris.{EOS}")
    assert encode_messages(messages, thinking=True, version="v4") == expected
    chat = head + f"{USER}What is the capital of France?{ASSISTANT}</think>The capital of France is Paris.{EOS}"
    assert encode_messages(messages, thinking=False, version="v4") == chat
    prompt = encode_messages(messages[:-1], thinking=True, version="v4")
    assert prompt.endswith(f"{USER}What is the capital of France?{ASSISTANT}<think>")
    no_opening = encode_messages(messages[:-1], thinking=True, version="v4", add_generation_prompt=False)
    assert no_opening == prompt[:-len(ASSISTANT + "<think>")]


def test_v4_tool_results_join_the_next_user_turn_in_call_order():
    messages = [{"role": "user", "content": "two cities?"},
                {"role": "assistant", "content": "Let me check.",
                 "tool_calls": [_call("get_weather", {"location": "Beijing"}, "x"),
                                _call("get_weather", {"location": "Shanghai"}, "y")]},
                {"role": "tool", "tool_call_id": "y", "content": "26"},     # answered out of order
                {"role": "tool", "tool_call_id": "x", "content": "22"},
                {"role": "user", "content": "and now?"}]
    text = encode_messages(messages, version="v4")
    assert text.endswith(f"</{D}tool_calls>{EOS}{USER}<tool_result>22</tool_result>\n\n"
                         f"<tool_result>26</tool_result>\n\nand now?{ASSISTANT}</think>")


def test_v4_max_reasoning_effort_prefix():
    messages = [{"role": "user", "content": "hi"}]
    plain = encode_messages(messages, thinking=True, version="v4")
    effort = encode_messages(messages, thinking=True, version="v4", reasoning_effort="max")
    assert effort.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert effort.endswith("is left unchecked.\n\n" + plain[len(BOS):])
    assert encode_messages(messages, thinking=True, version="v4", reasoning_effort="high") == plain
    assert encode_messages(messages, thinking=False, version="v4", reasoning_effort="max") == \
        encode_messages(messages, thinking=False, version="v4")


# ------------------------------------------------------------------------------ what parses back
ARGS = {"query": 'a "quoted" <b> string', "count": 3, "ratio": 0.5, "tags": ["x", "é"],
        "filters": {"k": None}, "strict": True}


@pytest.mark.parametrize("version", ["v32", "v4"])
def test_an_assistant_turn_parses_back_with_the_dsml_parser(version):
    messages = [{"role": "user", "content": "search"},
                {"role": "assistant", "content": "Searching.",
                 "tool_calls": [_call("search", ARGS, "s1"), _call("ping", {}, "s2")]}]
    text = encode_messages(messages, version=version)
    turn = text.split(ASSISTANT + "</think>", 1)[1]
    assert turn.endswith(EOS)
    content, calls = parse_tool_calls("dsml", turn[:-len(EOS)])
    assert content == "Searching."
    assert [c["function"]["name"] for c in calls] == ["search", "ping"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [ARGS, {}]


def test_official_fixture_turns_parse_back():
    data, gold = _fixture()
    wanted = [json.loads(c["function"]["arguments"]) for m in data["messages"] for c in m.get("tool_calls", [])]
    got = []
    for chunk in gold.split(EOS)[:-1]:
        if f"<{D}function_calls>\n<{D}invoke" in chunk:     # an assistant turn with calls (not the preamble)
            turn = chunk[chunk.rindex("</think>") + len("</think>"):]
            got += [json.loads(c["function"]["arguments"]) for c in parse_tool_calls("dsml", turn)[1]]
    assert got == wanted


# -------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("messages, kwargs, error, fragment", [
    ([{"role": "tool", "content": "r"}], {}, ConfigError, "tool message answers one of the tool_calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [_call("f", {})]},
      {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], {}, ConfigError, "only 1 of those for 2"),
    ([{"role": "narrator", "content": "x"}], {}, ConfigError, "role 'narrator' is not one"),
    ([{"role": "latest_reminder", "content": "x"}], {}, ConfigError, "role 'latest_reminder' is not one"),
    ([{"role": "user", "content": 3}], {}, InputTypeError, "messages[0]['content'] must be a string"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}], {}, ConfigError,
     "tool_calls'][0] must be"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("f", [1, 2])]}], {}, ConfigError,
     "must be a JSON object, not list"),
    ([{"role": "user", "content": "q"}], {"tools": [{"type": "function"}]}, ConfigError, "tools[0] must be"),
    ([{"role": "user", "content": "q"}], {"version": "v5"}, ConfigError, "version 'v5' is unknown"),
    ([], {}, ConfigError, "messages is empty"),
    ("hi", {}, InputTypeError, "messages must be a list"),
])
def test_bad_messages_are_clear_errors(messages, kwargs, error, fragment):
    with pytest.raises(error) as e:
        encode_messages(messages, **kwargs)
    assert fragment in str(e.value)


def test_arguments_that_are_not_json_become_one_parameter():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    assert f'<{D}parameter name="arguments" string="true">not json</{D}parameter>' in encode_messages(messages)


# --------------------------------------------------------------------------------- Tokenizer hook
def _encoder_model(tmp_path, **config):
    """The files a Tokenizer reads from the embedded model, with no chat_template and these config.json keys."""
    src = default_model_dir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    tc = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tc.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False), encoding="utf-8")
    cfg = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k not in config}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **{k: v for k, v in config.items() if v is not None}}))
    return tmp_path


def test_tokenizer_renders_a_v32_model_with_the_encoder(tmp_path):
    tok = Tokenizer(_encoder_model(tmp_path, model_type="deepseek_v32"))
    assert (tok.chat_template, tok.chat_encoder, tok.chat_format) == (None, "v32", "dsml")
    data, gold = _fixture()
    # the Tokenizer wants every message's content, as the server sends it ("" for a call-only turn)
    messages = [{"content": "", **m} for m in data["messages"]]
    assert tok.apply_chat_template(messages, tools=data["tools"], template_kwargs={"thinking": True}) == gold
    text = tok.apply_chat_template(README)
    assert text == encode_messages(README) and text.endswith(ASSISTANT + "</think>")
    assert tok.apply_chat_template(README, template_kwargs={"enable_thinking": True}).endswith("<think>")
    assert tok.apply_chat_template(README, add_generation_prompt=False).endswith("1+1=?")
    assert tok.encode(text, add_bos=False)[0] == tok.bos_id


def test_tokenizer_tells_the_server_the_format(tmp_path):
    tok = Tokenizer(_encoder_model(tmp_path, model_type="deepseek_v32"))
    assert detect_tool_format(tok.chat_markers) == "dsml"
    assert "<think>" in tok.chat_markers and "</think>" in tok.chat_markers
    assert prompt_opens_reasoning(tok.apply_chat_template(README, template_kwargs={"thinking": True}))
    assert not prompt_opens_reasoning(tok.apply_chat_template(README))


@pytest.mark.parametrize("config, encoder", [
    ({"model_type": "deepseek_v4"}, "v4"),
    ({"model_type": None, "architectures": ["DeepseekV32ForCausalLM"]}, "v32"),
    ({"model_type": None, "architectures": ["DeepseekV4ForCausalLM"]}, "v4"),
    ({"model_type": "deepseek_v3"}, None),
])
def test_tokenizer_finds_the_encoder_by_model_type_or_architecture(tmp_path, config, encoder):
    tok = Tokenizer(_encoder_model(tmp_path, **config))
    assert tok.chat_encoder == encoder
    if encoder is None:
        assert tok.chat_format is None and tok.chat_markers is None
        with pytest.raises(ConfigError, match="no chat_template"):
            tok.apply_chat_template(README)


def test_tokenizer_v4_model_uses_v4_and_reasoning_effort(tmp_path):
    tok = Tokenizer(_encoder_model(tmp_path, model_type="deepseek_v4"))
    kwargs = {"thinking": True, "reasoning_effort": "max"}
    assert tok.apply_chat_template(README, template_kwargs=kwargs) == \
        encode_messages(README, thinking=True, version="v4", reasoning_effort="max")


def test_a_chat_template_wins_over_the_encoder(tmp_path):
    """V3.2-Exp is a deepseek_v32 model with V3.1's template."""
    d = _encoder_model(tmp_path, model_type="deepseek_v32")
    tc = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    tc["chat_template"] = (TEMPLATES / "deepseek-v3.1.jinja").read_text(encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False), encoding="utf-8")
    tok = Tokenizer(d)
    assert (tok.chat_encoder, tok.chat_format) == (None, None)
    assert tok.chat_markers == tok.chat_template
    assert detect_tool_format(tok.chat_markers) == "v31"


def test_tokenizer_hook_bad_kwargs(tmp_path):
    tok = Tokenizer(_encoder_model(tmp_path, model_type="deepseek_v32"))
    with pytest.raises(InputTypeError, match="thinking must be true or false"):
        tok.apply_chat_template(README, template_kwargs={"thinking": "yes"})
    with pytest.raises(ConfigError, match="may not set tools"):
        tok.apply_chat_template(README, template_kwargs={"tools": []})
    with pytest.raises(ConfigError, match="over the limit of 10"):
        tok.apply_chat_template(README, limits=RenderLimits(max_chars=10))
