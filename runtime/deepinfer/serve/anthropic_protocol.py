"""Anthropic Messages request bodies (pydantic) for /v1/messages and /v1/messages/count_tokens, and
their conversation as the chat messages the model's template renders.

Text content blocks (string content is one), a system prompt as a string or text blocks, a last
assistant message as the start of the reply (Anthropic's prefill), tools with tool_use / tool_result
blocks, and thinking (serve.anthropic_blocks). Images and documents are a 400 that says they are not
supported, never dropped. Types are strict and unknown fields a 400, as on the OpenAI routes."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from .anthropic_blocks import chat_messages, openai_tool_choice, openai_tools, thinking_kwargs
from .api_errors import APIError
from .protocol import STRICT

# block keys a text block may carry; cache_control is a caching hint, which the prefix cache makes
# moot (a repeated prompt prefix is computed once anyway), so it is accepted and has no effect;
# citations come back when a client sends a reply's blocks again, and are empty here
_TEXT_KEYS = {"type", "text", "cache_control", "citations"}


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str
    cache_control: Optional[dict] = None


class Metadata(BaseModel):
    model_config = STRICT
    user_id: Optional[str] = None


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: Union[str, list[dict]]      # blocks are checked by hand: an unsupported type gets its own message


class _Conversation(BaseModel):
    model_config = STRICT
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    cache_control: Optional[dict] = None        # the top-level caching hint: no effect, as on blocks
    tools: Optional[list] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None

    def tool_setup(self) -> tuple:
        """(OpenAI tools for the template or None, tool_choice, parallel_tool_calls, template kwargs)."""
        tools = openai_tools(self.tools)
        choice, parallel = openai_tool_choice(self.tool_choice, tools)
        if choice != "none" and choice != "auto" and not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return (tools if choice != "none" else None), choice, parallel, thinking_kwargs(self.thinking)

    def chat(self) -> tuple[list, str]:
        """(chat messages for the template, the reply's prefill: a last assistant message's text or "")."""
        out = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            out += chat_messages(m.role, m.content, f"messages.{i}.content", _text)
        prefill = ""
        if self.messages[-1].role == "assistant":
            if out[-1].get("tool_calls"):
                raise APIError(400, "the last message calls tools: give their tool_result blocks in a user message",
                               param=f"messages.{len(self.messages) - 1}.content")
            prefill = out.pop()["content"]
            if prefill != prefill.rstrip():
                raise APIError(400, "final assistant content cannot end with trailing whitespace",
                               param=f"messages.{len(self.messages) - 1}.content")
        return out, prefill


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)                 # 0: off
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None   # one tier here: every request is standard
    stream: bool = False


class CountTokensRequest(_Conversation):
    pass


def _text(content, param: str) -> str:
    """The text of a message's content: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = block.get("type")
        if kind in ("tool_use", "tool_result", "server_tool_use", "thinking", "redacted_thinking"):
            raise APIError(400, f"a {kind} block cannot stand in a message of this role", param=where)
        if kind != "text":
            raise APIError(400, f"content blocks of type {kind!r} are not supported yet on /v1/messages (only text)",
                           param=where)
        extra = set(block) - _TEXT_KEYS
        if extra:
            raise APIError(400, f"{where}: unknown field(s) {', '.join(sorted(extra))} of a text block", param=where)
        if block.get("citations"):
            raise APIError(400, "citations are not supported on /v1/messages", param=where + ".citations")
        if not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}.text must be a string", param=where + ".text")
        parts.append(block["text"])
    return "".join(parts)
