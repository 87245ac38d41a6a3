"""The probe verdict cache: probe-cache.json under DEEPINFER_CACHE_DIR, else
$XDG_CACHE_HOME/deepinfer, else ~/.cache/deepinfer. A verdict is keyed by the library file's path,
size, mtime and sha256, the deepinfer version, the host and the DEEPINFER_* settings it was made
under, so each library file costs one probe child once. An unwritable or corrupt cache is ignored."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from ._probe_child import PROBE_TIMEOUT_ENV
from ._version import __version__
from .library import file_sha256, valid_facts

log = logging.getLogger("deepinfer")

CACHE_DIR_ENV = "DEEPINFER_CACHE_DIR"
CACHE_FILE = "probe-cache.json"


def cache_dir() -> Path:
    """Where deepinfer caches probe verdicts: DEEPINFER_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer,
    else ~/.cache/deepinfer."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepinfer"


def cache_key(path: Path) -> dict:
    st = path.stat()
    # a library's facts can depend on the DEEPINFER_* settings it reads at start-up (the CPU
    # library's DEEPINFER_CPU_ISA changes its device.arch): a verdict holds for the ones it saw
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("DEEPINFER_") and k not in (CACHE_DIR_ENV, PROBE_TIMEOUT_ENV))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path),
            "deepinfer": __version__, "host": os.uname().nodename,
            "env": hashlib.sha256(repr(env).encode()).hexdigest()[:16]}


def _read_cache() -> dict:
    f = cache_dir() / CACHE_FILE
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.debug("ignoring the probe cache %s: %s", f, e)
        return {}
    if not isinstance(data, dict):
        log.debug("ignoring the probe cache %s: not a JSON object", f)
        return {}
    return data


def cached_outcome(path: Path, key: dict) -> Optional[dict]:
    entry = _read_cache().get(str(path.resolve()))
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    outcome = entry.get("outcome")
    if not isinstance(outcome, dict):
        return None
    if valid_facts(outcome.get("facts")) or isinstance(outcome.get("failure"), str):
        return outcome
    return None


def store_outcome(path: Path, key: dict, outcome: dict) -> None:
    # entries of files that are gone (test builds, replaced installs) are dropped on each write
    data = {p: e for p, e in _read_cache().items() if os.path.exists(p)}
    data[str(path.resolve())] = {"key": key, "outcome": outcome}
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{CACHE_FILE}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, d / CACHE_FILE)   # readers see the old file or the new one, never half of one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.debug("cannot write the probe cache in %s: %s", d, e)
