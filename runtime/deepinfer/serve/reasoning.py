"""Reasoning ("thinking") text in DeepSeek output, split from the answer as it streams.

R1 and the thinking modes of V3.1 / V3.2 / V4 write their reasoning as `<think>...</think>` before
the answer. Where the chat template already put `<think>` at the end of the prompt (R1's later
templates, V3.1 with `thinking=True`, V3.2 / V4 thinking mode) the output starts inside the
reasoning and only `</think>` appears in it; older R1 templates leave `<think>` to the model.
Both are handled: `starts_in_reasoning` says which (see prompt_opens_reasoning), and a `<think>`
the model writes at the very start is dropped either way.

The split is lossless: every character of the output is in the reasoning, in the content, or is
one of the two tags. Text is never trimmed, so `"<think>\\nA\\n</think>\\n\\nB"` gives reasoning
"\\nA\\n" and content "\\n\\nB". A `<think>` later in the answer is content, not a new reasoning block.
"""
from __future__ import annotations

from typing import Iterable, Optional

THINK_START = "<think>"
THINK_END = "</think>"

_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is the start (not all) of one of `markers`:
    the characters a streaming parser must hold back until the next delta says what they are."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReasoningParser:
    """Feed the model's text deltas; get (reasoning_delta, content_delta) back for each.

    A tag split across deltas is held back until it is whole, so no delta ever shows part of
    `<think>` or `</think>`. finish() releases what is held: an output that never closed its
    reasoning (cut off by max_tokens, say) ends all reasoning."""

    def __init__(self, start: str = THINK_START, end: str = THINK_END, starts_in_reasoning: bool = False):
        if not start or not end:
            raise ValueError("the reasoning start and end tags must be non-empty strings")
        self.start, self.end = start, end
        self._state = _INSIDE if starts_in_reasoning else _BEFORE
        self._at_start = True       # a model may write the start tag itself, even after a prompt that has it
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    @property
    def in_reasoning(self) -> bool:
        return self._state == _INSIDE

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        if self._at_start:
            opened = self._drop_start_tag(final)
            if opened is None:                  # still a possible prefix of the start tag
                return "", ""
            self._at_start = False
            if self._state == _BEFORE:
                self._state = _INSIDE if opened else _AFTER
        if self._state == _INSIDE:
            pos = self._buf.find(self.end)
            if pos >= 0:
                reasoning.append(self._buf[:pos])
                self._buf = self._buf[pos + len(self.end):]
                self._state = _AFTER
            else:
                keep = 0 if final else partial_marker_len(self._buf, (self.end,))
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
        if self._state == _AFTER:
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def _drop_start_tag(self, final: bool) -> Optional[bool]:
        """At the very start of the output: True (and the tag dropped, with any whitespace before
        it) if it opens with the start tag, False if it does not, None while it cannot tell yet."""
        head = self._buf.lstrip()
        if head.startswith(self.start):
            self._buf = head[len(self.start):]
            return True
        if not final and self.start.startswith(head):
            return None
        return False


def split_reasoning(text: str, starts_in_reasoning: bool = False,
                    start: str = THINK_START, end: str = THINK_END) -> tuple[Optional[str], str]:
    """(reasoning, content) of a whole output; reasoning is None when there is none (or it is empty)."""
    parser = ReasoningParser(start, end, starts_in_reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2) or None, c1 + c2


def prompt_opens_reasoning(prompt_text: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Does the rendered prompt end inside an unclosed start tag (so the output begins as reasoning)?
    True for R1's `...<｜Assistant｜><think>\\n` and V3.1's thinking mode; False for V3.1's
    `...<｜Assistant｜></think>` chat mode and for prompts with no tags at all."""
    opened = prompt_text.rfind(start)
    return opened >= 0 and opened > prompt_text.rfind(end)
