"""Tool-call parsing (serve/tool_calls.py) and the forcing grammars (serve/tool_grammar.py), on model
outputs in each family's format as the published templates render them (tests/data/chat_templates):
the R1 template for "v3", the V3.1 template for "v31", the official V3.2 encoder's rendering for
"dsml" and V4's encoder format (the `tool_calls` block) written here from its templates.

Every output is fed in random small chunks (so chunk boundaries fall inside special tokens) and must
give what the one-shot parse gives; the concatenated argument deltas must parse as the JSON of the
call; content around the calls is kept; truncated and malformed outputs never raise."""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from deepinfer.engine.chat_template import ChatTemplate, RenderLimits
from deepinfer.serve.reasoning import ReasoningParser, split_reasoning
from deepinfer.serve.tool_calls import (ContentDelta, ToolCallDelta, collect_events, detect_tool_format,
                                        make_tool_parser, parse_tool_calls)
from deepinfer.serve.tool_grammar import tool_call_grammar

DATA = Path(__file__).resolve().parent / "data" / "chat_templates"
NANO = Path(__file__).resolve().parents[1] / "runtime" / "deepinfer" / "assets" / "deepseek-v3-nano"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

WEATHER = {"location": "San Francisco, CA", "unit": "celsius", "days": 3}
ODD = {"query": "say \"hi\"\nthen {leave}", "tags": ["a", "ü"], "opts": {"deep": True, "n": None}, "k": -1.5}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer"}},
        "required": ["location"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "tags": {"type": "array"},
                                         "opts": {"type": "object"}, "k": {"type": "number"}},
        "required": ["query"]}}},
]


def _call(name, args, i):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args,
                                                                                                 ensure_ascii=False)}}


CALLS = [_call("get_weather", WEATHER, 0), _call("search", ODD, 1)]


def _render(name: str, messages, **kwargs) -> str:
    return ChatTemplate((DATA / name).read_text(encoding="utf-8"), name).render(
        RenderLimits(), messages=messages, bos_token=BOS, eos_token=EOS, **kwargs)


def _r1_output(content):
    """The assistant turn the R1 template renders for CALLS: what a "v3" model writes."""
    prompt = _render("deepseek-r1.jinja", [{"role": "user", "content": "Weather in SF, and search."},
                                           {"role": "assistant", "content": content, "tool_calls": CALLS}])
    return prompt.split("<｜Assistant｜>", 1)[1].removesuffix(EOS)


def _v31_output(content):
    prompt = _render("deepseek-v3.1.jinja", [{"role": "user", "content": "Weather in SF, and search."},
                                             {"role": "assistant", "content": content, "tool_calls": CALLS}])
    return prompt.split("<｜Assistant｜></think>", 1)[1].removesuffix(EOS)


