"""Where backend libraries are found, in order: paths given explicitly, DEEPINFER_BACKEND_PATH
(files or folders, separated by os.pathsep), the entry-point group `deepinfer.backends` (each entry
point is a callable that returns a path or a list of paths), and the libraries bundled with this
package. Finding runs no library code."""
from __future__ import annotations

import importlib.metadata
import logging
import os
import sysconfig
from pathlib import Path
from typing import Optional

log = logging.getLogger("deepinfer")

ENV_PATH = "DEEPINFER_BACKEND_PATH"
ENTRY_POINT_GROUP = "deepinfer.backends"
LIB_GLOB = "libdeepinfer_*.so"


def bundled_lib_dirs() -> list[Path]:
    """Where an installed deepinfer keeps its own libraries (editable or regular install)."""
    here = Path(__file__).resolve().parent
    dirs = [here / "lib", Path(sysconfig.get_paths()["platlib"]) / "deepinfer" / "lib"]
    # a source checkout built with plain CMake (cmake -S . -B build)
    dirs += [here.parents[1] / "build" / "lib"]
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def _expand(p: str | os.PathLike) -> list[Path]:
    p = Path(p).expanduser()
    if p.is_dir():
        return sorted(p.glob(LIB_GLOB))
    return [p]


def discover(explicit: Optional[list] = None) -> list[tuple[Path, str]]:
    found: list[tuple[Path, str]] = []
    for p in explicit or []:
        found += [(x, "explicit") for x in _expand(p)]
    for p in filter(None, os.environ.get(ENV_PATH, "").split(os.pathsep)):
        found += [(x, "env") for x in _expand(p)]
    try:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                res = ep.load()()
                for p in ([res] if isinstance(res, (str, os.PathLike)) else list(res)):
                    found += [(x, "entry-point") for x in _expand(p)]
            except Exception as e:  # a broken third-party package must not break discovery
                log.warning("entry point %s failed: %s", ep.name, e)
    except Exception:
        pass
    for d in bundled_lib_dirs():
        found += [(x, "bundled") for x in sorted(d.glob(LIB_GLOB))]
    # the same file reached twice is one candidate (first source wins)
    seen, unique = set(), []
    for p, src in found:
        key = str(p.resolve()) if p.exists() else str(p)
        if key not in seen:
            seen.add(key)
            unique.append((p, src))
    return unique


def is_bundled(path: Path) -> bool:
    """Whether `path` is one of this package's own libraries (probed in this process: trusted)."""
    return path.resolve().parent in {d.resolve() for d in bundled_lib_dirs()}
