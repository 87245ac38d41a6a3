"""OpenAI request bodies (pydantic) for /v1/completions and /v1/chat/completions.

Parameters that the engine does not implement are accepted only at their neutral value (a penalty
of 0, echo false, best_of equal to n); any other value is a 400 that names the parameter, never a
silently different computation. Unknown fields are a 400 too."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)            # an extension (vLLM's): 0 or -1 is off
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    user: Optional[str] = None
    ignore_eos: bool = False                              # an extension (vLLM's), for benchmarks

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(parameter, message) for a value the engine would not honour."""
        if self.presence_penalty:
            return "presence_penalty", "presence_penalty is not supported (only 0)"
        if self.frequency_penalty:
            return "frequency_penalty", "frequency_penalty is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self):
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")       # name, tool_call_id...: passed to the template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None

    def unsupported(self):
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported for chat completions (use /v1/completions)"
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().unsupported()