def _v4_output(calls, content=""):
    """V4's encoder (encoding_dsv4.py) writes content, then "\\n\\n" and a `tool_calls` DSML block:
    one invoke per call, one parameter per argument, string="true" for strings (written raw) and
    "false" for the rest (written as JSON)."""
    def param(k, v):
        raw = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        kind = "true" if isinstance(v, str) else "false"
        return f'<｜DSML｜parameter name="{k}" string="{kind}">{raw}</｜DSML｜parameter>'
    invokes = [f'<｜DSML｜invoke name="{c["function"]["name"]}">\n'
               + "\n".join(param(k, v) for k, v in json.loads(c["function"]["arguments"]).items())
               + "\n</｜DSML｜invoke>" for c in calls]
    return content + "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def _v32_blocks():
    """(DSML block as the official V3.2 encoder wrote it, the tool calls of the test input it renders)."""
    text = (DATA / "deepseek-v3.2-encoding-test_output.txt").read_text(encoding="utf-8")
    text = text.split("<｜User｜>", 1)[1]        # the system prompt's tool instructions hold an example block
    messages = json.loads((DATA / "deepseek-v3.2-encoding-test_input.json").read_text(encoding="utf-8"))["messages"]
    blocks = ["\n\n<｜DSML｜function_calls>" + b.split("</｜DSML｜function_calls>")[0] + "</｜DSML｜function_calls>"
              for b in text.split("\n\n<｜DSML｜function_calls>")[1:]]
    expected = [m["tool_calls"] for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(blocks) == len(expected) == 3
    return list(zip(blocks, expected))


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _chunks(text, rng, most=6):
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        out.append(text[i:i + n])
        i += n
    return out


def _stream(fmt, pieces):
    parser = make_tool_parser(fmt, _ids())
    events = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()


def _check_event_shapes(events):
    """Headers first, OpenAI-shaped; argument deltas only for an opened call."""
    opened = set()
    for e in events:
        assert isinstance(e, (ContentDelta, ToolCallDelta))
        if isinstance(e, ToolCallDelta):
            item = e.item
            if "id" in item:
                assert item["type"] == "function" and item["function"]["arguments"] == ""
                assert item["index"] == len(opened) and item["id"].startswith("call_")
                opened.add(item["index"])
            else:
                assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
                assert item["index"] in opened


def _assert_streams_like_one_shot(fmt, text, seeds=range(6)):
    whole = parse_tool_calls(fmt, text, _ids())
    for seed in seeds:
        events = _stream(fmt, _chunks(text, random.Random(seed)))
        _check_event_shapes(events)
        assert collect_events(events) == whole, seed
    return whole


def _same_calls(got, expected):
    assert [c["function"]["name"] for c in got] == [c["function"]["name"] for c in expected]
    for g, e in zip(got, expected):
        assert json.loads(g["function"]["arguments"]) == json.loads(e["function"]["arguments"])


# ---- the published formats, parsed back


@pytest.mark.parametrize("content", ["Let me look that up.", None])
def test_v3_r1_template_output(content):
    text = _r1_output(content)
    assert text.startswith((content or "") + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>")
    got_content, calls = _assert_streams_like_one_shot("v3", text)
    assert got_content == (content or "")
    _same_calls(calls, CALLS)


@pytest.mark.parametrize("content", ["Checking.", None])
def test_v31_template_output(content):
    text = _v31_output(content)
    assert "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{" in text
    got_content, calls = _assert_streams_like_one_shot("v31", text)
    assert got_content == (content or "")
    _same_calls(calls, CALLS)


@pytest.mark.parametrize("case", range(3))
def test_dsml_official_v32_encoder_output(case):
    block, expected = _v32_blocks()[case]
    content, calls = _assert_streams_like_one_shot("dsml", block)
    assert content == ""                         # the "\n\n" before the block is not content
    _same_calls(calls, expected)


def test_dsml_v4_block_with_every_parameter_type():
    text = _v4_output(CALLS, content="I'll call two tools.")
    content, calls = _assert_streams_like_one_shot("dsml", text)
    assert content == "I'll call two tools."
    _same_calls(calls, CALLS)


def test_v32_thinking_turn_through_both_parsers():
    """The last thinking-mode turn of the official V3.2 rendering: reasoning split first, then the
    content stream parsed for calls, both in random chunks."""
    text = (DATA / "deepseek-v3.2-encoding-test_output.txt").read_text(encoding="utf-8")
    output = text.rpartition("<｜Assistant｜><think>")[2].split(EOS)[0]
    expected_reasoning, _ = split_reasoning(output, True)
    expected = _v32_blocks()[2][1]
    for seed in range(4):
        reasoner, tools = ReasoningParser(starts_in_reasoning=True), make_tool_parser("dsml", _ids())
        reasoning, events = "", []
        for piece in _chunks(output, random.Random(seed)) + [None]:
            r, c = reasoner.feed(piece) if piece is not None else reasoner.finish()
            reasoning += r
            events += tools.feed(c) if piece is not None else tools.feed(c) + tools.finish()
        assert reasoning == expected_reasoning
        content, calls = collect_events(events)
        assert content == ""
        _same_calls(calls, expected)


def test_arguments_stream_before_the_call_ends():
    parser = make_tool_parser("v31", _ids())
    assert parser.feed("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wea") == [ContentDelta("Sure.")]
    head = parser.feed("ther<｜tool▁sep｜>")
    assert head == [ToolCallDelta({"index": 0, "id": "call_0", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}})]
    assert parser.feed('{"location": "S') == [ToolCallDelta({"index": 0, "function": {"arguments": '{"location": "S'}})]
    assert parser.feed('F"}<｜tool▁call') == [ToolCallDelta({"index": 0, "function": {"arguments": 'F"}'}})]
    assert parser.feed("▁end｜><｜tool▁calls▁end｜>") == []
    assert parser.finish() == []


def test_dsml_string_values_stream_as_escaped_json():
    parser = make_tool_parser("dsml", _ids())
    events = parser.feed('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="note">\n'
                         '<｜DSML｜parameter name="text" string="true">line "one"\nli')
    assert collect_events(events)[1][0]["function"]["arguments"] == '{"text": "line \\"one\\"\\nli'
    events += parser.feed('ne two</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>') + parser.finish()
    assert json.loads(collect_events(events)[1][0]["function"]["arguments"]) == {"text": 'line "one"\nline two'}


def test_content_before_between_and_after_calls_is_kept():
    between = "<｜tool▁calls▁end｜> and then <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    one = _r1_output(None).replace("\n<｜tool▁call▁begin｜>", between)     # two blocks, text between them
    content, calls = _assert_streams_like_one_shot("v3", "Before. " + one + " After.")
    assert content == "Before.  and then  After." and len(calls) == 2
    content, calls = _assert_streams_like_one_shot("dsml", _v4_output(CALLS[:1], "Hi") + "\n\nDone.")
    assert content == "Hi\n\nDone." and len(calls) == 1


def test_plain_text_is_all_content():
    for fmt in ("v3", "v31", "dsml"):
        text = "No tools needed: <b>bold</b>, <｜tool▁ and ｜DSML｜ are just text here.\n\n"
        assert _assert_streams_like_one_shot(fmt, text) == (text, [])


# ---- truncated and malformed output


@pytest.mark.parametrize("fmt,make", [("v3", lambda: _r1_output("Hi.")), ("v31", lambda: _v31_output("Hi.")),
                                      ("dsml", lambda: _v4_output(CALLS, "Hi."))])
def test_truncated_output_at_every_position(fmt, make):
    """Cut anywhere: no exception, streaming equals one-shot, and every call's arguments so far are a
    prefix of the whole call's (so nothing is invented); before any call opens, all of it is content."""
    text = make()
    _, full = parse_tool_calls(fmt, text, _ids())
    rng = random.Random(0)
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        content, calls = parse_tool_calls(fmt, prefix, _ids())
        assert collect_events(_stream(fmt, _chunks(prefix, rng))) == (content, calls), cut
        for got, whole in zip(calls, full):
            assert got["function"]["name"] == whole["function"]["name"]
            assert whole["function"]["arguments"].startswith(got["function"]["arguments"]), cut
        if not calls:
            assert text.startswith(content)


@pytest.mark.parametrize("fmt,text", [
    ("v3", "<｜tool▁calls▁begin｜>I cannot call tools today."),
    ("v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>not a name\n```json\n{}\n```<｜tool▁call▁end｜>"),
    ("v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + "x" * 300),
    ("v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get<｜tool▁call▁end｜>oops"),
    ("dsml", "\n\n<｜DSML｜function_calls>\nI changed my mind."),
    ("dsml", "<｜DSML｜not_a_block>text"),
    ("dsml", '<｜DSML｜function_calls>\n<｜DSML｜invoke nam="x">\n</｜DSML｜invoke>'),
])
def test_malformed_markup_is_given_back_as_content(fmt, text):
    assert _assert_streams_like_one_shot(fmt, text) == (text, [])


@pytest.mark.parametrize("fmt,text", [
    ("v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"),   # no end token
    ("v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜>"),      # no fence, no block token
    ("v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁calls▁end｜>"),
    ("dsml", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜tool_calls>'),
])
def test_sloppy_but_unambiguous_calls_are_read(fmt, text):
    content, calls = _assert_streams_like_one_shot(fmt, text)
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", "{}")]


def test_dsml_value_conversion():
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="n" string="false">42</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="s" string="true">42</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="bad" string="false">not json</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="none">[1, 2]</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    _, calls = _assert_streams_like_one_shot("dsml", text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": 42, "s": "42", "bad": "not json", "none": [1, 2]}


def test_v41_spaced_tags_are_read():
    text = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x'
            '</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    _, calls = _assert_streams_like_one_shot("dsml", text)
    assert calls[0]["function"]["arguments"] == '{"a": "x"}'


def test_unknown_format():
    with pytest.raises(ValueError):
        make_tool_parser("v2")


def test_detect_tool_format():
    assert detect_tool_format((DATA / "deepseek-r1.jinja").read_text(encoding="utf-8")) == "v3"
    assert detect_tool_format((DATA / "deepseek-v3.1.jinja").read_text(encoding="utf-8")) == "v31"
    assert detect_tool_format((DATA / "deepseek-v3.2-encoding-test_output.txt").read_text(encoding="utf-8")) == "dsml"
    nano = json.loads((NANO / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert detect_tool_format(nano) is None and detect_tool_format(None) is None


# ---- the forcing grammars


@pytest.fixture(scope="module")
def llg():
    return pytest.importorskip("llguidance")      # not needed by the parsers: only these tests skip


@pytest.fixture(scope="module")
def nano_tokenizer(llg):
    return llg.LLTokenizer((NANO / "tokenizer.json").read_text(encoding="utf-8"), eos_token=1)


def _accepts(tokenizer, grammar, text, tokens=None):
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar), log_level=0)
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text) if tokens is None else tokens)
    return ok and matcher.is_accepting() and not matcher.is_error()


NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.mark.parametrize("fmt", ["v3", "v31", "dsml"])
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), (NAMED, True), (NAMED, False)])
def test_grammar_compiles(llg, nano_tokenizer, fmt, choice, parallel):
    grammar = tool_call_grammar(fmt, TOOLS, choice, parallel, reasoning=parallel)
    assert llg.LLMatcher.validate_grammar(llg.grammar_from("lark", grammar), nano_tokenizer) == ""


