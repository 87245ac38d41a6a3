"""Chat templates (jinja2, from tokenizer_config.json) rendered in a sandbox that bounds what a
template may cost.

jinja2's ImmutableSandboxedEnvironment keeps a template away from Python's internals, but not from
memory or time: `{{ 'a' * 10**9 }}` allocates a gigabyte and three nested loops over range(10**5)
run for days. So here:
  - every operation that can make a value much larger than its operands (`*`, `**`, `+`, `%`, `~`,
    str's center/ljust/rjust/zfill/expandtabs/replace/join/translate/format, the filters center,
    indent, format, join, replace, wordwrap, batch, slice, tojson) predicts the size of its result
    and refuses one over RenderLimits.max_chars before building it, and everything a render builds
    counts against a total of BUILT_FACTOR times that;
  - anything that would be printed (an output, a filter's argument, a `~` operand) is measured
    first: a list of ten copies of a list of ten copies... is small until str() walks it;
  - each loop iteration, call, operator, filter and output is a step against max_steps and checks
    a deadline, and range() is capped at max_range;
  - the prompt is collected piece by piece and refused once it passes max_chars.
Every failure while rendering (these limits, the sandbox's refusals, undefined names, runaway
recursion, the template's own raise_exception) is a ConfigError naming the template line.

The guards find the limits of the render under way through a ContextVar, so one compiled template
serves concurrent renders. jinja2's optimizer may call guarded filters on constants at compile time:
with no render under way they raise, and jinja2 then leaves those calls to run time.
"""
from __future__ import annotations

import functools
import re
import time
import traceback
from contextvars import ContextVar
from dataclasses import dataclass
from string import Formatter
from typing import Iterable, Optional

from jinja2 import nodes, pass_environment, pass_eval_context
from jinja2 import filters as jinja_filters
from jinja2.environment import Environment
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from ..errors import CheckpointError, ConfigError

BUILT_FACTOR = 32           # all values one render builds, in units of max_chars
MAX_INT_BITS = 1 << 14      # ~4900 digits: Python itself refuses to print ints past 4300 digits


@dataclass(frozen=True)
class RenderLimits:
    """What one render may cost."""

    max_chars: int = 2_000_000      # the prompt, and any one value built on the way (characters or items)
    max_steps: int = 1_000_000      # loop iterations, calls, operators, filters and outputs
    max_seconds: float = 10.0
    max_range: int = 10_000         # items of one range() (jinja2's own cap is 100000)


class _Budget:
    """The cost of one render so far."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.steps = 0
        self.built = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise ConfigError(f"more than {self.limits.max_steps} steps (loop iterations, calls, operations): "
                              "fix the template's loops or render with a larger RenderLimits.max_steps")
        if time.monotonic() > self.deadline:
            raise ConfigError(f"still rendering after {self.limits.max_seconds} s: fix the template's loops "
                              "or render with a larger RenderLimits.max_seconds")

    def fits(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise ConfigError(f"{what} would be {size} characters long, over the limit of {self.limits.max_chars}: "
                              "fix the template or render with a larger RenderLimits.max_chars")

    def build(self, size: int, what: str) -> None:
        """A step that makes a value of `size` characters (or items), refused before it exists."""
        self.step()
        self.fits(size, what)
        self.built += size
        if self.built > BUILT_FACTOR * self.limits.max_chars:
            raise ConfigError(f"the template built more than {BUILT_FACTOR * self.limits.max_chars} characters "
                              "in all: fix the template or render with a larger RenderLimits.max_chars")

    def collect(self, pieces) -> str:
        out, n = [], 0
        for piece in pieces:
            n += len(piece)
            if n > self.limits.max_chars:
                raise ConfigError(f"the prompt passed {self.limits.max_chars} characters: shorten the "
                                  "conversation or render with a larger RenderLimits.max_chars")
            out.append(piece)
        return "".join(out)


_RENDER: ContextVar[_Budget] = ContextVar("chat_template_render")


def _budget() -> _Budget:
    return _RENDER.get()    # LookupError at compile time: jinja2 leaves the call to run time


_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def _children(value) -> Optional[Iterable]:
    """What str() of `value` prints inside it; None for a leaf."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, Namespace):
        return _children(value._Namespace__attrs)
    if isinstance(value, (list, tuple, set, frozenset, range) + _VIEWS):
        return value
    return None


