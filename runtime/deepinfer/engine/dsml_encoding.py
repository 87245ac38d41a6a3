"""The prompt text of a DeepSeek-V3.2 or V4 chat. Those releases ship no Jinja chat template, only a
Python reference encoder (encoding/encoding_dsv32.py and encoding_dsv4.py in their Hugging Face repos);
this module renders what those render. V3.2's is checked against the release's own test output
(tests/data/chat_templates/deepseek-v3.2-encoding-test_*); V4's follows the encoder as vLLM vendors it
(tests/data/chat_templates/deepseek-v4.md).

Both put the tools in the system prompt and write tool calls in DSML markup (serve.tool_calls' "dsml"):

  v32  <｜DSML｜function_calls>...; tool results follow the call as
       <function_results><result>R</result>...</function_results>, then the thinking switch
  v4   <｜DSML｜tool_calls>...; tool results are <tool_result>R</tool_result> parts of the next user turn

A user turn ends with the opening of the assistant's: <｜Assistant｜> and <think> (thinking mode, the
turn being answered) or </think> (chat mode, or an earlier turn, whose reasoning is not shown again).
"""
from __future__ import annotations

import json
from typing import Optional

from ..errors import ConfigError, InputTypeError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
REMINDER = "<｜latest_reminder｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
VERSIONS = ("v32", "v4")
CALLS_BLOCK = {"v32": "function_calls", "v4": "tool_calls"}
# The markers these prompts and replies hold, for code that learns a chat format from its template's text.
MARKERS = " ".join((THINK_START, THINK_END, f"<{DSML}function_calls>", f"<{DSML}tool_calls>"))

_ROLES = {"v32": ("system", "developer", "user", "assistant", "tool"),
          "v4": ("system", "developer", "user", "assistant", "tool", "latest_reminder")}

# The tools preambles are DeepSeek's prompt text, character for character (the model was trained on it).
_V32_TOOLS_HEAD = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{DSML}function_calls>
...
</{DSML}function_calls>

<function_results>
...
</function_results>

{THINK_START}...thinking about results{THINK_END}

