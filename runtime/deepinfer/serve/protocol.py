"""OpenAI request bodies (pydantic) for /v1/completions and /v1/chat/completions, with vLLM's
extensions (top_k, repetition_penalty, min_tokens, ignore_eos, priority, structured_outputs and the
legacy guided_* fields).

Types are strict: "0.5" is not a number and "true" not a bool (an int where a float belongs is
fine), so a client's typo is a 400 naming the field, never a guess. Parameters the engine does not
implement are accepted only at their neutral value (echo false, best_of equal to n); any
other value is a 400 that names the parameter, never a silently different computation. Unknown
fields are a 400 too."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

# strict: no "8" for 8 or "true" for true; no NaN or Infinity (JSON has neither, Python's parser does)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema member, in OpenAI's shape."""
    model_config = ConfigDict(**STRICT, populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")      # no schema: any JSON value
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one constraint on the output."""
    model_config = STRICT
    json_: Union[dict, str, None] = Field(None, alias="json")   # a JSON schema, or its text
    regex: Optional[str] = None
    grammar: Optional[str] = None                               # an EBNF / GBNF grammar
    choice: Optional[list[str]] = None
    json_object: Optional[bool] = None


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict] = None          # a JSON schema; none: no arguments
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: _FunctionName


class ThinkingSwitch(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled"]


class _Sampling(BaseModel):
    model_config = STRICT

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)            # an extension (vLLM's): 0 or -1 is off
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)   # vLLM's: 1 is off
    logit_bias: Optional[dict[str, float]] = None        # {token id (as JSON keys are, a string): bias}
    min_tokens: int = Field(0, ge=0)                      # vLLM's: no eos or stop before this many tokens
    user: Optional[str] = None
    ignore_eos: bool = False                              # an extension (vLLM's), for benchmarks
    priority: int = 0                                     # vLLM's: lower is served first
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Union[dict, str, None] = None           # vLLM's legacy names of structured_outputs' members
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        # OpenAI's fields are nullable and clients send {"n": null, "stop": null, ...}: null is the default
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(parameter, message) for a value the engine would not honour."""
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
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)   # name, tool_call_id...: passed to the template
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
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict] = None          # vLLM's: variables for the chat template
    thinking: Union[bool, ThinkingSwitch, None] = None   # DeepSeek V4's thinking switch
    reasoning_effort: Optional[Literal["low", "medium", "high", "max"]] = None

    def unsupported(self):
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        return super().unsupported()

    def template_kwargs(self) -> dict:
        """The chat template's extra variables: chat_template_kwargs, with the thinking switch and the
        reasoning effort under the names DeepSeek's templates read (V3.1's `thinking`)."""
        kw = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kw["thinking"] = self.thinking if isinstance(self.thinking, bool) else self.thinking.type == "enabled"
        if self.reasoning_effort is not None:
            kw["reasoning_effort"] = self.reasoning_effort
        return kw

    def tools_json(self) -> Optional[list]:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_json(self):
        tc = self.tool_choice
        if tc is None:
            return "auto" if self.tools else "none"
        return tc if isinstance(tc, str) else tc.model_dump()
