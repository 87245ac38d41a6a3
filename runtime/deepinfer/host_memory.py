"""How much host memory there is: /proc/meminfo, read where a budget is chosen (the precision choice,
the expert cache's host copies) and where a host backend reports its memory."""
from __future__ import annotations

from typing import Optional

MEMINFO = "/proc/meminfo"


def read_meminfo(keys, path: str = MEMINFO) -> dict:
    """{key: bytes} of the /proc/meminfo lines named in `keys` (MemAvailable, MemTotal, ...): the
    ones that could be read, none where the file cannot be."""
    found = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def meminfo_available(path: str = MEMINFO) -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    return read_meminfo(("MemAvailable",), path).get("MemAvailable")