Here are the functions available in JSONSchema format:
<functions>
"""
_V32_TOOLS_TAIL = "\n</functions>\n"

_V4_TOOLS_HEAD = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
_V4_TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
_TOOLS_TEXT = {"v32": (_V32_TOOLS_HEAD, _V32_TOOLS_TAIL), "v4": (_V4_TOOLS_HEAD, _V4_TOOLS_TAIL)}

_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
_V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


def encode_messages(messages: list, tools: Optional[list] = None, thinking: bool = False,
                    add_generation_prompt: bool = True, bos_token: str = BOS, version: str = "v32",
                    reasoning_effort: Optional[str] = None) -> str:
    """The prompt DeepSeek's `version` encoder writes for OpenAI-shaped `messages` (roles system,
    developer, user, assistant with optional `tool_calls` and `reasoning_content` / `reasoning`, tool)
    and OpenAI `tools`, which join the leading system message (one is made if there is none), as the
    V3.2 release's own test attaches them.

    thinking: thinking mode ("thinking") or chat mode ("chat"). add_generation_prompt=False leaves off
    the assistant opening that the reference writes after a final user turn or tool results (it has
    no such switch). reasoning_effort: V4 only; "max" adds DeepSeek's maximum-effort preamble, any
    other value changes nothing. ConfigError / InputTypeError for messages of the wrong shape."""
    if version not in VERSIONS:
        raise ConfigError(f"DSML encoder version {version!r} is unknown; use one of {', '.join(VERSIONS)}")
    msgs = [_normalized(i, m, version) for i, m in enumerate(_as_list(messages, "messages"))]
    if not msgs:
        raise ConfigError("messages is empty: give at least one {'role': ..., 'content': ...} message")
    tools = _tool_functions(tools) if tools else []
    if tools and msgs[0]["role"] == "system":
        msgs[0] = {**msgs[0], "tools": msgs[0]["tools"] + tools}
    elif tools:
        msgs.insert(0, _normalized(0, {"role": "system", "content": ""}, version) | {"tools": tools})
    if version == "v32":
        turns = _v32_turns(msgs, thinking)
        prefix = ""
    else:
        turns = _v4_turns(msgs, thinking)
        prefix = _V4_MAX_EFFORT if thinking and reasoning_effort == "max" else ""
    text = "".join(body + opener for body, opener in turns[:-1])
    body, opener = turns[-1]
    return bos_token + prefix + text + body + (opener if add_generation_prompt else "")


# ------------------------------------------------------------------------------------------- V3.2
def _v32_turns(msgs: list, thinking: bool) -> list:
    """(text, opening written after it) for each message."""
    last_user = _last_user(msgs)
    out = []
    for i, m in enumerate(msgs):
        role, content = m["role"], m["content"]
        # thinking mode opens a reasoning block only for what answers the last user turn
        switch = THINK_START if thinking and i >= last_user else THINK_END
        if role == "system":
            out.append((content + _system_extras(m, "v32"), ""))
        elif role == "developer":
            text = _system_extras(m, "v32") + "\n\n# The user's message is: " + content
            out.append((USER + text, ASSISTANT + switch))
        elif role == "user":
            out.append((USER + content, ASSISTANT + switch))
        elif role == "tool":
            order, calls = _result_order(msgs, i)
            text = ("\n\n<function_results>" if order == 1 else "") + f"\n<result>{content}</result>"
            if order < calls:
                out.append((text, ""))
            else:
                out.append((text + "\n</function_results>", "\n\n" + switch))
        else:
            reasoning = m["reasoning"] + THINK_END if thinking and i > last_user else ""
            out.append((reasoning + content + _calls_block(m["calls"], "v32") + EOS, ""))
    return out


def _result_order(msgs: list, i: int) -> tuple[int, int]:
    """(which result of its assistant's calls tool message `i` is, counting from 1; how many calls)."""
    start = i
    while start > 0 and msgs[start - 1]["role"] == "tool":
        start -= 1
    calls = msgs[start - 1]["calls"] if start > 0 and msgs[start - 1]["role"] == "assistant" else []
    if i - start + 1 > len(calls):
        raise ConfigError(f"messages[{msgs[i]['index']}]: a tool message answers one of the tool_calls of the "
                          f"assistant message before it, and there are only {len(calls)} of those for "
                          f"{i - start + 1} tool messages")
    return i - start + 1, len(calls)


# --------------------------------------------------------------------------------------------- V4
def _v4_turns(msgs: list, thinking: bool) -> list:
    turns = _v4_user_turns(msgs)
    # earlier turns' reasoning is dropped, except in a conversation with tools, which keeps all of it
    drop = thinking and not any(m["tools"] for m in msgs)
    if drop:
        turns = _v4_without_old_reasoning(turns)
    last_user = _last_user(turns)
    out = []
    for i, t in enumerate(turns):
        role = t["role"]
        if role == "system":
            text = t["content"] + _system_extras(t, "v4")
        elif role == "developer":
            text = USER + t["content"] + _system_extras(t, "v4")
        elif role == "user":
            text = USER + "\n\n".join(t["parts"])
        elif role == "latest_reminder":
            text = REMINDER + t["content"]
        else:
            shown = thinking and (not drop or i > last_user)
            reasoning = t["reasoning"] + THINK_END if shown else ""
            text = reasoning + t["content"] + _calls_block(t["calls"], "v4") + EOS
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        opener = ""
        if role in ("user", "developer") and following in (None, "assistant", "latest_reminder"):
            opens = thinking and (not drop or i >= last_user)
            opener = ASSISTANT + (THINK_START if opens else THINK_END)
        out.append((text, opener))
    return out


def _v4_user_turns(msgs: list) -> list:
    """V4 has no tool role: consecutive user and tool messages become one user turn of parts, the tool
    results as <tool_result> blocks in the order of the calls they answer."""
    turns, order = [], {}
    for m in msgs:
        if m["role"] == "assistant" and m["calls"]:
            order = {call_id: n for n, (_, _, call_id) in enumerate(m["calls"]) if call_id}
        if m["role"] not in ("user", "tool"):
            turns.append(m)
            continue
        if not turns or turns[-1]["role"] != "user":
            turns.append({"role": "user", "parts": [], "results": [], "order": order})
        turns[-1]["parts"].append(m["content"] if m["role"] == "user" else None)     # None: a result's slot
        if m["role"] == "tool":
            turns[-1]["results"].append(m)
    for t in turns:
        if t["role"] == "user":
            # stable: results with an unknown call id keep their place among themselves, as in the reference
            results = iter(sorted(t["results"], key=lambda r: t["order"].get(r["tool_call_id"], 0)))
            t["parts"] = [p if p is not None else f"<tool_result>{next(results)['content']}</tool_result>"
                          for p in t["parts"]]
    return turns


def _v4_without_old_reasoning(turns: list) -> list:
    """Before the last user turn: assistant turns lose their reasoning, developer turns go."""
    last_user = _last_user(turns)
    kept = []
    for i, t in enumerate(turns):
        if i >= last_user or t["role"] in ("system", "user", "latest_reminder"):
            kept.append(t)
        elif t["role"] == "assistant":
            kept.append({**t, "reasoning": ""})
    return kept


# ----------------------------------------------------------------------------------------- shared
def _last_user(msgs: list) -> int:
    return max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)


