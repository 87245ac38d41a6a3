"""Level L4, the collectives across ranks (deepinfer/conformance/multi_rank.py, an mpirun job): the CPU
library passes `deepinfer conformance LIB --ranks 2` and its certificate holds the level; a library
whose communicators hold one rank fails it at comm_create, at once and saying why; a library without
communicators is "unsupported" without a job being started; a wrong result on one rank fails the check
it is in, a rank that gives up before a collective ends the job instead of leaving its peer waiting,
and a job that hangs is stopped at its timeout. bench_comm.py --check runs the same checks.
The tests that start ranks skip when mpirun or mpi4py is missing."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer import cli
from deepinfer.conformance import MULTI_RANK, multi_rank, multi_rank_launch, run_conformance, summary

ROOT = Path(__file__).resolve().parents[2]

# one rank of the level whose rank 1 misbehaves on purpose (argv[1]: how), around multi_rank.main
WRAPPER = '''
import os, sys, time
from deepinfer.conformance import multi_rank as M

MODE = sys.argv.pop(1)
real_open = M.open_backend


def open_backend(spec, local_rank, threads=1):
    be = real_open(spec, local_rank, threads)
    if os.environ.get("OMPI_COMM_WORLD_RANK") != "1":
        return be
    real_call = be.call

    def call(op, **kw):
        if op == "all_gather" and MODE == "give-up":   # rank 0 is then waiting in the collective
            raise RuntimeError("rank 1 gives up before all_gather")
        if op == "all_gather" and MODE == "hang":
            time.sleep(3600)
        real_call(op, **kw)
        if op == "all_reduce" and MODE == "wrong" and kw["out"].numel:
            a = be.to_numpy(kw["out"])
            a.reshape(-1)[0] += 1
            be.write(kw["out"], a)

    be.call = call
    return be


M.open_backend = open_backend
sys.exit(M.main())
'''


@pytest.fixture(scope="module")
def mpi():
    why = multi_rank_launch.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def tinycomm(plugin_factory):
    """tiny with communicators of one rank only (comm_create of nranks > 1 is UNIMPLEMENTED)."""
    return plugin_factory("libdeepinfer_tinycomm.so", abi="current", TEST_NAME='"tinycomm"', TEST_COMM=None)


def _conformance(capsys, *argv) -> tuple[int, str]:
    rc = cli.main(["conformance", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _by_case(level: dict) -> dict:
    return {r["case"]: r for r in level["results"]}


def test_cpu_library_passes_across_two_ranks(mpi, cpu_lib, tmp_path, capsys):
    out = tmp_path / "cert.json"
    rc, text = _conformance(capsys, cpu_lib, "--quick", "--ranks", 2, "--out", out)
    assert rc == 0, text
    cert = json.loads(out.read_text())
    assert cert["passed"] and cert["ranks"] == 2
    assert cert["levels_run"] == ["L0", "L1", "L2", "L3", MULTI_RANK]
    l4 = cert["levels"][MULTI_RANK]
    assert l4["passed"] and f"{MULTI_RANK}  PASS" in text and "(2 ranks)" in text
    checks = _by_case(l4)
    assert list(checks) == list(multi_rank.CHECK_OPS)
    for name in ("load", "comm_create", "all_reduce", "all_gather", "all_to_all", "expert_parallel", "graph",
                 "bad_counts", "comm_destroy"):   # the CPU library has graphs and is a host library: nothing skipped
        assert checks[name]["status"] == "pass", checks[name]
        assert checks[name]["ranks"] == {"0": "pass", "1": "pass"} and checks[name]["format"] == "2 ranks"
    assert checks["all_reduce"]["op"] == "all_reduce" and checks["all_reduce"]["what"]


def test_one_rank_communicators_fail_at_comm_create(mpi, tinycomm, tmp_path, capsys):
    t0 = time.monotonic()
    rc, text = _conformance(capsys, tinycomm, "--level", MULTI_RANK, "--ranks", 2, "--out", tmp_path / "c.json")
    assert rc == 1, text
    assert time.monotonic() - t0 < 60     # every rank fails alike: no rank waits for a stall timeout
    cert = json.loads((tmp_path / "c.json").read_text())
    assert cert["levels_run"] == [MULTI_RANK] and not cert["passed"]
    checks = _by_case(cert["levels"][MULTI_RANK])
    assert checks["load"]["status"] == "pass"
    create = checks["comm_create"]
    assert create["status"] == "fail" and create["ranks"] == {"0": "fail", "1": "fail"}
    assert "UNIMPLEMENTED" in create["message"] and "nranks=2" in create["message"], create
    assert all(checks[c]["status"] == "skipped" and "no communicator" in checks[c]["message"]
               for c in ("all_reduce", "all_gather", "all_to_all", "comm_destroy"))
    assert "x comm_create" in text and "UNIMPLEMENTED" in text


def test_a_library_without_communicators_is_unsupported(tiny_lib):
    cert = run_conformance(str(tiny_lib), levels=(), ranks=2)
    assert cert["levels_run"] == [MULTI_RANK]
    (res,) = cert["levels"][MULTI_RANK]["results"]
    assert res["status"] == "unsupported" and "has no communicators" in res["message"], res
    assert not cert["passed"], summary(cert)   # nothing was certified


def test_a_wrong_sum_on_one_rank_fails_all_reduce(mpi, cpu_lib, tmp_path):
    wrapper = tmp_path / "l4_wrapper.py"
    wrapper.write_text(WRAPPER)
    res = multi_rank_launch.run_l4(str(cpu_lib), 2, timeout=120, command=[sys.executable, str(wrapper), "wrong"])
    checks = {r["case"]: r for r in res}
    bad = checks["all_reduce"]
    assert bad["status"] == "fail" and bad["ranks"] == {"0": "pass", "1": "fail"}, bad
    assert "rank 1: all_reduce" in bad["message"] and "the ranks got different results" in bad["message"]
    assert all(r["status"] == "pass" for name, r in checks.items() if name != "all_reduce"), res


def test_a_rank_that_gives_up_ends_the_job(mpi, cpu_lib, tmp_path):
    """Rank 1 raises before all_gather while rank 0 waits in it: rank 1 waits stall_timeout for its peer,
    then ends the job; the check is an error that says so, the later ones are not run."""
    wrapper = tmp_path / "l4_wrapper.py"
    wrapper.write_text(WRAPPER)
    t0 = time.monotonic()
    res = multi_rank_launch.run_l4(str(cpu_lib), 2, timeout=120, stall_timeout=2,
                                   command=[sys.executable, str(wrapper), "give-up"])
    assert time.monotonic() - t0 < 60
    checks = {r["case"]: r for r in res}
    assert [checks[c]["status"] for c in ("load", "comm_create", "all_reduce")] == ["pass"] * 3
    err = checks["all_gather"]
    assert err["status"] == "error", err
    assert "rank 1 ended the job" in err["message"] and "rank 1 gives up before all_gather" in err["message"]
    assert checks["all_to_all"]["status"] == "skipped" and "all_gather" in checks["all_to_all"]["message"]


def test_a_hanging_job_is_stopped_at_its_timeout(mpi, cpu_lib, tmp_path):
    wrapper = tmp_path / "l4_wrapper.py"
    wrapper.write_text(WRAPPER)
    t0 = time.monotonic()
    res = multi_rank_launch.run_l4(str(cpu_lib), 2, timeout=8, command=[sys.executable, str(wrapper), "hang"])
    assert time.monotonic() - t0 < 40
    checks = {r["case"]: r for r in res}
    assert checks["all_reduce"]["status"] == "pass"
    assert checks["all_gather"]["status"] == "error" and "ran past 8 s" in checks["all_gather"]["message"]
    # nothing of the job is left behind
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(wrapper) not in ps, ps


@pytest.mark.parametrize("argv, says", [
    (["--ranks", "1"], "at least 2 ranks"),
    (["--level", "L4"], "--ranks N"),
    (["--level", "L5", "--ranks", "2"], "unknown level"),
])
def test_usage_errors(tiny_lib, capsys, argv, says):
    rc, text = _conformance(capsys, tiny_lib, "--no-out", *argv)
    assert rc == 2 and says in text, text


def test_missing_mpi_is_a_usage_error(tiny_lib, capsys, monkeypatch):
    # the command line's check lives in levels.py (light, for the parser); patched where cli.py looks it up
    monkeypatch.setattr("deepinfer.conformance.cli.unavailable", lambda: "several ranks need Open MPI's mpirun, "
                                                                         "which is not installed: pip install "
                                                                         "'deepinfer[mpi]'")
    rc, text = _conformance(capsys, tiny_lib, "--no-out", "--ranks", "2")
    assert rc == 2 and "--ranks 2: several ranks need Open MPI's mpirun" in text, text


def test_bench_comm_runs_the_same_checks(mpi, cpu_lib):
    from deepinfer.loader import child_env
    from deepinfer.parallel.launch import mpirun_argv, mpirun_env

    cmd = mpirun_argv(2, [sys.executable, str(ROOT / "benchmarks" / "bench_comm.py"), "--backend", str(cpu_lib),
                          "--check-only"])
    r = subprocess.run(cmd, env=mpirun_env(child_env()), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks: all passed" in r.stdout
    for name in ("comm_create", "all_reduce", "expert_parallel", "bad_counts"):
        assert any(line.startswith(name) and "PASS" in line for line in r.stdout.splitlines()), r.stdout
