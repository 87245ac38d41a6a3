"""Finding, validating, ranking and binding backend libraries.

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

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from . import abi
from .errors import BackendLoadError, BackendNotFoundError, InputError

if TYPE_CHECKING:  # backend.py pulls in numpy and ml_dtypes, which the probe child must not pay for
    from .backend import Backend, NativeBackend

log = logging.getLogger("deepinfer")
ffi = abi.ffi

ENV_PATH = "DEEPINFER_BACKEND_PATH"
PROBE_TIMEOUT_ENV = "DEEPINFER_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 30.0
CACHE_DIR_ENV = "DEEPINFER_CACHE_DIR"
CACHE_FILE = "probe-cache.json"
ENTRY_POINT_GROUP = "deepinfer.backends"
LIB_GLOB = "libdeepinfer_*.so"

# default ranking when a library has no score(): accelerators before the CPU, CPU before the oracle
_DEVICE_SCORE = {"cuda": 100, "rocm": 100, "hip": 100, "ascend": 90, "cpu": 10}

# values of the `device.type` attribute (abi/README.md section 7)
_DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "rocm": "rocm", "ext": "ext"}

# Libraries stay mapped for the life of the process: unloading one while a tensor or context it
# owns is alive would crash (ggml's registry learned this), and cffi cannot tell.
_OPEN_LIBS: dict[str, object] = {}


@dataclass
class Candidate:
    path: Optional[str]             # None for the reference backend
    source: str                     # "explicit", "env", "entry-point", "bundled", "builtin"
    name: str = "?"
    version: str = "?"
    abi_version: str = "?"
    device: str = "?"
    score: int = -1
    ok: bool = False
    reason: str = ""
    ops: list = field(default_factory=list)
    entries: list = field(default_factory=list)     # non-op DI_Api entries it fills
    attributes: dict = field(default_factory=dict)
    sha256: str = ""

    def summary(self) -> str:
        where = self.path or "(built in)"
        if not self.ok:
            return f"REJECTED  {where}  [{self.source}]: {self.reason}"
        return (f"{self.name:10s} v{self.version}  abi {self.abi_version}  score {self.score}  "
                f"device {self.device}  [{self.source}] {where}")


# what a probe learns about a library (everything but where it was found): the probe child's answer
FACT_FIELDS = ("name", "version", "abi_version", "device", "score", "ok", "reason", "ops", "entries", "attributes",
               "sha256")


# ---------------------------------------------------------------------------- discovery


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
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
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


# ---------------------------------------------------------------------------- validation


def _no_stage(_name: str) -> None:
    pass


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError as e:
        raise BackendLoadError(f"{path}: cannot be read: {e}") from None


def _check_file(path: Path) -> None:
    """What can be said of a library without running any of its code."""
    if not path.exists():
        raise BackendNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise BackendLoadError(f"{path}: not a file")
    if not _is_elf(path):
        raise BackendLoadError(f"{path}: not a shared library (no ELF header); point at a libdeepinfer_*.so")


def open_library(path: Path, stage: Callable[[str], None] = _no_stage) -> tuple[object, object, object]:
    """dlopen + bootstrap + version negotiation; returns (lib, info, api) or raises BackendLoadError.
    `stage(name)` is told before each step that runs the library's code ("load", "bootstrap")."""
    path = Path(path)
    _check_file(path)
    key = str(path.resolve())
    lib = _OPEN_LIBS.get(key)
    if lib is None:
        stage("load")
        try:
            lib = ffi.dlopen(key)
        except OSError as e:
            raise BackendLoadError(f"{path}: cannot be loaded: {e}. {_missing_runtime_hint(str(e))}") from None
        _OPEN_LIBS[key] = lib
    try:
        bootstrap = lib.deepinfer_plugin_info
    except (AttributeError, NotImplementedError):
        raise BackendLoadError(
            f"{path}: does not export deepinfer_plugin_info(); it is not a deepinfer backend "
            f"(build it against abi/deepinfer_abi.h and export that symbol)") from None
    stage("bootstrap")
    info = bootstrap()
    if info == ffi.NULL:
        raise BackendLoadError(f"{path}: deepinfer_plugin_info() returned NULL")
    if info.struct_size < ffi.sizeof("DI_PluginInfo"):
        raise BackendLoadError(f"{path}: DI_PluginInfo.struct_size {info.struct_size} < "
                               f"{ffi.sizeof('DI_PluginInfo')}: corrupt or pre-1.0 library")
    lib_ver = f"{info.abi_major}.{info.abi_minor}"
    if info.abi_major != abi.ABI_MAJOR:
        newer = info.abi_major > abi.ABI_MAJOR
        raise BackendLoadError(
            f"{path}: built for deepinfer ABI {lib_ver}, this deepinfer speaks {abi.ABI_MAJOR}.{abi.ABI_MINOR}; "
            + ("upgrade deepinfer or get a build of the library for ABI "
               f"{abi.ABI_MAJOR}.x" if newer else f"rebuild the library against abi/deepinfer_abi.h {abi.ABI_MAJOR}.x"))
    if info.get_api == ffi.NULL:
        raise BackendLoadError(f"{path}: DI_PluginInfo.get_api is NULL")
    api = info.get_api(abi.ABI_MAJOR)
    if api == ffi.NULL:
        raise BackendLoadError(f"{path}: get_api({abi.ABI_MAJOR}) returned NULL: the library does not offer "
                               f"ABI {abi.ABI_MAJOR}.x although it says {lib_ver}")
    if api.abi_major != abi.ABI_MAJOR:
        raise BackendLoadError(f"{path}: get_api({abi.ABI_MAJOR}) returned a table for ABI {api.abi_major}.x")
    min_size = ffi.offsetof("DI_Api", "embedding")
    if api.struct_size < min_size:
        raise BackendLoadError(f"{path}: DI_Api.struct_size {api.struct_size} is smaller than the v1.0 core "
                               f"({min_size} bytes): corrupt library")
    for entry in ("context_create", "context_destroy", "last_error"):
        if getattr(api, entry) == ffi.NULL:
            raise BackendLoadError(f"{path}: required entry {entry} is NULL")
    return lib, info, api


