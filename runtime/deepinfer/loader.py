"""Finding, validating, ranking and binding backend libraries.

Discovery, in order: paths given explicitly, DEEPINFER_BACKEND_PATH (files or folders, separated
by os.pathsep), the entry-point group `deepinfer.backends` (each entry point is a callable that
returns a path or a list of paths), and the libraries bundled with this package. Every candidate
is validated (it is a shared library, exports the bootstrap symbol, speaks our ABI major and at
least its own declared minor, and a context can be created and destroyed) and each failure keeps a
reason that says what to do. The reference backend is always a candidate, with the lowest score.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import abi
from .backend import Backend, BackendInfo, NativeBackend
from .errors import BackendLoadError

log = logging.getLogger("deepinfer")
ffi = abi.ffi

ENV_PATH = "DEEPINFER_BACKEND_PATH"
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


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def open_library(path: Path) -> tuple[object, object, object]:
    """dlopen + bootstrap + version negotiation; returns (lib, info, api) or raises BackendLoadError."""
    path = Path(path)
    if not path.exists():
        raise BackendLoadError(f"{path}: no such file")
    if not path.is_file():
        raise BackendLoadError(f"{path}: not a file")
    if not _is_elf(path):
        raise BackendLoadError(f"{path}: not a shared library (no ELF header); point at a libdeepinfer_*.so")
    key = str(path.resolve())
    lib = _OPEN_LIBS.get(key)
    if lib is None:
        try:
            lib = ffi.dlopen(key)
        except OSError as e:
            raise BackendLoadError(f"{path}: cannot be loaded: {e}. Is it built for this machine, "
                                   f"with its dependencies on the library path?") from None
        _OPEN_LIBS[key] = lib
    try:
        bootstrap = lib.deepinfer_plugin_info
    except (AttributeError, NotImplementedError):
        raise BackendLoadError(
            f"{path}: does not export deepinfer_plugin_info(); it is not a deepinfer backend "
            f"(build it against abi/deepinfer_abi.h and export that symbol)") from None
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


def probe(path: Path, source: str = "explicit") -> Candidate:
    """Validate one library without keeping a context; never raises."""
    c = Candidate(path=str(path), source=source)
    try:
        lib, info, api = open_library(path)
        c.name = ffi.string(info.name).decode() if info.name != ffi.NULL else path.stem
        c.version = ffi.string(info.version).decode() if info.version != ffi.NULL else "?"
        c.abi_version = f"{info.abi_major}.{info.abi_minor}"
        score = _DEVICE_SCORE.get(_device_of(c.name), 50)
        if info.score != ffi.NULL:
            score = int(info.score())
        c.score = score
        c.sha256 = file_sha256(path)
        if score < 0:  # checked before the self-test: such a library may not even create a context
            c.reason = "library says it cannot run on this machine (score < 0)"
            return c
        c.device = _device_of(c.name)
        be = NativeBackend(lib, api, BackendInfo(c.name, c.version, c.device, str(path), c.abi_version))
        try:
            c.ops = be.ops()
            c.entries = [e for e in abi.API_NON_OP_FIELDS if be._has(e)]
            c.attributes = be.info.attributes
        finally:
            be.close()
        # the library's own word on where its memory lives beats a guess from its name
        c.device = _DEVICE_TYPES.get(c.attributes.get("device.type", ""), c.device)
        c.ok = True
    except BackendLoadError as e:
        c.reason = str(e)
    except Exception as e:  # a library that fails its self-test must not take the loader down
        c.reason = f"self-test failed: {type(e).__name__}: {e}"
    return c


def candidates(explicit: Optional[list] = None) -> list[Candidate]:
    """Every backend found, best first, the rejected ones last with their reasons."""
    out = [probe(p, src) for p, src in discover(explicit)]
    ref = Candidate(path=None, source="builtin", name="reference", version=_ref_version(), abi_version=
                    f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", device="cpu", score=0, ok=True, ops=list(abi.OP_NAMES))
    out.append(ref)
    return sorted(out, key=lambda c: (not c.ok, -c.score))


def _ref_version() -> str:
    from . import __version__

    return __version__


# ---------------------------------------------------------------------------- binding


def load_library(path, device_id: int = 0, num_threads: int = 0) -> NativeBackend:
    """Bind one library (raises BackendLoadError with the reason if it is unusable)."""
    c = probe(Path(path))
    if not c.ok:
        raise BackendLoadError(c.reason)
    lib, info, api = open_library(Path(path))
    return NativeBackend(lib, api, BackendInfo(c.name, c.version, c.device, str(path), c.abi_version),
                         device_id=device_id, num_threads=num_threads)


def reference() -> Backend:
    from .reference import ReferenceBackend

    return ReferenceBackend()


def get_backend(name: Optional[str] = None, *, fallback: bool = False, device_id: int = 0,
                num_threads: int = 0) -> Backend:
    """The backend to use: by name ("reference", "cpu", "cuda", ...), by path, or the best found.

    fallback=True wraps a host backend so that ops it lacks run on the reference (logged).
    """
    if name == "reference":
        return reference()
    if name and (os.sep in name or name.endswith(".so")):
        be = load_library(name, device_id, num_threads)
    else:
        found = candidates()
        usable = [c for c in found if c.ok and c.path and (name is None or c.name == name)]
        if not usable:
            if name is None:
                return reference()
            rejected = [c for c in found if not c.ok and (name in (c.path or ""))]
            why = "; ".join(c.reason for c in rejected) or "no library of that name was found"
            known = ", ".join(sorted({c.name for c in found if c.ok}))
            raise BackendLoadError(f"backend {name!r} is not available: {why}. Available: {known}")
        best = usable[0]
        be = load_library(best.path, device_id, num_threads)
    if fallback and be.device == "cpu":
        from .backend import FallbackBackend

        return FallbackBackend(be, reference())
    return be
