"""One backend library, in this process: what can be checked without running it, opening it
(dlopen, bootstrap, ABI version negotiation), its self-test, and what a probe learns about it
(Candidate).

probe() runs the library's code; a library that crashes, hangs or exits takes the process with
it, so the loader runs it in a child process (_probe_child.py) for every library that is not
bundled with this package. Nothing here imports numpy: the probe child pays for what it imports.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from . import abi
from .errors import BackendLoadError, BackendNotFoundError

ffi = abi.ffi

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



def valid_facts(facts) -> bool:
    """Whether `facts` is a probe's answer (a dict of exactly FACT_FIELDS)."""
    return isinstance(facts, dict) and set(facts) == set(FACT_FIELDS)


def _no_stage(_name: str) -> None:
    pass


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError as e:
        raise BackendLoadError(f"{path}: cannot be read: {e}") from None


def check_file(path: Path) -> None:
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
    check_file(path)
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
