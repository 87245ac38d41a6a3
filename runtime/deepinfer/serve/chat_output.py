"""What a chat choice's text becomes in OpenAI's response: `reasoning_content` (a reasoning model's
`<think>` block, serve.reasoning), `content`, and `tool_calls` (the model's tool-call markup in its
family's format, serve.tool_calls), split incrementally so a stream's deltas carry each as it arrives.

ChatPlan is decided once per request from the rendered prompt and the model's chat template: whether
the output starts inside reasoning, which tool-call format to read, and the structured-output
constraint that a `tool_choice` of "required" or a named function imposes (serve.tool_grammar).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .api_errors import APIError
from .reasoning import THINK_END, THINK_START, ReasoningParser, prompt_opens_reasoning
from .tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, DSML_TOKEN, TOOL_SEP, ContentDelta,
                         detect_tool_format, make_tool_parser)
from .tool_grammar import tool_call_grammar

_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)


@dataclass
class ChatPlan:
    reasoning: bool                 # the template knows <think>: split reasoning_content out
    starts_in_reasoning: bool       # the prompt opened <think>: the output begins as reasoning
    tool_format: Optional[str]      # the format to parse tool calls in (None: no tools in play)
    structured: Optional[dict]      # SamplingParams.structured the tool choice forces, or None
    keep_special: bool              # detokenize with special tokens (the tool markers may be special)


def special_markers(tokenizer) -> list:
    """The tool-call and reasoning markers that are added tokens of this tokenizer. llguidance treats
    every added token as a special token that text never matches, so a grammar must name these as
    tokens; the ones the tokenizer marks special only show in the text with skip_special_tokens off."""
    try:
        added = {t.content for t in tokenizer._tok.get_added_tokens_decoder().values()}
    except AttributeError:
        return []
    return [m for m in (*_MARKERS, THINK_START, THINK_END) if m in added] + sorted(t for t in added if DSML_TOKEN in t)


def plan_chat(tokenizer, prompt: str, tools: Optional[list], tool_choice, parallel: bool) -> ChatPlan:
    template = tokenizer.chat_markers or ""
    reasoning = THINK_END in template or THINK_START in template
    opens = reasoning and prompt_opens_reasoning(prompt)
    fmt, structured = None, None
    use_tools = bool(tools) and tool_choice != "none"
    if use_tools:
        fmt = detect_tool_format(template)
        if fmt is None:
            raise APIError(400, "this model's chat template renders no tool calls (no DeepSeek tool-call markers "
                                "in it), so tools cannot be used with it", param="tools")
        if tool_choice in ("required",) or isinstance(tool_choice, dict):
            split = [t for t in special_markers(tokenizer) if DSML_TOKEN in t and t.startswith(DSML_TOKEN)]
            if fmt == "dsml" and split:
                # llguidance never matches an added token's text, and DSML's tags hold this one inside
                # text (`<｜DSML｜invoke name=...>`): the grammar would admit no output at all
                raise APIError(400, f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'naming a function'} "
                                    f"cannot be forced with this tokenizer (its added token {split[0]!r} sits inside "
                                    "the DSML tags); use tool_choice auto", param="tool_choice")
            try:
                grammar = tool_call_grammar(fmt, tools, tool_choice, parallel, reasoning=opens,
                                            special_tokens=special_markers(tokenizer))
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from None
            structured = {"type": "grammar", "grammar": grammar}
    return ChatPlan(reasoning, opens, fmt, structured, keep_special=use_tools)


class ChatOutput:
    """One choice's output, fed its text deltas: each feed returns the OpenAI delta fields it adds
    (reasoning_content, content, tool_calls); finish() the rest, and whether any call was made."""

    def __init__(self, plan: ChatPlan):
        self.reasoner = ReasoningParser(starts_in_reasoning=plan.starts_in_reasoning) if plan.reasoning else None
        self.tools = make_tool_parser(plan.tool_format) if plan.tool_format else None
        self.called = False

    def feed(self, text: str) -> dict:
        return self._split(*(self.reasoner.feed(text) if self.reasoner else ("", text)), final=False)

    def finish(self) -> dict:
        r, c = self.reasoner.finish() if self.reasoner else ("", "")
        return self._split(r, c, final=True)

    def _split(self, reasoning: str, content: str, final: bool) -> dict:
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.tools is None:
            if content:
                out["content"] = content
            return out
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = [e.item for e in events if not isinstance(e, ContentDelta)]
        if text:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
            self.called = True
        return out


def merge(whole: dict, delta: dict) -> None:
    """Adds a delta's fields into a whole message (non-streaming responses)."""
    for k in ("reasoning_content", "content"):
        if k in delta:
            whole[k] = whole.get(k, "") + delta[k]
    for item in delta.get("tool_calls", ()):
        calls = whole.setdefault("tool_calls", [])
        if "id" in item:
            calls.append({"id": item["id"], "type": "function",
                          "function": {"name": item["function"]["name"], "arguments": ""}})
        calls[item["index"]]["function"]["arguments"] += item["function"].get("arguments", "")
