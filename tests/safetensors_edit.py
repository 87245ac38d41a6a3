"""Editing a safetensors file's header in place, for tests that damage checkpoints on purpose."""
from __future__ import annotations

import json
import struct


def split(path) -> tuple[dict, bytes]:
    """(the header as a dict, the data bytes after it)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write(path, header_text: bytes, body: bytes) -> None:
    """A file of this raw header text (padded to 8 bytes, as safetensors writes it) and data."""
    header_text += b" " * (-len(header_text) % 8)
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + body)


def edit(path, fn) -> None:
    """fn(header) changes the header dict in place; the data stays as it is."""
    header, body = split(path)
    fn(header)
    write(path, json.dumps(header).encode(), body)