def _system_extras(m: dict, version: str) -> str:
    """The tools and response-format sections a system (or developer) message carries."""
    text = ""
    if m["tools"]:
        head, tail = _TOOLS_TEXT[version]
        text += "\n\n" + head + "\n".join(_json(t) for t in m["tools"]) + tail
    if m["response_format"] is not None:
        text += "\n\n" + _RESPONSE_FORMAT + _json(m["response_format"])
    return text


def _calls_block(calls: list, version: str) -> str:
    if not calls:
        return ""
    block = CALLS_BLOCK[version]
    invokes = "\n".join(f'<{DSML}invoke name="{name}">\n{_parameters(args)}\n</{DSML}invoke>'
                        for name, args, _ in calls)
    return f"\n\n<{DSML}{block}>\n{invokes}\n</{DSML}{block}>"


def _parameters(args: dict) -> str:
    """One tag per argument: a string as is (string="true"), anything else as JSON."""
    return "\n".join(f'<{DSML}parameter name="{k}" string="true">{v}</{DSML}parameter>' if isinstance(v, str)
                     else f'<{DSML}parameter name="{k}" string="false">{_json(v)}</{DSML}parameter>'
                     for k, v in args.items())


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------------------------ input checks
def _as_list(value, what: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise InputTypeError(f"{what} must be a list, not {type(value).__name__}")
    return list(value)


def _normalized(i: int, m, version: str) -> dict:
    """Message `i` with every field the renderers read, checked."""
    if not isinstance(m, dict):
        raise InputTypeError(f"messages[{i}] must be a dict with 'role' and 'content', not {type(m).__name__}")
    role = m.get("role")
    if role not in _ROLES[version]:
        raise ConfigError(f"messages[{i}]: role {role!r} is not one DeepSeek's {version} encoder knows "
                          f"({', '.join(_ROLES[version])})")
    out = {"index": i, "role": role}
    for key, field in (("content", "content"), ("reasoning", "reasoning"), ("tool_call_id", "tool_call_id")):
        out[key] = _text(i, m, field)
    out["reasoning"] = out["reasoning"] or _text(i, m, "reasoning_content")
    if role == "developer" and not out["content"]:
        raise ConfigError(f"messages[{i}]: a developer message needs content")
    out["calls"] = _calls(i, m.get("tool_calls")) if role == "assistant" else []
    out["tools"] = _tool_functions(m["tools"], f"messages[{i}]['tools']") if m.get("tools") else []
    out["response_format"] = m.get("response_format")
    return out


def _text(i: int, m: dict, key: str) -> str:
    value = m.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputTypeError(f"messages[{i}]['{key}'] must be a string, not {type(value).__name__}")
    return value


def _calls(i: int, tool_calls) -> list:
    """[(name, arguments object, id)] of an assistant message's OpenAI tool_calls."""
    out = []
    for n, call in enumerate(_as_list(tool_calls or [], f"messages[{i}]['tool_calls']")):
        where = f"messages[{i}]['tool_calls'][{n}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = {"arguments": args}      # as V4's reference encoder does with text that is not JSON
        if not isinstance(args, dict):
            raise ConfigError(f"{where}['function']['arguments'] must be a JSON object, not {type(args).__name__}")
        out.append((fn["name"], args, call.get("id") or ""))
    return out


def _tool_functions(tools, what: str = "tools") -> list:
    """The function objects of OpenAI tools ({"type": "function", "function": {...}}), or of bare ones."""
    out = []
    for n, tool in enumerate(_as_list(tools, what)):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(f"{what}[{n}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        out.append(fn)
    return out
