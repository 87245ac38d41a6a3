"""Plugins that would take down the process that loads them (a segfaulting or hanging bootstrap, a
wild pointer, a table of garbage pointers, a constructor that calls exit) are probed in a child
process and rejected with a reason; the probe verdicts are cached; the conformance suite times out
a hanging op, refuses bad requests before running anything and never passes a run where no check ran.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import loader
from deepinfer.conformance import run_conformance, summary
from deepinfer.conformance.runner import NO_CHECK_RAN
from deepinfer.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, BackendLoadError, InputError

# kind -> (tiny_plugin.c flag, what the reason says)
BROKEN = {
    "segfault": ("TEST_BOOTSTRAP_SEGFAULT", "crashed with SIGSEGV while being probed, in deepinfer_plugin_info()"),
    "wild": ("TEST_BOOTSTRAP_WILD", "crashed with SIGSEGV while being probed, in deepinfer_plugin_info()"),
    "garbage": ("TEST_API_GARBAGE", "crashed with SIGSEGV while being probed, in its self-test"),
    "exit": ("TEST_CONSTRUCTOR_EXIT", "its constructor exited the process with status 3"),
    "hang": ("TEST_BOOTSTRAP_HANG", "did not answer within 1 s"),
}
CRASHERS = ["segfault", "wild", "garbage", "exit"]


@pytest.fixture(scope="module")
def broken(plugin_factory) -> dict:
    return {kind: plugin_factory(f"libdeepinfer_{kind}.so", **{flag: None}) for kind, (flag, _) in BROKEN.items()}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Each test its own probe cache (and a short probe timeout for the hanging bootstrap)."""
    d = tmp_path / "cache"
    monkeypatch.setenv(loader.CACHE_DIR_ENV, str(d))
    monkeypatch.setenv(loader.PROBE_TIMEOUT_ENV, "1")
    return d


@pytest.fixture
def child_probes(monkeypatch) -> list:
    """The paths probed in a child process, in order."""
    seen: list = []
    real = loader._probe_in_child

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(loader, "_probe_in_child", counting)
    return seen


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _deepinfer(*args, cwd=None, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", *map(str, args)], capture_output=True, text=True,
                          env=_env(**env), cwd=cwd, timeout=300)


# ---------------------------------------------------------------------------- the loader


@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_plugin_on_the_path_is_rejected_and_the_process_survives(broken, kind, monkeypatch):
    path = broken[kind]
    monkeypatch.setenv(loader.ENV_PATH, str(path))
    c = next(c for c in loader.candidates() if c.path == str(path))
    assert not c.ok and c.source == "env"
    assert BROKEN[kind][1] in c.reason, c.reason
    assert f"remove it from {loader.ENV_PATH} or rebuild it" in c.reason
    assert c.summary().startswith("REJECTED")


@pytest.mark.parametrize("kind", CRASHERS)
def test_load_library_of_a_broken_plugin_raises_instead_of_crashing(broken, kind):
    with pytest.raises(BackendLoadError, match=BROKEN[kind][1]):
        loader.load_library(broken[kind])


def test_a_backend_by_name_probes_only_libraries_of_that_name(broken, tiny_lib, monkeypatch, child_probes):
    monkeypatch.setenv(loader.ENV_PATH, os.pathsep.join(str(broken[k]) for k in CRASHERS) + os.pathsep + str(tiny_lib))
    be = loader.get_backend("tiny")
    try:
        assert be.name == "tiny"
    finally:
        be.close()
    assert child_probes == [tiny_lib.name]
    with pytest.raises(BackendLoadError, match=r"no libdeepinfer_nosuch.so was found.*Available: segfault, wild"):
        loader.get_backend("nosuch")
    assert child_probes == [tiny_lib.name]          # the error lists what it found without running it


