"""Grammars (llguidance's Lark dialect) that make the output one or more tool calls, for a request's
tool_choice "required" or {"type": "function", "function": {"name": ...}}.

The grammar spells the calls exactly as the model's chat template renders them (the formats of
tool_calls.py), so what the model is forced to write is what it was trained to write, and what
tool_calls.py reads back. Arguments follow each function's JSON-schema `parameters` through
llguidance's inline `%json {...}` rules ("lenient": keywords it does not implement are ignored
rather than failing the request). In the DSML format, where arguments are one tag per parameter,
each property gets its own tag: a "string" property's value is free text (or one of its enum
values), any other property's value follows its schema as JSON; properties come in the schema's
order, required ones must be present.

A marker that is a special token of the serving tokenizer must be referenced as a token, not as
text (llguidance never matches a special token's text): name those in `special_tokens`, e.g. the
tool tokens of a real DeepSeek tokenizer. Anything not named there is matched as plain text.
"""
from __future__ import annotations

import json
from typing import Collection, Optional, Union

from .reasoning import THINK_END
from .tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, DSML, DSML_CLOSE, DSML_OPEN, FORMATS,
                         TOOL_SEP, V3, V31)

# V3.2 names the DSML block function_calls, V4 tool_calls: the grammar offers both and the model
# picks the one it was trained on (the closing tag always matches the opening one)
_DSML_BLOCK_NAMES = ("function_calls", "tool_calls")
_JSON_FENCE = "```json"


