"""Anthropic's tools and thinking on /v1/messages: the request's tools, tool_choice and thinking as the
OpenAI-shaped values the chat template and serve.chat_output take, conversation blocks (tool_use,
tool_result, thinking) as chat messages, and the reply's content blocks (thinking, text, tool_use)
built whole or streamed as Anthropic's content_block_* events."""
from __future__ import annotations

import json
import uuid
from typing import Optional

from .api_errors import APIError


def openai_tools(tools: Optional[list]) -> Optional[list]:
    """Anthropic tools ({name, description, input_schema}) as OpenAI function tools for the template."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools.{i} must be an object with a name", param=f"tools.{i}")
        if t.get("type") not in (None, "custom"):
            raise APIError(400, f"tools.{i}: server tools ({t.get('type')!r}) are not supported; give client tools "
                                "(name, description, input_schema)", param=f"tools.{i}.type")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise APIError(400, f"tools.{i}.input_schema must be a JSON schema object", param=f"tools.{i}.input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def openai_tool_choice(choice: Optional[dict], tools: Optional[list]) -> tuple:
    """(OpenAI tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return ("auto" if tools else "none"), True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        names = [t["function"]["name"] for t in tools or ()]
        if choice.get("name") not in names:
            raise APIError(400, f"tool_choice names tool {choice.get('name')!r}, which is not in tools", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}", param="tool_choice.type")


def thinking_kwargs(thinking: Optional[dict]) -> dict:
    """The template variable of Anthropic's thinking switch (DeepSeek's templates read `thinking`)."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise APIError(400, f"thinking.type must be enabled or disabled, not {kind!r}", param="thinking.type")
    return {"thinking": kind == "enabled"}


def chat_messages(role: str, content, param: str, text_of) -> list:
    """One Anthropic message as chat messages: tool_result blocks become `tool` messages (first, as the
    templates expect them right after the call), tool_use blocks the assistant's tool_calls, thinking
    blocks of earlier turns are dropped (DeepSeek's templates drop earlier reasoning too), the rest is
    text (text_of checks those blocks)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out, rest, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}.{j}"
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        if kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": _str(block, "tool_use_id", where),
                        "content": _result_text(block.get("content", ""), where)})
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": _str(block, "id", where), "type": "function",
                          "function": {"name": _str(block, "name", where),
                                       "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        else:
            rest.append(block)
    text = text_of(rest, param) if rest else ""
    if calls:
        out.append({"role": "assistant", "content": text, "tool_calls": calls})
    elif rest or not out:
        out.append({"role": role, "content": text})
    return out


def _str(block: dict, key: str, where: str) -> str:
    v = block.get(key)
    if not isinstance(v, str) or not v:
        raise APIError(400, f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return v


def _result_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise APIError(400, f"{where}.content: a tool_result holds a string or text blocks", param=f"{where}.content")


def _input(arguments: str):
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw_arguments": arguments}     # a call cut off by max_tokens: its text as it stands


class ReplyBlocks:
    """The reply's content blocks from serve.chat_output deltas: `add(delta)` returns the stream
    events (name, data) it makes, `finish()` the last ones; `blocks` the whole content."""

    def __init__(self):
        self.blocks: list = []
        self._kind: Optional[str] = None     # the open block's type
        self._args: dict = {}                # tool call index -> its block's position
        self._ws = ""                        # whitespace held back outside a text block
        self.used_tools = False

    def _open(self, kind: str, block: dict) -> list:
        ev = self._close()
        self.blocks.append(block)
        self._kind = kind
        start = dict(block)
        if kind == "tool_use":
            start["input"] = {}
        elif kind == "thinking":
            start.update(thinking="", signature="")
        elif kind == "text":
            start["text"] = ""
        return ev + [("content_block_start", {"index": len(self.blocks) - 1, "content_block": start})]

    def _close(self) -> list:
        if self._kind is None:
            return []
        i, ev = len(self.blocks) - 1, []
        b = self.blocks[i]
        if self._kind == "thinking":
            ev.append(("content_block_delta", {"index": i, "delta": {"type": "signature_delta", "signature": ""}}))
        if self._kind == "tool_use":
            b["input"] = _input(b.pop("_arguments", ""))
        self._kind = None
        return ev + [("content_block_stop", {"index": i})]

    def add(self, delta: dict) -> list:
        ev = []
        if delta.get("reasoning_content"):
            if self._kind != "thinking":
                ev += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += delta["reasoning_content"]
            ev.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                               "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}}))
        text = delta.get("content")
        if text:
            if self._kind != "text" and not (self._ws + text).strip():
                self._ws += text                     # whitespace: a text block only if text follows
            else:
                if self._kind != "text":
                    ev += self._open("text", {"type": "text", "text": ""})
                    text, self._ws = self._ws + text, ""
                self.blocks[-1]["text"] += text
                ev.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                   "delta": {"type": "text_delta", "text": text}}))
        for item in delta.get("tool_calls", ()):
            self.used_tools = True
            if "id" in item:
                self._ws = ""                            # whitespace before a call is no text
                ev += self._open("tool_use", {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                                              "name": item["function"]["name"], "input": {}, "_arguments": ""})
                self._args[item["index"]] = len(self.blocks) - 1
            piece = item["function"].get("arguments", "")
            if piece:
                pos = self._args[item["index"]]
                self.blocks[pos]["_arguments"] += piece
                ev.append(("content_block_delta", {"index": pos,
                                                   "delta": {"type": "input_json_delta", "partial_json": piece}}))
        return ev

    def finish(self) -> list:
        ev = self._close()
        if not self.blocks:                          # an empty reply still has its (empty) text block
            ev = self._open("text", {"type": "text", "text": ""})
            if self._ws:
                self.blocks[-1]["text"] = self._ws
                ev.append(("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": self._ws}}))
            ev += self._close()
        return ev
