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

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "gpu_emu"


def _cxx() -> str | None:
    for c in ("c++", "g++", "clang++"):
        if shutil.which(c):
            return c
    return None


def _build(cxx: str, source: str, exe: Path) -> Path:
    """A test program of tests/gpu_emu built against the CUDA sources with the host emulation."""
    build = subprocess.run([cxx, "-std=c++17", "-O2", "-pthread", '-DDI_GPU_HOST_EMU="host_emu.h"', f"-I{EMU}",
                            f"-I{ROOT / 'backends' / 'cuda' / 'src'}", f"-I{ROOT / 'abi'}", str(EMU / source),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return exe


def test_lane_helpers_and_portable_sort_on_the_cpu(tmp_path):
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = _build(cxx, "test_lanes_and_sort.cpp", tmp_path / "lanes_and_sort")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "all checks passed" in run.stdout


def _write_case(path: Path, case) -> None:
    t = case.tensors
    T, V = t["logits"].shape
    spec = case.op == "spec_verify"
    has_draft = spec and "draft_logits" in t
    L = t["history"].shape[1] if "history" in t else -1
    N = t["bias_ids"].shape[1] if "bias_ids" in t else -1
    parts = [np.array([1 if spec else 0, T, V, int(has_draft), int("probs" in t), L, N, int("token_mask" in t)],
                      np.int64),
             np.asarray(t["logits"].values, np.float32)]
    if has_draft:
        parts.append(np.asarray(t["draft_logits"].values, np.float32))
    if spec:
        parts.append(np.asarray(t["draft_ids"].values, np.int32))
    parts += [np.asarray(t["temperature"].values, np.float32), np.asarray(t["top_k"].values, np.int32),
              np.asarray(t["top_p"].values, np.float32), np.asarray(t["seeds"].values, np.uint64)]
    if L >= 0:
        parts += [np.asarray(t["history"].values, np.int32), np.asarray(t["prompt_lens"].values, np.int32),
                  np.asarray(t["penalties"].values, np.float32)]
    if N >= 0:
        parts += [np.asarray(t["bias_ids"].values, np.int32), np.asarray(t["bias"].values, np.float32)]
    if "token_mask" in t:
        parts.append(np.asarray(t["token_mask"].values, np.int32))
    path.write_bytes(b"".join(np.ascontiguousarray(p).tobytes() for p in parts))


@pytest.mark.slow
def test_sample_and_spec_verify_rows_on_the_cpu(tmp_path):
    """sample_rows.cuh (the GPU's sample and spec_verify, with sort_rows.cuh's portable sort) run in the
    emulation on conformance cases, judged against the reference as the conformance suite judges a
    device library: exact tokens except at a near-tie, probs to f32 tolerance."""
    from deepinfer.conformance import cases as C
    from deepinfer.conformance import tolerances as TOL
    from deepinfer.conformance.harness import ReferenceCache, _cmp_sample, _cmp_spec_verify, compare_close
    from deepinfer.reference import ReferenceBackend

    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = _build(cxx, "test_sample_rows.cpp", tmp_path / "sample_rows")
    ref = ReferenceCache(ReferenceBackend())
    cases = [C.spec_verify(11, 6, 9, "greedy", "logits", ties=True),
             C.spec_verify(12, 24, 16, "mixed", "logits"), C.spec_verify(13, 24, 16, "mixed", "greedy"),
             C.spec_verify(14, 12, 300, "mixed", "logits", ties=True), C.spec_verify(15, 12, 1000, "mixed", "greedy"),
             C.sample(16, 12, 100, "mixed", probs=True), C.sample(17, 8, 1000, "mixed", ties=True, probs=True),
             C.sample(18, 4, 7, "greedy", ties=True, probs=True),
             # 1.7's controls (k_sample_controls' row function): each group, all of them, a banned row
             C.sample_controls(19, 4, 40, "greedy", ("penalties",)), C.sample_controls(20, 5, 100, "mixed", ("bias",), True),
             C.sample_controls(21, 5, 100, "mixed", ("mask",), True), C.sample_controls(22, 6, 70, "greedy"),
             C.sample_controls(23, 6, 300, "mixed", probs=True, L=64)]
    accepted = 0
    for i, case in enumerate(cases):
        T = case.tensors["logits"].shape[0]
        src, dst = tmp_path / f"in{i}", tmp_path / f"out{i}"
        _write_case(src, case)
        run = subprocess.run([str(exe), str(src), str(dst), "64"], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        raw = dst.read_bytes()
        out = np.frombuffer(raw[: 4 * T], np.int32)
        want = ref.results(case)
        if case.op == "spec_verify":
            got = {"out": out, "accepted": np.frombuffer(raw[4 * T:], np.int32)}
            assert _cmp_spec_verify(case, got, want) is None, (case.name, _cmp_spec_verify(case, got, want))
            accepted += int(got["accepted"].sum())
        else:
            assert _cmp_sample(case, out, want["out"]) is None, (case.name, _cmp_sample(case, out, want["out"]))
            if "probs" not in case.tensors:
                continue
            probs = np.frombuffer(raw[4 * T:], np.float32)
            same = out == want["out"]
            msg, _, _ = compare_close(probs[same], want["probs"][same], TOL.lookup("sample", "probs"), "probs")
            assert msg is None, (case.name, msg)
    assert accepted > 10   # the acceptance path ran, not only rejections


@pytest.mark.slow
def test_mla_decode_bf16_fast_path_on_the_cpu(tmp_path):
    """mla_decode's bf16 kernels (qlat, attn, merge_uv of backends/cuda/src/mla_decode_bf16.cuh) against a
    float64 transcription of the op, in the host emulation (tests/gpu_emu/test_mla_decode_bf16.cpp)."""
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = _build(cxx, "test_mla_decode_bf16.cpp", tmp_path / "mla_decode_bf16")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "all checks passed" in run.stdout