def _size(value, indent: int = 0) -> int:
    """About the characters of str(value), or of its JSON with this indent: a string's length, an
    int's digits, a container's items plus separators, each shared item counted as often as it
    appears (printing repeats it), and with an indent each item's indentation. Linear in the
    distinct objects however often they are shared."""
    if isinstance(value, str):
        return len(value)
    memo: dict = {}

    def walk(v, depth: int) -> int:
        if isinstance(v, str):
            return len(v) + 4
        if isinstance(v, int):
            return v.bit_length() // 3 + 1
        items = _children(v)
        if items is None:
            return 8
        key = (id(v), depth if indent else 0)
        if key not in memo:
            memo[key] = 0       # a cycle (no template can build one) counts once
            memo[key] = 2 + sum(walk(i, depth + 1) + 2 + indent * (depth + 1) for i in items)
        return memo[key]

    return walk(value, 0)


def _formatted_size(literal: int, fields: int, widths: list, values: list) -> int:
    """A format string's text plus, per field, the largest value padded to the widest width; a
    width taken from the arguments ('*' or a nested '{}') may be any int among them."""
    sizes = [int(w) for w in widths if w.isdigit()]
    if any(w in ("*", "{") for w in widths):
        sizes += [abs(v) for v in values if isinstance(v, int)]
    return literal + fields * (max(map(_size, values), default=0) + max(sizes, default=0))


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|[0-9]*)(?:\.(\*|[0-9]*))?[hlL]?[a-zA-Z%]")


def _printf_size(fmt: str, args) -> int:
    """What `fmt % args` may take."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    specs = _PRINTF.findall(fmt)
    return _formatted_size(len(fmt), len(specs), [w for spec in specs for w in spec], values)


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """What fmt.format(*args, **kwargs) may take."""
    specs = [spec or "" for _, field, spec, _ in Formatter().parse(fmt) if field is not None]
    widths = [w for spec in specs for w in re.findall(r"[0-9]+|\{", spec)]
    return _formatted_size(len(fmt), len(specs), widths, [*args, *kwargs.values()])


def _replace_size(s: str, old: str, new: str, count: int) -> int:
    found = s.count(old)
    return len(s) + (found if count < 0 else min(found, count)) * max(len(new) - len(old), 0)


def _int_bits(op: str, left, right) -> int:
    """Bits of an int result of * or ** (0 for anything else)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if op == "*":
        return left.bit_length() + right.bit_length()
    if op == "**" and right > 0 and abs(left) > 1:
        return left.bit_length() * right
    return 0


def _binop_size(op: str, left, right) -> Optional[int]:
    """The size of `left op right` where it can be much larger than its operands, else None."""
    if op == "%" and isinstance(left, str):
        return _printf_size(left, right)
    sequences = (str, list, tuple)
    if op == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return _size(left) + _size(right)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sequences) and isinstance(n, int):
                return _size(seq) * max(n, 0)
    return None


# str methods whose result can be much longer than the string: its predicted length
_STR_RESULT_SIZE = {
    "center": lambda s, width, *fill: max(len(s), width),
    "ljust": lambda s, width, *fill: max(len(s), width),
    "rjust": lambda s, width, *fill: max(len(s), width),
    "zfill": lambda s, width: max(len(s), width),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(tabsize, 0),
    "replace": lambda s, old, new, count=-1: _replace_size(s, old, new, count),
    "join": lambda s, items: len(s) * max(len(items) - 1, 0) + sum(map(_size, items)),
    "translate": lambda s, table: len(s) * max(_size(table), 1),
}