def _published_outputs():
    """(format, output with calls only, the calls) as each family writes them."""
    return [("v3", _r1_output(None), CALLS), ("v31", _v31_output(None), CALLS),
            ("dsml", _v4_output(CALLS), CALLS), ("dsml", _v32_blocks()[1][0], _v32_blocks()[1][1])]


def test_grammar_accepts_what_the_templates_render(nano_tokenizer):
    v32_tools = json.loads((DATA / "deepseek-v3.2-encoding-test_input.json").read_text(encoding="utf-8"))["tools"]
    for fmt, text, calls in _published_outputs():
        tools = v32_tools if calls is not CALLS else TOOLS
        assert _accepts(nano_tokenizer, tool_call_grammar(fmt, tools, "required", True), text), fmt
        # and the parser reads the forced text back as the calls
        _same_calls(parse_tool_calls(fmt, text)[1], calls)
        # one call only without parallel calls
        assert not _accepts(nano_tokenizer, tool_call_grammar(fmt, tools, "required", False), text), fmt


def test_grammar_refuses_what_the_choice_or_schema_rules_out(nano_tokenizer):
    for fmt, text, _ in _published_outputs()[:3]:
        # a named choice refuses the other function (these outputs call get_weather first)
        assert not _accepts(nano_tokenizer, tool_call_grammar(fmt, TOOLS, NAMED, True), text), fmt
        # an argument of the wrong type is refused
        bad = text.replace('"days": 3', '"days": "3"').replace('string="false">3<', 'string="false">"x"<')
        assert bad != text and not _accepts(nano_tokenizer, tool_call_grammar(fmt, TOOLS, "required", True), bad), fmt
    # text outside the calls is refused; a reasoning prefix is accepted only when asked for
    v31 = _v31_output(None)
    assert not _accepts(nano_tokenizer, tool_call_grammar("v31", TOOLS, "required", True), "Sure! " + v31)
    thought = "The user wants weather.\n</think>\n\n" + v31
    assert _accepts(nano_tokenizer, tool_call_grammar("v31", TOOLS, "required", True, reasoning=True), thought)
    assert not _accepts(nano_tokenizer, tool_call_grammar("v31", TOOLS, "required", True), thought)