# vendor runtimes a backend library links against, and what to do when the dynamic linker lacks one
_RUNTIME_HINTS = {
    "libamdhip64": "The ROCm runtime is missing: install ROCm (or on Debian/Ubuntu `apt-get install "
                   "libamdhip64-5`), or put its lib folder on LD_LIBRARY_PATH.",
    "libcuda.so": "The NVIDIA driver library libcuda.so.1 is missing: install the NVIDIA driver.",
}


def _missing_runtime_hint(dlerror: str) -> str:
    for lib, hint in _RUNTIME_HINTS.items():
        if lib in dlerror:
            return hint
    return "Is it built for this machine, with its dependencies on the library path?"


def _library_error(api) -> str:
    """The library's thread-global message (last_error(NULL)), '' when it has none."""
    try:
        msg = api.last_error(ffi.NULL)
        return ffi.string(msg).decode("utf-8", "replace").strip() if msg != ffi.NULL else ""
    except Exception:
        return ""


def _device_of(name: str) -> str:
    n = name.lower()
    for dev in ("cuda", "rocm", "hip", "ascend"):
        if dev in n:
            return "rocm" if dev == "hip" else dev
    return "cpu"


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _self_test(path: Path, api) -> dict:
    """Create a context, read its attributes, destroy it (through the raw table: the probe child must
    not import numpy); returns the attributes."""
    opts = ffi.new("DI_ContextOptions*")
    opts.struct_size = ffi.sizeof("DI_ContextOptions")
    ctx = ffi.new("DI_Context**")
    status = api.context_create(opts, ctx)
    if status != abi.OK:
        msg = api.last_error(ffi.NULL)
        why = ffi.string(msg).decode("utf-8", "replace") if msg != ffi.NULL else ""
        raise BackendLoadError(f"{path}: self-test failed: context_create: "
                               f"{abi.STATUS_NAMES.get(status, f'status {status}')}: {why}")
    try:
        return abi.read_attributes(api, ctx[0])
    finally:
        api.context_destroy(ctx[0])


