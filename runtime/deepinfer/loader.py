"""Finding, validating, ranking and binding backend libraries: the one entry of all of it
(get_backend, candidates, load_library); the parts are discovery.py (where libraries are found),
library.py (opening and validating one library in this process), _probe_child.py (the child
process that probes one, and how its answer is read) and probe_cache.py (the verdict cache).

Discovery, in order: paths given explicitly, DEEPINFER_BACKEND_PATH (files or folders, separated
by os.pathsep), the entry-point group `deepinfer.backends` (each entry point is a callable that
returns a path or a list of paths), and the libraries bundled with this package. Every candidate
is validated (it is a shared library, exports the bootstrap symbol, speaks our ABI major and at
least its own declared minor, and a context can be created and destroyed) and each failure keeps a
reason that says what to do. The reference backend is always a candidate, with the lowest score.

Validating a library runs its code (constructors, bootstrap, a context), and a broken one can
crash, hang or exit() the process. So only the package's own bundled libraries are probed in this
process; every other one is probed in a child process (deepinfer/_probe_child.py) that answers
with the candidate's facts as JSON. A child that dies by a signal, exits, answers garbage or does
not answer within DEEPINFER_PROBE_TIMEOUT seconds (default 30) rejects the library with a reason
that says which. Verdicts are cached by path, size, mtime, sha256, deepinfer version and host in
probe-cache.json under DEEPINFER_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer, else
~/.cache/deepinfer, so each library file costs one child once; timeouts are not cached (they may
be the machine's load rather than the library's fault), and a verdict holds for the DEEPINFER_*
settings it was made under. An unwritable or corrupt cache is ignored.

get_backend("cpu") probes only the libraries named libdeepinfer_cpu.so: a library the user did not
ask for never runs.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from . import abi
from ._probe_child import DEFAULT_PROBE_TIMEOUT, PROBE_TIMEOUT_ENV, STAGE_WHERE, probe_timeout, read_answer
from ._version import __version__
from .backend import Backend, BackendInfo, FallbackBackend, NativeBackend
from .discovery import ENTRY_POINT_GROUP, ENV_PATH, LIB_GLOB, bundled_lib_dirs, discover, is_bundled
from .errors import BackendLoadError, BackendNotFoundError
from .library import FACT_FIELDS, Candidate, check_file, file_sha256, open_library, probe
from .probe_cache import CACHE_DIR_ENV, CACHE_FILE, cache_dir, cache_key, cached_outcome, store_outcome
from .reference import ReferenceBackend

log = logging.getLogger("deepinfer")

__all__ = [
    "CACHE_DIR_ENV", "CACHE_FILE", "DEFAULT_PROBE_TIMEOUT", "ENTRY_POINT_GROUP", "ENV_PATH", "FACT_FIELDS", "LIB_GLOB",
    "PROBE_TIMEOUT_ENV", "Candidate", "bundled_lib_dirs", "cache_dir", "candidates", "child_env", "discover",
    "file_sha256", "get_backend", "kill_process_group", "load_library", "open_library", "probe", "probe_isolated",
    "probe_timeout", "reference",
]


# ---------------------------------------------------------------------------- probing in a child process


def child_env() -> dict:
    """The environment of a child Python process (a probe, a conformance level) that must import this
    very deepinfer, also when it runs from a source tree (PYTHONPATH=runtime)."""
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session=True, and whatever it started in turn."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _probe_in_child(path: Path) -> dict:
    """Run the probe of `path` in a child process; its outcome (see _probe_child.read_answer)."""
    timeout = probe_timeout()
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer._probe_child", str(path)], env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc)
        out, err = proc.communicate()
        stages = [line[len("STAGE "):] for line in out.splitlines() if line.startswith("STAGE ")]
        where = STAGE_WHERE.get(stages[-1] if stages else None, "")
        # not cached: a slow start may be the machine's load, not a property of the file
        return {"failure": f"did not answer within {timeout:g} s while being probed, {where}", "at_fault": True,
                "cacheable": False, "timed_out": True}
    if err.strip():
        log.debug("probe of %s said on stderr:\n%s", path, err.strip())
    return read_answer(out, err, proc.returncode)


def _what_to_do(source: str, outcome: dict) -> str:
    if source == "env":
        todo = f"remove it from {ENV_PATH} or rebuild it"
    elif source == "entry-point":
        todo = f"uninstall the package whose {ENTRY_POINT_GROUP} entry point names it, or rebuild it"
    else:
        todo = "rebuild it"
    if outcome.get("timed_out"):
        todo += f" (if it is only slow to start, raise {PROBE_TIMEOUT_ENV})"
    return todo


def _candidate_from(outcome: dict, path: Path, source: str) -> Candidate:
    if "facts" in outcome:
        return Candidate(path=str(path), source=source, **outcome["facts"])
    reason = f"{path}: {outcome['failure']}"
    if outcome.get("at_fault"):
        reason += f"; {_what_to_do(source, outcome)}"
    return Candidate(path=str(path), source=source, reason=reason)


def probe_isolated(path: Path, source: str = "explicit") -> Candidate:
    """probe() in a child process, so that a library that crashes, hangs or exits is a rejected
    candidate and not the end of this process; verdicts are cached (see the module docstring)."""
    path = Path(path)
    try:
        check_file(path)
    except BackendLoadError as e:
        return Candidate(path=str(path), source=source, reason=str(e))
    key = cache_key(path)
    outcome = cached_outcome(path, key)
    if outcome is None:
        outcome = _probe_in_child(path)
        if outcome.get("cacheable", True):
            store_outcome(path, key, outcome)
    return _candidate_from(outcome, path, source)



# ---------------------------------------------------------------------------- candidates


def _probe(path: Path, source: str) -> Candidate:
    """Our own bundled libraries are trusted to be probed in this process; any other one is isolated."""
    return probe(path, source) if source == "bundled" else probe_isolated(path, source)


def _reference_candidate() -> Candidate:
    return Candidate(path=None, source="builtin", name="reference", version=__version__,
                     abi_version=f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", device="cpu", score=0, ok=True,
                     ops=list(abi.OP_NAMES))


def _ranked(found: list[Candidate]) -> list[Candidate]:
    return sorted(found, key=lambda c: (not c.ok, -c.score))


def candidates(explicit: Optional[list] = None) -> list[Candidate]:
    """Every backend found, best first, the rejected ones last with their reasons."""
    return _ranked([_probe(p, src) for p, src in discover(explicit)] + [_reference_candidate()])


# ---------------------------------------------------------------------------- binding


def _bind(c: Candidate, device_id: int, num_threads: int) -> NativeBackend:
    lib, info, api = open_library(Path(c.path))
    return NativeBackend(lib, api, BackendInfo(c.name, c.version, c.device, c.path, c.abi_version),
                         device_id=device_id, num_threads=num_threads)


def load_library(path, device_id: int = 0, num_threads: int = 0) -> NativeBackend:
    """Bind one library (raises BackendLoadError with the reason if it is unusable). One that is not
    bundled is probed in a child first and only bound here if the child found it sound."""
    path = Path(path)
    if not path.exists():
        raise BackendNotFoundError(f"{path}: no such file; give the path of a libdeepinfer_<name>.so")
    c = _probe(path, "bundled" if is_bundled(path) else "explicit")
    if not c.ok:
        raise BackendLoadError(c.reason)
    return _bind(c, device_id, num_threads)


def reference() -> Backend:
    return ReferenceBackend()


def _library_name(path: Path) -> str:
    """cpu for libdeepinfer_cpu.so: the name get_backend() selects a library by, before running it."""
    stem = path.name[:-len(".so")] if path.name.endswith(".so") else path.stem
    return stem[len("libdeepinfer_"):] if stem.startswith("libdeepinfer_") else stem


def _named(name: str) -> list[tuple[Path, str]]:
    """The libraries found whose file is libdeepinfer_<name>.so (none of them probed)."""
    found = discover()
    chosen = [(p, src) for p, src in found if _library_name(p) == name]
    if not chosen:
        known = ", ".join([_library_name(p) for p, _ in found] + ["reference"])
        raise BackendNotFoundError(
            f"backend {name!r} is not available: no libdeepinfer_{name}.so was found (explicit paths, {ENV_PATH}, "
            f"the {ENTRY_POINT_GROUP} entry points, the bundled libraries). Available: {known} "
            f"(libraries found, not probed)")
    return chosen


def _best(name: Optional[str]) -> Optional[Candidate]:
    """The best usable library of that name (any name: None), or None when there is none."""
    found = _named(name) if name is not None else discover()
    probed = [_probe(p, src) for p, src in found]
    usable = [c for c in _ranked(probed) if c.ok]
    if usable:
        return usable[0]
    if name is None:
        return None
    raise BackendLoadError(f"backend {name!r} is not available: " + "; ".join(c.reason for c in probed))


def get_backend(name: Optional[str] = None, *, fallback: bool = False, device_id: int = 0,
                num_threads: int = 0, local_rank: int = 0) -> Backend:
    """The backend to use: by name ("reference", "cpu", "cuda", ...), by path, or the best found.

    A name only probes the libraries named libdeepinfer_<name>.so; no name probes every one found.
    fallback=True wraps a host backend so that ops it lacks run on the reference (logged).
    local_rank (a rank of a multi-rank job on this machine) picks device device_id + local_rank of a
    device backend; a host backend has one device, shared by the ranks.
    """
    if name == "reference":
        return reference()
    if name and (os.sep in name or name.endswith(".so")):
        path = Path(name)
        if not path.exists():
            raise BackendNotFoundError(f"{path}: no such file; give the path of a libdeepinfer_<name>.so")
        best = _probe(path, "bundled" if is_bundled(path) else "explicit")
        if not best.ok:
            raise BackendLoadError(best.reason)
    else:
        best = _best(name)
        if best is None:
            return reference()
    be = _bind(best, device_id + (local_rank if best.device != "cpu" else 0), num_threads)
    if fallback and be.device == "cpu":
        return FallbackBackend(be, reference())
    return be