def test_grammar_with_tool_markers_as_special_tokens(llg, nano_tokenizer):
    """A real DeepSeek tokenizer has the tool markers as tokens: named in special_tokens they are
    matched as those tokens, and their spelling as text is refused."""
    markers = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "</think>"]
    spec = json.loads((NANO / "tokenizer.json").read_text(encoding="utf-8"))
    first = len(spec["model"]["vocab"])
    spec["added_tokens"] += [{"id": first + i, "content": m, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, m in enumerate(markers)]
    tokenizer = llg.LLTokenizer(json.dumps(spec), eos_token=1)
    text = _v31_output(None)
    grammar = tool_call_grammar("v31", TOOLS, "required", True, special_tokens=markers)
    assert llg.LLMatcher.validate_grammar(llg.grammar_from("lark", grammar), tokenizer) == ""
    assert _accepts(tokenizer, grammar, text, tokenizer.tokenize_str(text, parse_special=True))
    assert not _accepts(tokenizer, grammar, text, tokenizer.greedy_tokenize(text))
    # with reasoning first, ended by </think> as a token
    grammar = tool_call_grammar("v31", TOOLS, "required", True, reasoning=True, special_tokens=markers)
    thought = "Weather first.</think>" + text
    assert _accepts(tokenizer, grammar, thought, tokenizer.tokenize_str(thought, parse_special=True))


@pytest.mark.parametrize("tools,choice", [
    ([], "required"),
    ([{"type": "function", "function": {}}], "required"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}),
    (TOOLS, "auto"),
])
def test_grammar_refuses_bad_requests(tools, choice):
    with pytest.raises(ValueError):
        tool_call_grammar("v3", tools, choice, True)
    with pytest.raises(ValueError):
        tool_call_grammar("xml", TOOLS, "required", True)