def _str_method(obj) -> Optional[str]:
    """The name of a method bound to a str (a Markup's too), else None."""
    return obj.__name__ if isinstance(getattr(obj, "__self__", None), str) else None


# filters that can make a value much larger than their arguments, each checking its result's size

def _center(value, width=80):
    _budget().build(max(_size(value), width), "the center filter's result")
    return jinja_filters.do_center(value, width)


def _indent(s, width=4, first=False, blank=False):
    pad = len(width) if isinstance(width, str) else width
    _budget().build(_size(s) + (len(str(s).splitlines()) + 1) * max(pad, 0), "the indent filter's result")
    return jinja_filters.do_indent(s, width, first, blank)


def _format(value, *args, **kwargs):
    _budget().build(_printf_size(str(value), kwargs or args), "the format filter's result")
    return jinja_filters.do_format(value, *args, **kwargs)


@pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    items = list(value)
    _budget().build(_size(d) * max(len(items) - 1, 0) + sum(map(_size, items)), "the join filter's result")
    return jinja_filters.sync_do_join(eval_ctx, items, d, attribute)


@pass_eval_context
def _replace(eval_ctx, s, old, new, count=None):
    _budget().build(_replace_size(str(s), str(old), str(new), -1 if count is None else count),
                    "the replace filter's result")
    return jinja_filters.do_replace(eval_ctx, s, old, new, count)


@pass_environment
def _wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    newline = environment.newline_sequence if wrapstring is None else wrapstring
    _budget().build(_size(s) * (1 + len(newline)), "the wordwrap filter's result")
    return jinja_filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def _batch(value, linecount, fill_with=None):
    _budget().build(linecount, "one batch of the batch filter")
    return jinja_filters.do_batch(value, linecount, fill_with)


def _slice(value, slices, fill_with=None):
    _budget().build(slices, "the slice filter's list of slices")
    return jinja_filters.do_slice(value, slices, fill_with)


@pass_eval_context
def _tojson(eval_ctx, value, indent=None):
    width = len(indent) if isinstance(indent, str) else indent or 0
    _budget().build(_size(value, width), "the tojson filter's result")
    return jinja_filters.do_tojson(eval_ctx, value, indent)


_SIZED_FILTERS = {"center": _center, "indent": _indent, "format": _format, "join": _join, "replace": _replace,
                  "wordwrap": _wordwrap, "batch": _batch, "slice": _slice, "tojson": _tojson}
# debugging and HTML helpers no chat template needs, whose output is hard to bound
_DROPPED_FILTERS = ("pprint", "urlize")


def _checked(name: str, f):
    """Filter `f`, made a step that first measures its arguments (jinja2's own context arguments aside)."""
    @functools.wraps(f)     # keeps jinja_pass_arg: how jinja2 knows what to pass it
    def run(*args, **kwargs):
        budget = _budget()
        budget.step()
        for a in (*args, *kwargs.values()):
            if not isinstance(a, (Context, EvalContext, Environment)):
                budget.fits(_size(a), f"an argument of the {name} filter")
        return f(*args, **kwargs)

    return run