def tool_call_grammar(fmt: str, tools: list, choice: Union[str, dict] = "required", parallel: bool = True, *,
                      reasoning: bool = False, special_tokens: Collection[str] = ()) -> str:
    """Lark grammar text forcing the output to be tool calls in `fmt` ("v3", "v31" or "dsml").

    tools: the request's OpenAI tools ([{"type": "function", "function": {"name", "parameters"}}]);
    choice: "required" (any of them) or {"type": "function", "function": {"name": NAME}} (that one);
    parallel: one or more calls (OpenAI's parallel_tool_calls), else exactly one;
    reasoning: the prompt opened a `<think>` block, so free reasoning text and `</think>` come first.
    ValueError for a format, tool or choice it cannot build a grammar for."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}: use one of {', '.join(FORMATS)}")
    functions = _chosen_functions(tools, choice)
    w = _Writer(special_tokens)
    prefix = ("reasoning " if reasoning else "") + "WS? calls"
    w.rule("start", prefix)
    w.rule("WS", r"/[ \t\r\n]{1,8}/")
    if reasoning:
        if THINK_END in w.special:
            w.rule("reasoning", f"REASONING {THINK_END}")
            w.rule("REASONING", "/(?s:.*)/")
        else:      # lazy: the reasoning ends at the first </think>
            w.rule("reasoning[lazy]", "/(?s:.*)" + _regex_text(THINK_END) + "/")
    {V3: _v3_calls, V31: _v31_calls, DSML: _dsml_calls}[fmt](w, functions, parallel)
    return w.text()


def _chosen_functions(tools: list, choice) -> list[tuple[str, dict]]:
    """[(name, parameters schema)] of the functions the choice allows."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool_choice needs a non-empty list of tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append((fn["name"], params or {"type": "object"}))
    if choice == "required":
        return functions
    named = choice.get("function") if isinstance(choice, dict) else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must be 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
                         f"not {choice!r}")
    chosen = [f for f in functions if f[0] == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    return chosen[:1]


class _Writer:
    """Collects rules; `lit` spells a marker as a special-token reference or as text."""

    def __init__(self, special_tokens: Collection[str]):
        self.special = set(special_tokens)
        self._lines = ["%llguidance {}"]
        self._names: set[str] = set()

    def rule(self, name: str, body: str) -> None:
        self._lines.append(f"{name}: {body}")
        self._names.add(name)

    def shared_rule(self, name: str, body: str) -> str:
        """A rule several functions use, written once."""
        if name not in self._names:
            self.rule(name, body)
        return name

    def lit(self, text: str) -> str:
        return text if text in self.special else json.dumps(text, ensure_ascii=False)

    def shared_json_rule(self, name: str, schema: dict) -> str:
        return name if name in self._names else self.json_rule(name, schema)

    def json_rule(self, name: str, schema: dict) -> str:
        # compact JSON, as the chat templates render arguments: flexible whitespace would let a weak model
        # spend its tokens on spaces and newlines between keys
        opts = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        self.rule(name, "%json " + json.dumps({**schema, "x-guidance": opts}, ensure_ascii=False))
        return name

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _regex_text(text: str) -> str:
    """`text` as a literal inside a /.../ regex."""
    return "".join("\\" + c if c in r"\/.^$|?*+()[]{}" else c for c in text)


def _repeat(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({separator} {item})*" if parallel else item


def _v3_calls(w: _Writer, functions, parallel: bool) -> None:
    """<calls▁begin> (<call▁begin>function<sep>NAME\\n```json\\nARGS\\n```<call▁end>) joined by "\\n" <calls▁end>"""
    calls = _repeat("call", w.lit("\n"), parallel)
    w.rule("calls", f"{w.lit(CALLS_BEGIN)} {calls} {w.lit(CALLS_END)}")
    w.rule("call", " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, (name, params) in enumerate(functions):
        head, tail = w.lit(name + "\n" + _JSON_FENCE + "\n"), w.lit("\n```")
        w.rule(f"call_{i}", f"{w.lit(CALL_BEGIN)} \"function\" {w.lit(TOOL_SEP)} {head} "
                            f"{w.json_rule(f'args_{i}', params)} {tail} {w.lit(CALL_END)}")


def _v31_calls(w: _Writer, functions, parallel: bool) -> None:
    """<calls▁begin> (<call▁begin>NAME<sep>ARGS<call▁end>)+ <calls▁end>"""
    w.rule("calls", f"{w.lit(CALLS_BEGIN)} {'call+' if parallel else 'call'} {w.lit(CALLS_END)}")
    w.rule("call", " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, (name, params) in enumerate(functions):
        w.rule(f"call_{i}", f"{w.lit(CALL_BEGIN)} {w.lit(name)} {w.lit(TOOL_SEP)} "
                            f"{w.json_rule(f'args_{i}', params)} {w.lit(CALL_END)}")


def _dsml_calls(w: _Writer, functions, parallel: bool) -> None:
    """<DSML>block\\n <DSML>invoke name="NAME">\\n (<DSML>parameter name=.. string=..>V</DSML>parameter>\\n)*
    </DSML>invoke> (joined by "\\n") \\n</DSML>block>; one newline where the encoders write one."""
    blocks = []
    for block in _DSML_BLOCK_NAMES:
        w.rule(f"block_{block}", f"{w.lit(DSML_OPEN + block + '>')} NL {_repeat('invoke', 'NL', parallel)} "
                                 f"NL {w.lit(DSML_CLOSE + block + '>')}")
        blocks.append(f"block_{block}")
    w.rule("calls", " | ".join(blocks))
    w.rule("NL", r"/\n/")     # one newline, as the encoders write: a weak model would spend its tokens on runs
    close_param = DSML_CLOSE + "parameter>"
    w.rule("string_value[lazy]", "/(?s:.*)" + _regex_text(close_param) + "/")
    w.rule("invoke", " | ".join(f"invoke_{i}" for i in range(len(functions))))
    for i, (name, params) in enumerate(functions):
        parts = [w.lit(f'{DSML_OPEN}invoke name="{name}">'), "NL", *_dsml_parameters(w, i, params),
                 w.lit(DSML_CLOSE + "invoke>")]
        w.rule(f"invoke_{i}", " ".join(parts))


def _dsml_parameters(w: _Writer, i: int, params: dict) -> list[str]:
    """The parameter items of function i's invoke, each followed by its newline."""
    properties = params.get("properties")
    close = w.lit(DSML_CLOSE + "parameter>")
    if not isinstance(properties, dict):        # a free-form object: any names, any values
        w.shared_json_rule("any_value", {})
        w.shared_rule("PARAM_NAME", r'/[^"<>\n]+/')
        name_open, as_text, as_json = w.lit(DSML_OPEN + 'parameter name="'), w.lit('" string="true">'), \
            w.lit('" string="false">')
        any_param = w.shared_rule("any_param", f"{name_open} PARAM_NAME "
                                               f"({as_text} string_value | {as_json} any_value {close})")
        return [f"({any_param} NL)*"]
    required = set(params.get("required") or ())
    close_param = DSML_CLOSE + "parameter>"
    items = []
    for j, (key, schema) in enumerate(properties.items()):
        schema = schema if isinstance(schema, dict) else {}
        is_string, strings = _string_values(schema)
        open_tag = f'{DSML_OPEN}parameter name="{key}" string="{"true" if is_string else "false"}">'
        if is_string and strings is not None:
            value = "(" + " | ".join(w.lit(s) for s in strings) + f") {close}"
        elif is_string and ("maxLength" in schema or "minLength" in schema):
            # raw text between the tags, its length bounded as the schema says
            lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
            span = f"{{{lo},{'' if hi is None else int(hi)}}}"
            value = w.shared_rule(f"string_{i}_{j}[lazy]", "/(?s:." + span + ")" + _regex_text(close_param) + "/")
            value = value.split("[")[0]
        elif is_string:
            value = "string_value"
        else:
            value = f"{w.json_rule(f'value_{i}_{j}', schema)} {close}"
        w.rule(f"param_{i}_{j}", f"{w.lit(open_tag)} {value}")
        items.append(f"param_{i}_{j} NL" if key in required else f"(param_{i}_{j} NL)?")
    return items


def _string_values(schema: dict) -> tuple[bool, Optional[list]]:
    """(written with string="true", the only values allowed or None for any text) for a property.
    A string property, or one whose enum / const are all strings, is written as text."""
    allowed = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
    if allowed is not None:
        if allowed and all(isinstance(v, str) for v in allowed):
            return True, list(allowed)
        return False, None
    return schema.get("type") == "string", None
