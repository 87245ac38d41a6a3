"""The HIP build of the GPU backend (backends/hip): the CUDA sources stay shareable with it, and a
built libdeepinfer_hip.so is found by the loader and, on a machine without a ROCm GPU, rejected with a
reason that says why. No AMD GPU is reachable here: the kernels are compiled (CI builds the library
for gfx90a and gfx942/gfx940), never run; backends/hip/certify.sh certifies them on an AMD machine.

The built library comes from DEEPINFER_HIP_LIB (CI sets it after backends/hip/build.sh) or from
backends/hip/build/; the tests that need it skip without one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deepinfer import loader

ROOT = Path(__file__).resolve().parents[1]
HIP = ROOT / "backends" / "hip"


def _hip_lib() -> Path | None:
    for p in (os.environ.get("DEEPINFER_HIP_LIB", ""), str(HIP / "build" / "libdeepinfer_hip.so")):
        if p and Path(p).is_file():
            return Path(p)
    return None


def test_cuda_sources_stay_shareable_with_hip():
    p = subprocess.run(["bash", str(HIP / "check_compat.sh")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no warp-width assumptions" in p.stdout


def test_check_compat_catches_warp_width_assumptions(tmp_path):
    # a copy of the sources with the two kinds of slip the check exists for
    dst = tmp_path / "backends"
    shutil.copytree(ROOT / "backends" / "cuda" / "src", dst / "cuda" / "src")
    shutil.copytree(HIP, dst / "hip", ignore=shutil.ignore_patterns("build"))
    attn = dst / "cuda" / "src" / "attention.cu"
    src = attn.read_text()
    assert "const int warp = warp_id(), lane = lane_id();" in src
    attn.write_text(src.replace("const int warp = warp_id(), lane = lane_id();",
                                "const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;", 1))
    basic = dst / "cuda" / "src" / "elementwise.cu"
    basic.write_text(basic.read_text() + "\n__device__ float f(float v) { return __shfl_down_sync(0xffffffffu, v, 1); }\n")
    p = subprocess.run(["bash", str(dst / "hip" / "check_compat.sh")], capture_output=True, text=True)
    assert p.returncode == 1
    assert "attention.cu" in p.stderr and "threadIdx.x >> 5" in p.stderr
    assert "elementwise.cu" in p.stderr and "__shfl_down_sync" in p.stderr


def test_build_script_says_what_to_install_without_hipcc(tmp_path):
    p = subprocess.run(["bash", str(HIP / "build.sh"), str(tmp_path / "out")], capture_output=True, text=True,
                       env={**os.environ, "HIPCC": str(tmp_path / "no-hipcc")})
    assert p.returncode == 1 and "not found: install HIP" in p.stderr


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_DIR_ENV, str(tmp_path / "cache"))


def test_hip_library_is_found_and_judged_by_the_loader(isolated_cache, monkeypatch):
    lib = _hip_lib()
    if lib is None:
        pytest.skip("no libdeepinfer_hip.so built (backends/hip/build.sh; CI sets DEEPINFER_HIP_LIB)")
    monkeypatch.setenv(loader.ENV_PATH, str(lib))
    c = next(c for c in loader.candidates() if c.path == str(lib))
    assert c.name == "hip" and c.abi_version.startswith("1.")
    if c.ok:  # an AMD machine with ROCm: the library runs, on ROCm memory
        assert c.device == "rocm" and c.attributes.get("device.type") == "rocm"
        assert c.attributes.get("device.arch", "").startswith("gfx")
    else:     # here: no ROCm GPU (or no ROCm runtime at all), and the reason says so
        assert "ROCm" in c.reason, c.reason
        assert ("no usable ROCm device" in c.reason or "ROCm runtime is missing" in c.reason), c.reason
    # asking for it by name fails with the same reason instead of falling back silently
    if not c.ok:
        with pytest.raises(Exception, match="ROCm"):
            loader.get_backend("hip")
