"""Checks of values a user hands us (engine config, sampling options, CLI arguments): the exact type
and range or an InputError that names the value, what it got and what it takes.

Python's own coercions are what these guard against: `True` is an int, `int(256.7)` is 256,
`bool("no")` is True and NaN compares false with everything, so a plain `int(v)` or `v <= 0` test
lets wrong values through as different, silently wrong ones.
"""
from __future__ import annotations

import json
import math
import os
import stat
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
    try:
        f = float(v)
    except OverflowError:       # an int too large for a float (JSON allows 400-digit numbers)
        f = math.inf
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


def read_json(path, what: str, *, err=InputError, fix: str = "", max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in the file `path` (`what`: "config.json", "the engine config", ...), or `err`
    saying why it cannot be had, ending with `fix` (what to do): the file is missing, not a regular
    file (a directory fails to read, a pipe would block), unreadable, too large, not UTF-8, not
    JSON, nested too deeply for the parser, or holds an integer too long to convert."""
    p = Path(path)
    tail = f"; {fix}" if fix else ""
    try:
        info = p.stat()
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise err(f"{p}: is {kind}, not the {what} file{tail}")
        if info.st_size > max_bytes:
            raise err(f"{p}: {info.st_size} bytes is far too large for {what}{tail}")
        raw = p.read_bytes()
    except FileNotFoundError:
        if p.is_symlink():
            raise err(f"{p}: cannot read {what}: it links to {os.readlink(p)}, which does not exist{tail}") from None
        raise err(f"{p}: {what} not found{tail}") from None
    except OSError as e:
        raise err(f"{p}: cannot read {what} ({e.strerror or e}){tail}") from None
    return parse_json(raw, str(p), err=err, fix=fix)


def parse_json(raw: bytes, where: str, *, err=InputError, fix: str = ""):
    """json.loads of `raw` with every way it fails as `err` naming `where`."""
    tail = f"; {fix}" if fix else ""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise err(f"{where}: not UTF-8 text (byte {e.start} is {raw[e.start:e.start + 1]!r}){tail}") from None
    except RecursionError:
        raise err(f"{where}: JSON nested too deeply{tail}") from None
    except ValueError as e:      # JSONDecodeError, or an integer of more digits than Python converts
        raise err(f"{where}: not valid JSON ({e}){tail}") from None


def read_text_file(path, what: str, *, err=InputError) -> str:
    """The text of a file a user pointed us at (`what`: "--text", "the calibration file"): refused
    with the reason when it is missing, a directory, unreadable, binary, not UTF-8 or empty."""
    p = Path(path)
    if p.is_dir():
        raise err(f"{what} {p} is a directory; give a text file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise err(f"{what} {p}: no such file") from None
    except OSError as e:
        raise err(f"{what} {p} cannot be read: {e.strerror or e}") from None
    if b"\0" in raw:
        raise err(f"{what} {p} is a binary file (it holds NUL bytes); give a text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise err(f"{what} {p} is not UTF-8 text (byte {e.start}); give a UTF-8 text file") from None
    if not text.strip():
        raise err(f"{what} {p} is empty; give a file with text in it")
    return text


def json_kind(v) -> str:
    """What a JSON value is, in words: "an object", "a list", "a decimal number", "null"..."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a decimal number", type(None): "null"}.get(type(v), type(v).__name__)


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    if lo is not None:
        return {0: "non-negative", 1: "positive"}.get(lo, f">= {lo}") if isinstance(lo, int) else f">= {lo}"
    return f"<= {hi}"


def _show(v) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"
