"""backends/cuda/device.sh, the device runner, checked without a GPU: every recipe in dry-run mode exits 0,
runs nothing and names the commands it would run; the recipe list in backends/cuda/README.md is the
runner's own."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "backends/cuda/device.sh"
README = ROOT / "backends/cuda/README.md"
COMMIT = "abc1234"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# recipe -> the invocations checked: (arguments, extra environment, words the listing must contain)
CASES = {
    "certify": [
        ([], {}, ["-m deepinfer.conformance {lib} --out {out}/conformance-cuda.json -v", "ldd {lib}",
                  "model_checks.sh cuda {lib}", "tests/test_model_oracle.py tests/test_model_precision.py",
                  "compare_greedy.py {lib}", "--activation-dtype f32", "--activation-dtype bf16"]),
        (["--thorough", "--bench"], {}, ["--thorough --out {out}/conformance-cuda.json", "bench.py {lib}"]),
    ],
    "e2e": [
        ([COMMIT, "--layers", "8"], {}, ["--ops mla_prefill,mla_decode,mla_cache_write,sample",
                                         "tests/test_model_oracle.py",
                                         f"bench_gpu_e2e.py {{lib}} --commit {COMMIT} --out-dir {{out}} --layers 8"]),
        ([COMMIT, "--ckpt-dir", "/tmp/ck"], {"E2E_BASE_LIB": "/tmp/base.so", "E2E_ORACLE": "0"},
         ["bench_gpu_e2e.py /tmp/base.so --commit base --tag _base --out-dir {out} --ckpt-dir /tmp/ck",
          f"bench_gpu_e2e.py {{lib}} --commit {COMMIT} --out-dir {{out}} --ckpt-dir /tmp/ck"]),
    ],
    "moe": [
        ([COMMIT], {}, ["--ops moe_experts --level L1", "tests/test_gpu_moe_experts_graph.py",
                        f"bench_gpu_kernels.py {{lib}} --commit {COMMIT} --out {{out}}/gpu_kernels.json"]),
    ],
    "linear": [
        ([COMMIT], {"BENCH_BUDGET_S": "100"}, ["--ops linear --level L1 --no-out -v >",
                                               "--ops linear --level L1 --no-out -v --thorough",
                                               "bench_gpu_linear.py {lib}", "--budget-s 100",
                                               "bench_gpu_prefill_profile.py {lib}"]),
    ],
    "expert-cache": [
        ([COMMIT, "nano"], {}, ["--ops moe_router,moe_experts", "tests/test_expert_cache.py tests/test_expert_cache_v4.py",
                                "bench_expert_cache.py --backend {lib}", "--tokens 256 --cold-repeats 3",
                                "runtime/native/expert_reader.c"]),
        ([COMMIT, "v2lite"], {"EC_SOURCE": "host", "EC_TOKENS": "56"},
         ["_v2lite_random.py /tmp/v2lite27 --layers 27", "--model /tmp/v2lite27", "--tokens 56", "--source host"]),
    ],
    "chunks": [
        ([COMMIT], {"EC_CHUNK_ARGS": "--chunks-mib 2 1"}, ["sweep_expert_chunks.py --backend {lib}", "--chunks-mib 2 1"]),
    ],
    "cli": [
        ([], {}, ["-m deepinfer.cli run --backend {lib}", "--speculative mtp", "--expert-cache"]),
    ],
    "speculative": [
        ([], {"SPEC_BENCH_ARGS": "--repeats 2"}, ["--ops sample,spec_verify", "tests/test_speculative.py -k cuda",
                                                   "bench_speculative.py --backend {lib}", "--repeats 2"]),
    ],
    "v4": [
        ([], {}, ["--ops hc_pre,hc_post,kv_compress", "tests/test_model_v4.py -k cuda", "tests/test_hub_configs.py"]),
        ([], {"V4_BENCH": "1", "V4_MEMCHECK": "1"}, ["bench_v4.py {lib}", "DI_CUDA_SANITIZE=1", "compute-sanitizer --tool memcheck"]),
    ],
    "dist": [
        ([], {}, ["--ops all_reduce,all_gather,all_to_all,moe_dispatch,moe_combine", "bench_comm.py --backend {lib} --check-only",
                  "DEEPINFER_NCCL_LIB=/nonexistent/libnccl.so.2"]),
        ([], {"DIST_NGPU": "2", "DIST_QUICK": "1"}, ["--ranks 2 --level L4", "-n 2", "--check --json {out}/bench_comm.json",
                                                     "--quick"]),
    ],
    "parallel": [
        (["equal"], {}, ["tests/dist_scripts/check_model.py", "--tp 2 --ep 1", "--tp 1 --ep 2", "--graphs"]),
        (["bench"], {"DIST_NGPU": "2"}, ["benchmarks/bench_parallel.py --backend {lib} --v3-layers 4"]),
    ],
    "parts": [
        ([COMMIT, "v4", "speculative", "cache_nano", "cache_v2lite", "chunks", "cli"], {"PART_TIMEOUT_cli": "45"},
         ["timeout 45 bash", "tests/test_model_v4.py", "bench_speculative.py", "tests/test_expert_cache.py",
          "--model /tmp/v2lite27", "sweep_expert_chunks.py", "-m deepinfer.cli run"]),
    ],
    "portable": [
        ([], {}, ["DI_CUDA_NO_CUB=1", "--out {out}/conformance-cuda-nocub.json --force -v"]),
    ],
}


def _env(out: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DI_CUDA", "V4_", "DIST_", "EC_", "SPEC_", "PART_", "DEEPINFER_READER"))}
    # NVCC=false: should a dry run ever run its build, it fails at once instead of compiling for minutes
    env.update(OUT=str(out), NVCC="false", **extra)
    return env


def _runner(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUNNER), *args], env=env, capture_output=True, text=True, timeout=120)


def _recipes() -> list[str]:
    r = _runner("list", env=_env(Path("/tmp")))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_script_parses():
    r = subprocess.run(["bash", "-n", str(RUNNER)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_recipe_has_a_case():
    assert sorted(_recipes()) == sorted(CASES)


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_dry_run(recipe, tmp_path):
    for i, (args, extra, words) in enumerate(CASES[recipe]):
        out = tmp_path / f"out{i}"
        # the flag on the first invocation, the variable on the others: both mean a dry run
        if i == 0:
            r = _runner(recipe, "--dry-run", *args, env=_env(out, **extra))
        else:
            r = _runner(recipe, *args, env=_env(out, DRY_RUN="1", **extra))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "dry run" in r.stdout
        built = re.search(r"build\.sh (\S+) >> ", r.stdout)
        assert built, "the library build is listed:\n" + r.stdout
        lib = built.group(1) + "/libdeepinfer_cuda.so"
        commands = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
        for w in words:
            w = w.format(lib=lib, out=out)
            assert any(w in c for c in commands), f"{recipe} {args}: no command with {w!r}:\n{r.stdout}"
        # nothing ran: no build log, no results
        assert not out.exists() or not any(p.is_file() for p in out.rglob("*")), list(out.rglob("*"))


def test_given_library_is_used_without_a_build(tmp_path):
    lib = tmp_path / "libdeepinfer_cuda.so"
    r = _runner("--dry-run", "certify", env=_env(tmp_path / "out", DI_CUDA_LIB=str(lib)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "build.sh" not in r.stdout
    assert f"-m deepinfer.conformance {lib} --out" in r.stdout


def test_unknown_recipe_and_part_fail(tmp_path):
    assert _runner("no-such-recipe", env=_env(tmp_path, DRY_RUN="1")).returncode == 2
    assert _runner("parts", COMMIT, "no_such_part", env=_env(tmp_path, DRY_RUN="1")).returncode == 1
    assert _runner("expert-cache", COMMIT, "bogus", env=_env(tmp_path, DRY_RUN="1")).returncode == 2


def test_readme_lists_the_runners_recipes():
    text = README.read_text()
    section = text.split("## Device recipes", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9-]+)`", section, flags=re.M)
    assert listed == _recipes()