def _each_step(iterable):
    """A for loop's items, each a step (loops are the one construct jinja2 runs without a call)."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _concat(parts: tuple) -> str:
    """`a ~ b`, measured before it is built."""
    _budget().build(sum(map(_size, parts)), "the result of '~'")
    return "".join(map(str, parts))


def _finalize(value):
    budget = _budget()
    budget.step()
    budget.fits(_size(value), "an output")
    return value


def _range(*args) -> range:
    r = range(*args)
    limit = _budget().limits.max_range
    if len(r) > limit:
        raise ConfigError(f"range() of {len(r)} items, over the limit of {limit}: fix the template "
                          "or render with a larger RenderLimits.max_range")
    return r


def _raise_exception(message):
    raise ConfigError(f"the template refused these messages: {message}")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with size-checked operators, calls, filters, outputs and block joins."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_finalize)
        self.globals.update(range=_range, raise_exception=_raise_exception)
        del self.globals["lipsum"]      # lorem ipsum of any length; no template needs it
        table = {**self.filters, **_SIZED_FILTERS}
        self.filters = {name: _checked(name, f) for name, f in table.items() if name not in _DROPPED_FILTERS}
        self.filters.update(_each_step=_each_step, _concat=_concat)     # what _Guard inserts

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        bits = _int_bits(operator, left, right)
        if bits > MAX_INT_BITS:
            raise ConfigError(f"'{operator}' would make an int of {bits} bits, over the limit of {MAX_INT_BITS}: "
                              "fix the template")
        size = _binop_size(operator, left, right)
        if size is None:
            budget.step()
        else:
            budget.build(size, f"the result of '{operator}'")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja2's signature)
        budget = _budget()
        method = _str_method(__obj)
        if method == "join" and args:
            args = (list(args[0]),) + args[1:]      # measured, then joined
        if method in _STR_RESULT_SIZE:
            budget.build(_STR_RESULT_SIZE[method](__obj.__self__, *args, **kwargs), f"the result of str.{method}")
        else:
            budget.step()
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, name = value.__self__, value.__name__

        def checked(*args, **kwargs):
            if name == "format_map":
                _budget().build(_format_size(fmt, (), dict(*args)), "the result of str.format_map")
            else:
                _budget().build(_format_size(fmt, args, kwargs), "the result of str.format")
            return wrapper(*args, **kwargs)

        return checked

    def unsafe_undefined(self, obj, attribute):
        """Refuse at once: jinja2's default, an undefined value, prints as "" and hides the refusal."""
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")

    def concat(self, pieces) -> str:
        """Joins the output of a macro, a {% set %} block or a {% filter %} block."""
        pieces = list(pieces)
        _budget().build(sum(map(len, pieces)), "a block's output")
        return "".join(pieces)


class _Guard(NodeTransformer):
    """Rewrites a parsed template so every for loop's items are steps and every `~` is measured:
    jinja2 compiles neither through the environment."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_each_step", [], [], None, None, lineno=node.iter.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return nodes.Filter(nodes.Tuple(node.nodes, "load", lineno=node.lineno), "_concat", [], [], None, None,
                            lineno=node.lineno)


_SANDBOX = _BoundedSandbox()


class ChatTemplate:
    """A chat template compiled once; render() may run in several threads at once."""

    def __init__(self, source: str, origin: str):
        """CheckpointError (naming `origin` and the line) for a template that does not compile."""
        try:
            tree = _Guard().visit(_SANDBOX.parse(source))
            tree.set_environment(_SANDBOX)
            self._template = _SANDBOX.from_string(tree)
        except TemplateSyntaxError as e:
            raise CheckpointError(f"{origin}: chat_template line {e.lineno}: {e.message}; "
                                  "fix the template's jinja2 syntax") from None
        except RecursionError:
            raise CheckpointError(f"{origin}: chat_template is nested too deeply to compile; "
                                  "simplify the template") from None

    def render(self, limits: RenderLimits, **variables) -> str:
        """The template's text for these variables; ConfigError if it fails or passes `limits`."""
        budget = _Budget(limits)
        token = _RENDER.set(budget)
        try:
            return budget.collect(self._template.generate(**variables))
        except Exception as e:      # whatever a template does wrong, it is this input's error
            raise ConfigError(_explain(e)) from None
        finally:
            _RENDER.reset(token)


def _explain(e: Exception) -> str:
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
    where = f"chat template line {lines[-1]}" if lines else "chat template"
    if isinstance(e, ConfigError):
        return f"{where}: {e}"
    if isinstance(e, SecurityError):
        return f"{where}: the sandbox refused an unsafe operation ({e}); fix the template"
    if isinstance(e, UndefinedError):
        return f"{where}: {e}; the template expects something these messages or variables lack"
    if isinstance(e, RecursionError):
        return f"{where}: recursion too deep (a macro that calls itself without end?); fix the template"
    return f"{where}: {type(e).__name__}: {e}; fix the template or the messages"