def test_the_best_backend_is_chosen_around_broken_plugins(broken, tiny_lib, monkeypatch):
    monkeypatch.setenv(loader.ENV_PATH, os.pathsep.join(str(broken[k]) for k in CRASHERS) + os.pathsep + str(tiny_lib))
    be = loader.get_backend()
    try:
        assert be.name in ("tiny", "cpu")
    finally:
        be.close()


# ---------------------------------------------------------------------------- the verdict cache


def test_a_second_probe_comes_from_the_cache_and_a_changed_file_is_probed_again(broken, tiny_lib, tmp_path,
                                                                                child_probes, cache_dir):
    lib = tmp_path / "libdeepinfer_swap.so"
    lib.write_bytes(tiny_lib.read_bytes())
    assert loader.probe_isolated(lib).ok
    assert loader.probe_isolated(lib).ok
    assert child_probes == [lib.name]
    assert str(lib.resolve()) in json.loads((cache_dir / loader.CACHE_FILE).read_text())
    lib.write_bytes(broken["segfault"].read_bytes())
    c = loader.probe_isolated(lib)
    assert not c.ok and "SIGSEGV" in c.reason
    assert child_probes == [lib.name, lib.name]


def test_a_corrupt_cache_is_ignored_and_rewritten(tiny_lib, cache_dir):
    cache_dir.mkdir()
    (cache_dir / loader.CACHE_FILE).write_text("{not json")
    assert loader.probe_isolated(tiny_lib).ok
    cached = json.loads((cache_dir / loader.CACHE_FILE).read_text())
    assert cached[str(tiny_lib.resolve())]["outcome"]["facts"]["name"] == "tiny"


def test_an_unwritable_cache_dir_is_ignored(tiny_lib, tmp_path, monkeypatch, child_probes):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(loader.CACHE_DIR_ENV, str(blocker / "cache"))   # a folder cannot be made under a file
    assert loader.probe_isolated(tiny_lib).ok
    assert loader.probe_isolated(tiny_lib).ok
    assert child_probes == [tiny_lib.name, tiny_lib.name]


def test_a_timeout_is_not_cached(broken, child_probes):
    for _ in range(2):
        assert "did not answer within 1 s" in loader.probe_isolated(broken["hang"]).reason
    assert len(child_probes) == 2


# ---------------------------------------------------------------------------- the deepinfer command


def _bundled_cpu(cache_dir) -> bool:
    p = _deepinfer("backends", "--json", DEEPINFER_CACHE_DIR=cache_dir)
    assert p.returncode == 0, p.stderr
    return any(c["ok"] and c["name"] == "cpu" and c["source"] == "bundled" for c in json.loads(p.stdout))


def test_deepinfer_backends_lists_broken_plugins_as_rejected(broken, cache_dir):
    path = os.pathsep.join(str(broken[k]) for k in CRASHERS)
    p = _deepinfer("backends", DEEPINFER_BACKEND_PATH=path, DEEPINFER_CACHE_DIR=cache_dir)
    assert p.returncode == 0, p.stderr
    for k in CRASHERS:
        line = next(x for x in p.stdout.splitlines() if str(broken[k]) in x)
        assert line.startswith("REJECTED") and BROKEN[k][1] in line
    p = _deepinfer("backends", "--json", DEEPINFER_BACKEND_PATH=path, DEEPINFER_CACHE_DIR=cache_dir)
    assert p.returncode == 0 and {c["path"] for c in json.loads(p.stdout)} >= {str(broken[k]) for k in CRASHERS}


def test_deepinfer_run_works_with_broken_plugins_on_the_path(broken, cache_dir):
    if not _bundled_cpu(cache_dir):
        pytest.skip("no bundled CPU library (pip install -e . builds it)")
    path = os.pathsep.join(str(broken[k]) for k in CRASHERS)
    for backend in (["--backend", "cpu"], []):
        p = _deepinfer("run", *backend, "x", "--max-new-tokens", 2, DEEPINFER_BACKEND_PATH=path,
                       DEEPINFER_CACHE_DIR=cache_dir)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("x") and "on cpu" in p.stderr


