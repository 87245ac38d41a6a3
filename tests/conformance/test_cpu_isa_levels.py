"""The CPU library passes the op conformance cases at every ISA level it can dispatch to.

DEEPINFER_CPU_ISA caps the kernels the library picks at start-up (scalar, avx2, avx512, avx512vnni,
amx), so one machine checks every fallback: the scalar code that portability keeps, the AVX2 and
AVX-512 kernels, the VNNI integer rows, and AMX tiles where the CPU has them (on a CPU without AMX
the amx level is the best it has). Each level runs in a process of its own because the choice is
made once per process; the library reports the kernels it chose as device.arch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LEVELS = ("scalar", "avx2", "avx512", "avx512vnni", "amx")
# the ops whose bodies differ by ISA
OPS = "linear,moe_experts,mla_decode,mla_prefill,quantize,dequantize,rmsnorm,rope,silu_mul,add"


@pytest.mark.parametrize("level", LEVELS)
def test_conformance_at_isa_level(cpu_lib, tmp_path, level):
    out = tmp_path / f"cert-{level}.json"
    env = dict(os.environ, DEEPINFER_CPU_ISA=level)
    r = subprocess.run([sys.executable, "-c", "import sys, deepinfer.cli as c; sys.exit(c.main())", "conformance",
                        str(cpu_lib), "--levels", "L1",
                        "--ops", OPS, "--in-process", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"DEEPINFER_CPU_ISA={level}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    cert = json.loads(out.read_text())
    assert cert["passed"]
    arch = cert["library"]["attributes"]["device.arch"]
    if level == "scalar":
        assert arch == "scalar", arch
    elif level == "avx2":
        assert "avx512" not in arch, arch
    elif level == "avx512":
        assert "vnni" not in arch and "amx" not in arch, arch
