"""Anthropic Messages request bodies (pydantic) for /v1/messages and /v1/messages/count_tokens, and
their conversation as the chat messages the model's template renders.

Text is all this server takes: text content blocks (string content is one), a system prompt as a
string or text blocks, and a last assistant message as the start of the reply (Anthropic's
prefill). Tools, images, documents and thinking are a 400 that says they are not supported yet,
never dropped. Types are strict and unknown fields a 400, as on the OpenAI routes."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

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

    def check_supported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are not supported yet on /v1/messages", param="tools")
        if self.tool_choice is not None:
            raise APIError(400, "tool_choice is not supported yet on /v1/messages (no tools)", param="tool_choice")
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise APIError(400, "thinking is not supported yet on /v1/messages", param="thinking")

    def chat(self) -> tuple[list, str]:
        """(chat messages for the template, the reply's prefill: a last assistant message's text or "")."""
        out = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            out.append({"role": m.role, "content": _text(m.content, f"messages.{i}.content")})
        prefill = ""
        if self.messages[-1].role == "assistant":
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
        if kind in ("tool_use", "tool_result", "server_tool_use"):
            raise APIError(400, f"{kind} blocks are not supported yet on /v1/messages (tools are not supported yet)",
                           param=where)
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
