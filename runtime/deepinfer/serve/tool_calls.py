"""Tool calls in DeepSeek output, read as the text streams in, in the three formats the published
chat templates render (tests/data/chat_templates/PROVENANCE.md says where each comes from):

  "v3"    V3, V3-0324, R1, R1-0528: the arguments are a fenced JSON block
          <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
          further calls after "\\n", then <｜tool▁calls▁end｜>
  "v31"   V3.1, V3.1-Terminus, V3.2-Exp: name first, bare JSON arguments, no separator between calls
          <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  "dsml"  V3.2 and V4: DSML markup, one tag per parameter instead of JSON
          \\n\\n<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n
          <｜DSML｜parameter name="P" string="true">VALUE</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>
          V4 names the block `tool_calls`; both are read. string="true" makes VALUE a JSON string,
          anything else parses VALUE as JSON (and falls back to a JSON string if it is not JSON).

A parser turns text deltas into events: ContentDelta (text outside tool calls) and ToolCallDelta,
whose item is shaped like one entry of OpenAI's streamed `delta.tool_calls`: first
{"index", "id", "type": "function", "function": {"name", "arguments": ""}} once the name is whole,
then {"index", "function": {"arguments": more}} as the argument text arrives. For "v3" / "v31" the
arguments are the model's JSON text as written (trimmed); for "dsml" they are built from the
parameters (a string parameter streams as it arrives, any other parameter when its tag closes).

Malformed output never raises. Text that turns out not to be a tool call (no name, a name that is
not one, markup out of place) is given back as content, markers included, so nothing is lost. A
call cut off after its name keeps the arguments that arrived, complete JSON or not, as OpenAI's own
API does when finish_reason is "length".
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from .reasoning import partial_marker_len

V3, V31, DSML = "v3", "v31", "dsml"
FORMATS = (V3, V31, DSML)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
DSML_TOKEN = "｜DSML｜"
DSML_OPEN = "<" + DSML_TOKEN
DSML_CLOSE = "</" + DSML_TOKEN
DSML_BLOCKS = ("function_calls", "tool_calls", "calls")     # V3.2, V4, V4.1 (which writes `<｜DSML｜ calls>`)

MAX_NAME_CHARS = 256    # past this without the end of a name or tag, the text was not a tool call
_ATTR = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    item: dict          # one entry of OpenAI's streamed `delta.tool_calls`


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser:
    """Feed text deltas, get a list of events back for each; finish() flushes what is held back.

    Subclasses read one format: `_state` names the `_in_<state>` method that consumes what it can
    from `_buf` and says whether it got anywhere, and `_end_of_output` settles the state at the end."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._buf = ""          # received, not yet consumed
        self._raw = ""          # consumed markup of a call not yet known to be one: content if it is not
        self._events: list = []
        self._index = -1        # the latest call's index
        self._state = "content"

    def feed(self, delta: str) -> list:
        self._buf += delta
        while getattr(self, "_in_" + self._state)():
            pass
        return self._take()

    def finish(self) -> list:
        self._end_of_output()
        self._buf = self._raw = ""
        self._state = "content"
        return self._take()

    def _end_of_output(self) -> None:
        raise NotImplementedError

    # -- events

    def _take(self) -> list:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], ContentDelta):
            text = self._events.pop().text + text
        self._events.append(ContentDelta(text))

    def _open_call(self, name: str) -> None:
        self._index += 1
        self._raw = ""
        self._events.append(ToolCallDelta({"index": self._index, "id": self._new_id(), "type": "function",
                                           "function": {"name": name, "arguments": ""}}))

    def _arguments(self, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and "id" not in last.item and last.item["index"] == self._index:
            text = self._events.pop().item["function"]["arguments"] + text
        self._events.append(ToolCallDelta({"index": self._index, "function": {"arguments": text}}))

    # -- the buffer

    def _release(self, n: int) -> str:
        """The first n characters of the buffer, consumed."""
        text, self._buf = self._buf[:n], self._buf[n:]
        return text

    def _take_raw(self, n: int) -> None:
        self._raw += self._release(n)

    def _skip_space(self, into_raw: bool) -> None:
        n = len(self._buf) - len(self._buf.lstrip())
        if into_raw:
            self._take_raw(n)
        else:
            self._release(n)

    def _not_a_call(self) -> bool:
        """What was read as the start of a call is not one: it is content after all."""
        self._content(self._raw)
        self._raw = ""
        self._state = "content"
        return True


def _earliest(text: str, markers) -> tuple[int, Optional[str]]:
    found = [(p, m) for m in markers if (p := text.find(m)) >= 0]
    return min(found) if found else (-1, None)


def _plausible_name(name: str) -> bool:
    return 0 < len(name) <= MAX_NAME_CHARS and not any(c in name for c in "<>｜ \t\r\n")


class _SpecialTokenParser(ToolParser):
    """"v3" and "v31": calls delimited by DeepSeek's tool special tokens; they differ in a call's head."""

    _ARGS_END = (CALL_END, CALL_BEGIN, CALLS_END)    # a call missing its end token ends at the next one

    def __init__(self, fmt: str, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._fenced = fmt == V3
        self._trailing = " \t\r\n`" if self._fenced else " \t\r\n"     # trimmed from the end of the arguments
        self._args_started = False

    def _in_content(self) -> bool:
        starts = (CALLS_BEGIN, CALL_BEGIN)
        pos, marker = _earliest(self._buf, starts)
        if marker is None:
            self._content(self._release(len(self._buf) - partial_marker_len(self._buf, starts)))
            return False
        self._content(self._release(pos))
        self._take_raw(len(marker))
        self._state = "block" if marker == CALLS_BEGIN else "head"
        return True

    def _in_block(self) -> bool:
        """Between calls: the next call, or the end of the block."""
        self._skip_space(into_raw=True)
        for marker, state in ((CALL_BEGIN, "head"), (CALLS_END, "content")):
            if self._buf.startswith(marker):
                self._take_raw(len(marker))
                if state == "content":
                    self._raw = ""      # a closed block is markup, not content
                self._state = state
                return True
            if marker.startswith(self._buf):
                return False
        return self._not_a_call()

    def _in_head(self) -> bool:
        """`function<｜tool▁sep｜>NAME\\n` ("v3") or `NAME<｜tool▁sep｜>` ("v31")."""
        sep = self._buf.find(TOOL_SEP)
        if sep < 0:
            return self._not_a_call() if len(self._buf) > MAX_NAME_CHARS else False
        if self._fenced:
            line_end = self._buf.find("\n", sep + len(TOOL_SEP))
            if line_end < 0:
                return self._not_a_call() if len(self._buf) - sep > MAX_NAME_CHARS + len(TOOL_SEP) else False
            kind, name, used = self._buf[:sep].strip(), self._buf[sep + len(TOOL_SEP):line_end].strip(), line_end + 1
            if not _plausible_name(kind):
                return self._not_a_call()
        else:
            name, used = self._buf[:sep].strip(), sep + len(TOOL_SEP)
        if not _plausible_name(name):
            return self._not_a_call()
        self._release(used)
        self._open_call(name)
        self._state = "fence" if self._fenced else "args"
        return True

    def _in_fence(self) -> bool:
        """The "```json" line before "v3" arguments (left out by some outputs)."""
        head = self._buf.lstrip()
        if not head or (head != "```json" and "```json".startswith(head)):
            return False
        fence = next((f for f in ("```json", "```") if head.startswith(f)), "")
        self._release(len(self._buf) - len(head) + len(fence))
        self._state = "args"
        return True

    def _in_args(self) -> bool:
        pos, marker = _earliest(self._buf, self._ARGS_END)
        if marker is None:
            # hold back a possible end token, and the whitespace and fence that may precede one
            held = partial_marker_len(self._buf, self._ARGS_END)
            body = self._buf[:len(self._buf) - held].rstrip(self._trailing)
            self._stream_arguments(self._release(len(body)))
            return False
        self._stream_arguments(self._release(pos).rstrip(self._trailing))
        if marker == CALL_END:
            self._release(len(CALL_END))
        self._args_started = False
        self._state = "block"
        return True

    def _stream_arguments(self, text: str) -> None:
        if not self._args_started:
            text = text.lstrip()
            self._args_started = bool(text)
        self._arguments(text)

    def _end_of_output(self) -> None:
        if self._state in ("fence", "args"):    # all that is held is markup (a partial end token, a fence)
            self._args_started = False
            return
        if self._state != "content":
            self._not_a_call()
        self._content(self._buf)


class _DsmlParser(ToolParser):
    """"dsml": V3.2 / V4 markup; the arguments object is built from the parameter tags."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        super().__init__(new_id)
        self._params = 0            # parameters of the open call so far
        self._string = False        # the open parameter's value is a string (string="true")
        self._value = ""            # a non-string value, kept until its tag closes

    def _in_content(self) -> bool:
        pos = self._buf.find(DSML_OPEN)
        if pos < 0:
            held = partial_marker_len(self._buf, (DSML_OPEN,))
            # newlines are held too: the block is written after "\n\n", which is not content
            self._content(self._release(len(self._buf[:len(self._buf) - held].rstrip("\n"))))
            return False
        text = self._buf[:pos].rstrip("\n")
        self._content(self._release(len(text)))
        self._take_raw(pos - len(text))
        self._state = "block_tag"
        return True

    def _in_block_tag(self) -> bool:
        tag = _read_tag(self._buf)
        if tag is None:
            return False
        if tag and not tag.closing and tag.name in DSML_BLOCKS:
            self._take_raw(tag.length)
            self._state = "block"
            return True
        self._take_raw(len(DSML_OPEN))
        return self._not_a_call()

    def _in_block(self) -> bool:
        """Between invokes: the next one, or the end of the block."""
        self._skip_space(into_raw=True)
        tag = _read_tag(self._buf) if self._buf else None
        if tag is None:
            return False
        if tag:
            if not tag.closing and tag.name == "invoke" and _plausible_name(tag.attrs.get("name", "")):
                self._release(tag.length)
                self._open_call(tag.attrs["name"])
                self._params = 0
                self._state = "invoke"
                return True
            if tag.closing and tag.name in DSML_BLOCKS:
                self._release(tag.length)
                self._raw = ""
                self._state = "content"
                return True
        return self._not_a_call()

    def _in_invoke(self) -> bool:
        """Inside an invoke: the next parameter, or the end of the call."""
        self._skip_space(into_raw=False)
        tag = _read_tag(self._buf) if self._buf else None
        if tag is None:
            return False
        if tag and not tag.closing and tag.name == "parameter" and "name" in tag.attrs:
            self._release(tag.length)
            self._string = tag.attrs.get("string") == "true"
            key = json.dumps(tag.attrs["name"], ensure_ascii=False)
            self._arguments(("{" if self._params == 0 else ", ") + key + ": " + ('"' if self._string else ""))
            self._params += 1
            self._value = ""
            self._state = "param"
            return True
        self._arguments("}" if self._params else "{}")
        if tag and tag.closing and tag.name == "invoke":
            self._release(tag.length)
        self._state = "block"       # anything else: the call ends here, and the block reads what follows
        return True

    def _in_param(self) -> bool:
        pos = self._buf.find(DSML_CLOSE)
        if pos < 0:
            self._value_text(self._release(len(self._buf) - partial_marker_len(self._buf, (DSML_CLOSE,))))
            return False
        self._value_text(self._release(pos))
        tag = _read_tag(self._buf)
        if tag is None:
            return False
        if tag and tag.closing and tag.name == "parameter":
            self._release(tag.length)
        if self._string:
            self._arguments('"')
        else:
            value = self._value.strip()
            self._arguments(value if _is_json(value) else json.dumps(value, ensure_ascii=False))
        self._state = "invoke"      # a missing close tag ends the value too; the invoke reads the tag
        return True

    def _value_text(self, text: str) -> None:
        if self._string:
            self._arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value += text

    def _end_of_output(self) -> None:
        if self._state == "param":      # all that is held is the start of a closing tag: markup, dropped
            self._arguments("" if self._string else self._value)
        elif self._state in ("block_tag", "block"):
            self._not_a_call()
        if self._state == "content":
            self._content(self._buf)


class _Tag(NamedTuple):
    length: int         # characters, "<" to ">"
    closing: bool
    name: str           # invoke, parameter, function_calls, ...
    attrs: dict


def _read_tag(text: str):
    """The DSML tag `text` starts with (a _Tag); None while it may still become one; False if it
    cannot. A name may follow the DSML token after a space (V4.1's `<｜DSML｜ invoke`)."""
    if text.startswith(DSML_CLOSE):
        prefix, closing = DSML_CLOSE, True
    elif text.startswith(DSML_OPEN):
        prefix, closing = DSML_OPEN, False
    elif DSML_OPEN.startswith(text) or DSML_CLOSE.startswith(text):
        return None
    else:
        return False
    end = text.find(">", len(prefix))
    if end < 0:
        return None if len(text) <= MAX_NAME_CHARS else False
    inner = text[len(prefix):end]
    words = inner.split(None, 1)
    return _Tag(end + 1, closing, words[0] if words else "", dict(_ATTR.findall(inner)))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def make_tool_parser(fmt: str, new_id: Callable[[], str] = new_call_id) -> ToolParser:
    """A fresh streaming parser for one output in `fmt` ("v3", "v31" or "dsml")."""
    if fmt in (V3, V31):
        return _SpecialTokenParser(fmt, new_id)
    if fmt == DSML:
        return _DsmlParser(new_id)
    raise ValueError(f"unknown tool-call format {fmt!r}: use one of {', '.join(FORMATS)}")


def collect_events(events) -> tuple[str, list[dict]]:
    """(content, tool calls) that a list of events adds up to; each call as OpenAI's message.tool_calls
    has it: {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""
    content, calls = [], {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
            continue
        item = event.item
        if "id" in item:
            calls[item["index"]] = {"id": item["id"], "type": "function",
                                    "function": {"name": item["function"]["name"], "arguments": ""}}
        calls[item["index"]]["function"]["arguments"] += item["function"].get("arguments", "")
    return "".join(content), [calls[i] for i in sorted(calls)]


def parse_tool_calls(fmt: str, text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str, list[dict]]:
    """(content, tool calls) of a whole output: the streaming parser fed all of it at once, so the two
    can never disagree."""
    parser = make_tool_parser(fmt, new_id)
    return collect_events(parser.feed(text) + parser.finish())


def detect_tool_format(chat_template_source: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template renders, from the markers in its source; None if it has none.
    V3.2 and V4 releases that ship an encoder instead of a template have no source to look at:
    name the format ("dsml") yourself for those."""
    if not chat_template_source:
        return None
    if DSML_TOKEN in chat_template_source:
        return DSML
    if TOOL_SEP in chat_template_source or CALL_BEGIN in chat_template_source:
        # R1 / V3 put NAME in a fenced JSON line after "function<｜tool▁sep｜>"; V3.1 has no fence
        return V3 if "```json" in chat_template_source else V31
    return None