# ---------------------------------------------------------------------------- conformance


def test_unknown_op_is_a_usage_error(tiny_lib):
    p = _deepinfer("conformance", tiny_lib, "--ops", "add,bogus", "--no-out")
    assert p.returncode == EXIT_USAGE and "unknown op(s) bogus" in p.stderr and "silu_mul" in p.stderr
    assert p.stdout == ""
    with pytest.raises(InputError, match="unknown op"):
        run_conformance(str(tiny_lib), levels=("L1",), only_ops=["bogus"])


def test_an_unclaimed_op_has_an_outcome_and_a_run_without_checks_does_not_pass(tiny_lib):
    cert = run_conformance(str(tiny_lib), levels=("L1",), only_ops=["rmsnorm"], profile="quick", isolate=False)
    assert cert["passed"] is False and cert["note"] == NO_CHECK_RAN
    [r] = cert["levels"]["L1"]["results"]
    assert r["op"] == "rmsnorm" and r["status"] == "unsupported" and "does not claim rmsnorm" in r["message"]
    assert "no check ran" in summary(cert)


def test_a_library_whose_bootstrap_crashes_fails_conformance_without_crashing_it(broken):
    cert = run_conformance(str(broken["segfault"]), levels=("L0",), profile="quick")
    assert cert["passed"] is False
    assert "crashed with SIGSEGV" in cert["library"]["load_error"]


def test_a_hung_op_times_out_and_the_run_goes_on(plugin_factory, tmp_path):
    lib = plugin_factory("libdeepinfer_hangmul.so", TEST_HANG_MUL=None, TEST_NAME='"hangmul"')
    out = tmp_path / "c.json"
    p = _deepinfer("conformance", "--quick", "--level", "L1", "--ops", "add,mul", "--check-timeout", 2, "--out", out,
                   lib)
    assert p.returncode == EXIT_FAILURE, p.stdout + p.stderr
    assert "TIMEOUT after 2 s in L1 mul" in p.stderr
    results = json.loads(out.read_text())["levels"]["L1"]["results"]
    [hung] = [r for r in results if r["status"] != "pass"]
    assert hung["case"] == "mul f32 shape=[2, 3, 5]" and hung["format"] == "timeout"
    assert hung["status"] == "error" and hung["message"].startswith("timed out after 2 s")
    # the checks after it ran in a new child
    assert {r["op"] for r in results if r["status"] == "pass"} == {"add", "mul"}
    assert sum(r["status"] == "pass" for r in results) == 25


def test_an_existing_certificate_is_only_replaced_with_force(tiny_lib, tmp_path):
    quick = ["--quick", "--level", "L1", "--ops", "add"]
    old = tmp_path / "conformance-tiny.json"          # the default name, in the working directory
    old.write_text("keep me")
    p = _deepinfer("conformance", *quick, tiny_lib, cwd=tmp_path)
    assert p.returncode == EXIT_USAGE and "exists; pass --force" in p.stderr and p.stdout == ""
    assert old.read_text() == "keep me"
    p = _deepinfer("conformance", *quick, tiny_lib, "--out", old)
    assert p.returncode == EXIT_USAGE and old.read_text() == "keep me"
    p = _deepinfer("conformance", *quick, tiny_lib, "--force", cwd=tmp_path)
    assert p.returncode == EXIT_OK, p.stdout + p.stderr
    assert json.loads(old.read_text())["passed"] is True
    assert not list(tmp_path.glob(".conformance-tiny.json*"))     # no temporary file left behind


def test_help_and_options_before_the_library(tiny_lib):
    p = _deepinfer("conformance", "--help")
    assert p.returncode == EXIT_OK and "--check-timeout" in p.stdout and "no per-check timeout" in p.stdout
    p = _deepinfer("conformance", "--quick", "--level", "L1", "--ops", "add", "--no-out", tiny_lib)
    assert p.returncode == EXIT_OK, p.stdout + p.stderr
    assert "RESULT    PASS" in p.stdout
