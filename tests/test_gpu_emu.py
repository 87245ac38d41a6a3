"""The GPU backend's block-level algorithms run on the CPU: tests/gpu_emu/test_lanes_and_sort.cpp
compiles backends/cuda/src/device.cuh (lane groups, shuffles, reductions, prefix sums) and
sort_rows.cuh (sample's portable sort, which the HIP build uses instead of CUB) against
tests/gpu_emu/host_emu.h, a host emulation of one thread block, and checks them against serial
computations. Without an AMD GPU, this is where the HIP-only sort runs. It needs a C++17 compiler and
skips without one."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "gpu_emu"


def _cxx() -> str | None:
    for c in ("c++", "g++", "clang++"):
        if shutil.which(c):
            return c
    return None


def test_lane_helpers_and_portable_sort_on_the_cpu(tmp_path):
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "lanes_and_sort"
    build = subprocess.run([cxx, "-std=c++17", "-O2", "-pthread", '-DDI_GPU_HOST_EMU="host_emu.h"', f"-I{EMU}",
                            f"-I{ROOT / 'backends' / 'cuda' / 'src'}", f"-I{ROOT / 'abi'}",
                            str(EMU / "test_lanes_and_sort.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "all checks passed" in run.stdout