def probe(path: Path, source: str = "explicit", stage: Callable[[str], None] = _no_stage) -> Candidate:
    """Validate one library in this process without keeping a context; never raises. A library that
    crashes, hangs or exits takes this process with it: probe_isolated() runs this in a child.
    `stage(name)` is told before each step that runs the library's code (see open_library)."""
    c = Candidate(path=str(path), source=source)
    try:
        lib, info, api = open_library(path, stage)
        c.name = ffi.string(info.name).decode() if info.name != ffi.NULL else path.stem
        c.version = ffi.string(info.version).decode() if info.version != ffi.NULL else "?"
        c.abi_version = f"{info.abi_major}.{info.abi_minor}"
        score = _DEVICE_SCORE.get(_device_of(c.name), 50)
        if info.score != ffi.NULL:
            stage("score")
            score = int(info.score())
        c.score = score
        c.sha256 = file_sha256(path)
        if score < 0:  # checked before the self-test: such a library may not even create a context
            why = _library_error(api)  # score() may leave its reason there (abi/README.md section 1)
            c.reason = "library says it cannot run on this machine (score < 0)" + (f": {why}" if why else "")
            return c
        stage("self-test")
        c.attributes = _self_test(path, api)
        c.ops = [op for op in abi.OP_NAMES if abi.has_entry(api, op)]
        c.entries = [e for e in abi.API_NON_OP_FIELDS if abi.has_entry(api, e)]
        # the library's own word on where its memory lives beats a guess from its name
        c.device = _DEVICE_TYPES.get(c.attributes.get("device.type", ""), _device_of(c.name))
        c.ok = True
    except BackendLoadError as e:
        c.reason = str(e)
    except Exception as e:  # a library that fails its self-test must not take the loader down
        c.reason = f"self-test failed: {type(e).__name__}: {e}"
    return c


# ---------------------------------------------------------------------------- probing in a child process

# where the child was when it died or hung, by the last stage it announced
_STAGE_WHERE = {
    None: "before it loaded the library",
    "load": "while the library was being loaded (in its constructors)",
    "bootstrap": "in deepinfer_plugin_info() or get_api()",
    "score": "in score()",
    "self-test": "in its self-test (creating a context, reading its attributes, destroying it)",
}


