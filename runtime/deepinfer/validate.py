"""Checks of values a user hands us (engine config, sampling options, CLI arguments): the exact type
and range or an InputError that names the value, what it got and what it takes.

Python's own coercions are what these guard against: `True` is an int, `int(256.7)` is 256,
`bool("no")` is True and NaN compares false with everything, so a plain `int(v)` or `v <= 0` test
lets wrong values through as different, silently wrong ones.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from .errors import ConfigError, InputError

MAX_JSON_BYTES = 64 << 20      # larger than any config, index or tokenizer config we read


def integer(name: str, v, lo: Optional[int] = None, hi: Optional[int] = None, *, err=ConfigError) -> int:
    """`v` itself when it is an int (not a bool) in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise err(f"{name} must be an integer, not {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise err(f"{name} must be {_range(lo, hi)}, not {v}")
    return v


def optional_integer(name: str, v, lo: Optional[int] = None, hi: Optional[int] = None, *, err=ConfigError):
    return None if v is None else integer(name, v, lo, hi, err=err)


def number(name: str, v, lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False,
           err=ConfigError) -> float:
    """`v` as a float when it is a finite int or float (not a bool) in [lo, hi] ((lo, hi] with lo_open)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise err(f"{name} must be a number, not {_show(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise err(f"{name} must be a finite number, not {v}")
    if (lo is not None and (f <= lo if lo_open else f < lo)) or (hi is not None and f > hi):
        where = f"in {'(' if lo_open else '['}{lo}, {hi}]" if lo is not None and hi is not None else _range(lo, hi)
        raise err(f"{name} must be {where}, not {v}")
    return f


def boolean(name: str, v, *, err=ConfigError) -> bool:
    if not isinstance(v, bool):
        raise err(f"{name} must be true or false, not {_show(v)}")
    return v


def text(name: str, v, *, err=ConfigError) -> str:
    """A non-empty str that encodes as UTF-8 (a lone surrogate from undecodable bytes does not)."""
    if not isinstance(v, str):
        raise err(f"{name} must be a string, not {_show(v)}")
    if not v.strip():
        raise err(f"{name} must not be empty")
    utf8(name, v, err=err)
    return v


def utf8(name: str, s: str, *, err=InputError) -> str:
    """`s` unchanged if it is valid Unicode text. Python turns undecodable bytes of argv and files
    into lone surrogates (surrogateescape); a tokenizer cannot encode those."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        what = (f"the byte 0x{ord(bad) - 0xDC00:02x} (not valid UTF-8)" if 0xDC80 <= ord(bad) <= 0xDCFF
                else f"a lone surrogate U+{ord(bad):04X}")
        raise err(f"{name} holds {what} at character {e.start}; give text encoded as UTF-8") from None
    return s


def read_json(path, what: str, *, err=InputError, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value of a file, or `err` saying why it cannot be read: missing, a directory,
    unreadable, too large, not UTF-8, not JSON, or nested too deeply for the parser."""
    p = Path(path)
    try:
        if p.is_dir():
            raise err(f"{what} {p} is a directory, not a JSON file")
        size = p.stat().st_size
        if size > max_bytes:
            raise err(f"{what} {p} is {size} bytes, more than the {max_bytes} a JSON file of this kind may hold")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise err(f"{what} {p} not found") from None
    except OSError as e:
        raise err(f"{what} {p} cannot be read: {e.strerror or e}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise err(f"{what} {p} is not UTF-8 text (byte {e.start}); is it the right file?") from None
    except json.JSONDecodeError as e:
        raise err(f"{what} {p} is not valid JSON: {e}") from None
    except RecursionError:
        raise err(f"{what} {p} nests JSON too deeply to parse") from None


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    if lo is not None:
        return {0: "non-negative", 1: "positive"}.get(lo, f">= {lo}") if isinstance(lo, int) else f">= {lo}"
    return f"<= {hi}"


def _show(v) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"
