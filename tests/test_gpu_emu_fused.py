"""The GPU backend's fused kernel of ABI 1.6 (backends/cuda/src/mla_rope_cache_write.cu's
k_mla_rope_cache_write) runs on the CPU: tests/gpu_emu/test_fused_ops.cpp includes that file against
tests/gpu_emu/host_emu.h (one emulated block at a time, the grid-stride loop included) and compares it
with a serial float64 composition of rope, rmsnorm and mla_cache_write (abi/README.md section 8). The
device run (conformance of mla_rope_cache_write on the CUDA library) checks it against the reference
backend. Needs a C++17 compiler; skips without one."""
from __future__ import annotations

import subprocess

import pytest

from test_gpu_emu import _build, _cxx


def test_mla_rope_cache_write_kernel_on_the_cpu(tmp_path):
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = _build(cxx, "test_fused_ops.cpp", tmp_path / "fused_ops")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "all checks passed" in run.stdout