def probe_timeout() -> float:
    """Seconds a probe child may take (DEEPINFER_PROBE_TIMEOUT, default 30)."""
    raw = os.environ.get(PROBE_TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_PROBE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InputError(f"{PROBE_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it for the "
                         f"default ({DEFAULT_PROBE_TIMEOUT:g} s)")
    return value


def child_env() -> dict:
    """The environment of a child Python process (a probe, a conformance level) that must import this
    very deepinfer, also when it runs from a source tree (PYTHONPATH=runtime)."""
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _valid_facts(facts) -> bool:
    return isinstance(facts, dict) and set(facts) == set(FACT_FIELDS)


def _parse_facts(text: str):
    try:
        facts = json.loads(text)
    except ValueError:
        return None
    return facts if _valid_facts(facts) else None


def _read_answer(out: str, err: str, rc: int) -> dict:
    """The child's outcome: {"facts": {...}} or {"failure": why, "at_fault": is it the library's,
    "cacheable": does it hold for the file}."""
    stage, facts, garbage = None, None, []
    for line in out.splitlines():
        parsed = _parse_facts(line[len("VERDICT "):]) if line.startswith("VERDICT ") else None
        if line.startswith("STAGE "):
            stage = line[len("STAGE "):]
        elif parsed is not None:
            facts = parsed
        elif line.strip():
            garbage.append(line)
    where = _STAGE_WHERE.get(stage, f"in stage {stage!r}")
    if facts is not None and rc == 0:
        return {"facts": facts}
    if stage is None and not garbage:  # it never reached the library: our installation, not its fault
        tail = err.strip().splitlines()[-1:] or [f"exit status {rc}"]
        return {"failure": f"the probe process failed before loading it: {tail[0][:300]}; this is a problem of "
                           f"the deepinfer installation, not of the library", "at_fault": False, "cacheable": False}
    if facts is not None:
        where = "after answering, when the process exited (in its destructors)"
    if rc < 0:
        failure = f"crashed with {_signal_name(-rc)} while being probed, {where}"
    elif rc == 0 and garbage:
        failure = f"answered the probe with something other than a verdict: {garbage[0][:200]!r}"
    elif stage == "load" and facts is None:
        failure = f"its constructor exited the process with status {rc} while it was being loaded"
    else:
        failure = f"exited the process with status {rc} while being probed, {where}"
    return {"failure": failure, "at_fault": True, "cacheable": True}


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session=True, and whatever it started in turn."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _probe_in_child(path: Path) -> dict:
    """Run the probe of `path` in a child process; its outcome (see _read_answer)."""
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
        where = _STAGE_WHERE.get(stages[-1] if stages else None, "")
        # not cached: a slow start may be the machine's load, not a property of the file
        return {"failure": f"did not answer within {timeout:g} s while being probed, {where}", "at_fault": True,
                "cacheable": False, "timed_out": True}
    if err.strip():
        log.debug("probe of %s said on stderr:\n%s", path, err.strip())
    return _read_answer(out, err, proc.returncode)


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
        _check_file(path)
    except BackendLoadError as e:
        return Candidate(path=str(path), source=source, reason=str(e))
    key = _cache_key(path)
    outcome = _cached_outcome(path, key)
    if outcome is None:
        outcome = _probe_in_child(path)
        if outcome.get("cacheable", True):
            _store_outcome(path, key, outcome)
    return _candidate_from(outcome, path, source)


# ---------------------------------------------------------------------------- the verdict cache


def cache_dir() -> Path:
    """Where deepinfer caches probe verdicts: DEEPINFER_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer,
    else ~/.cache/deepinfer."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepinfer"


def _cache_key(path: Path) -> dict:
    st = path.stat()
    # a library's facts can depend on the DEEPINFER_* settings it reads at start-up (the CPU
    # library's DEEPINFER_CPU_ISA changes its device.arch): a verdict holds for the ones it saw
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("DEEPINFER_") and k not in (CACHE_DIR_ENV, PROBE_TIMEOUT_ENV))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path),
            "deepinfer": _ref_version(), "host": os.uname().nodename,
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


def _cached_outcome(path: Path, key: dict) -> Optional[dict]:
    entry = _read_cache().get(str(path.resolve()))
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    outcome = entry.get("outcome")
    if not isinstance(outcome, dict):
        return None
    if _valid_facts(outcome.get("facts")) or isinstance(outcome.get("failure"), str):
        return outcome
    return None


def _store_outcome(path: Path, key: dict, outcome: dict) -> None:
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


# ---------------------------------------------------------------------------- candidates


def _is_bundled(path: Path) -> bool:
    return path.resolve().parent in {d.resolve() for d in bundled_lib_dirs()}


def _probe(path: Path, source: str) -> Candidate:
    """Our own bundled libraries are trusted to be probed in this process; any other one is isolated."""
    return probe(path, source) if source == "bundled" else probe_isolated(path, source)


def _reference_candidate() -> Candidate:
    return Candidate(path=None, source="builtin", name="reference", version=_ref_version(),
                     abi_version=f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", device="cpu", score=0, ok=True,
                     ops=list(abi.OP_NAMES))


def _ranked(found: list[Candidate]) -> list[Candidate]:
    return sorted(found, key=lambda c: (not c.ok, -c.score))


def candidates(explicit: Optional[list] = None) -> list[Candidate]:
    """Every backend found, best first, the rejected ones last with their reasons."""
    return _ranked([_probe(p, src) for p, src in discover(explicit)] + [_reference_candidate()])


def _ref_version() -> str:
    from . import __version__

    return __version__


# ---------------------------------------------------------------------------- binding


def _bind(c: Candidate, device_id: int, num_threads: int) -> "NativeBackend":
    from .backend import BackendInfo, NativeBackend

    lib, info, api = open_library(Path(c.path))
    return NativeBackend(lib, api, BackendInfo(c.name, c.version, c.device, c.path, c.abi_version),
                         device_id=device_id, num_threads=num_threads)


def load_library(path, device_id: int = 0, num_threads: int = 0) -> "NativeBackend":
    """Bind one library (raises BackendLoadError with the reason if it is unusable). One that is not
    bundled is probed in a child first and only bound here if the child found it sound."""
    path = Path(path)
    if not path.exists():
        raise BackendNotFoundError(f"{path}: no such file; give the path of a libdeepinfer_<name>.so")
    c = _probe(path, "bundled" if _is_bundled(path) else "explicit")
    if not c.ok:
        raise BackendLoadError(c.reason)
    return _bind(c, device_id, num_threads)


def reference() -> "Backend":
    from .reference import ReferenceBackend

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
                num_threads: int = 0, local_rank: int = 0) -> "Backend":
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
        best = _probe(path, "bundled" if _is_bundled(path) else "explicit")
        if not best.ok:
            raise BackendLoadError(best.reason)
    else:
        best = _best(name)
        if best is None:
            return reference()
    be = _bind(best, device_id + (local_rank if best.device != "cpu" else 0), num_threads)
    if fallback and be.device == "cpu":
        from .backend import FallbackBackend

        return FallbackBackend(be, reference())
    return be
