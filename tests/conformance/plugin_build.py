"""Helpers shared by the conformance tests and tests/test_loader.py: finding a C compiler, compiling
plugins from plugins/*.c against abi/deepinfer_abi.h alone, and finding a built CPU backend.
(A module of its own rather than conftest.py, so that tests elsewhere can import it by a unique name.)"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABI_DIR = ROOT / "abi"
# a frozen copy of the 1.0 header: plugins built against it stand for every 1.0 library already shipped
ABI_V1_0_DIR = Path(__file__).resolve().parent / "abi_v1_0"
# and of the 1.1 headers (deepinfer_abi.h and deepinfer_abi_check.h): every 1.1 library already shipped
ABI_V1_1_DIR = Path(__file__).resolve().parent / "abi_v1_1"
# and of the 1.2 headers: every 1.2 library already shipped
ABI_V1_2_DIR = Path(__file__).resolve().parent / "abi_v1_2"
# and of the 1.3 headers: every 1.3 library already shipped
ABI_V1_3_DIR = Path(__file__).resolve().parent / "abi_v1_3"
# and of the 1.4 headers: every 1.4 library already shipped
ABI_V1_4_DIR = Path(__file__).resolve().parent / "abi_v1_4"
# and of the 1.5 headers: every 1.5 library already shipped
ABI_V1_5_DIR = Path(__file__).resolve().parent / "abi_v1_5"
# and of the 1.6 headers: every 1.6 library already shipped
ABI_V1_6_DIR = Path(__file__).resolve().parent / "abi_v1_6"
PLUGINS = Path(__file__).resolve().parent / "plugins"
THOROUGH = os.environ.get("DEEPINFER_CONFORMANCE_THOROUGH", "") not in ("", "0")
PROFILE = "thorough" if THOROUGH else "quick"


def c_compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def compile_shared(cc: str, src: Path, out: Path, defines: dict | None = None, extra: list | None = None,
                   abi_dir: Path = ABI_DIR) -> Path:
    """cc -shared -fPIC from one C file and the ABI header only (abi_dir: which version of it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [cc, "-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Werror", "-I", str(abi_dir), str(src), "-o", str(out),
           "-lm", "-lpthread"]
    for k, v in (defines or {}).items():
        cmd.insert(1, f"-D{k}" if v is None else f"-D{k}={v}")
    cmd += extra or []
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{p.stderr}")
    return out


def find_cpu_lib() -> Path | None:
    for p in (os.environ.get("DEEPINFER_CPU_LIB", ""), "/tmp/build/backends/cpu/libdeepinfer_cpu.so",
              str(ROOT / "build/backends/cpu/libdeepinfer_cpu.so")):
        if p and Path(p).is_file():
            return Path(p)
    from deepinfer.loader import candidates

    for c in candidates():
        if c.ok and c.name == "cpu" and c.path:
            return Path(c.path)
    return None


