"""quantize and eval-ppl edge cases: nothing a user has is replaced, outputs follow the umask, what a
killed run leaves is cleaned up, write failures say what to do, and eval-ppl of a quantized
directory measures against the checkpoint it was made from."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import cli
from deepinfer import quantizer as Q
from deepinfer.errors import EXIT_FAILURE, ConfigError, DeepinferError

MODEL = Path(__file__).resolve().parents[1] / "runtime/deepinfer/assets/deepseek-v3-nano"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from test_quantizer import make_model

    d = tmp_path_factory.mktemp("src") / "model"
    make_model(d)
    return d


def _dead_pid() -> int:
    """A pid that is certainly not running: a child that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_an_empty_dst_created_mid_run_is_not_replaced(src, tmp_path, monkeypatch):
    dst = tmp_path / "q"
    real = Q._ShardWriter.finish

    def finish_then_someone_creates_dst(self):
        out = real(self)
        dst.mkdir()                  # another user or process makes DST (empty) while we quantize
        (dst.parent / "marker").write_text("theirs")
        return out

    monkeypatch.setattr(Q._ShardWriter, "finish", finish_then_someone_creates_dst)
    with pytest.raises(ConfigError, match="appeared while quantizing"):
        Q.quantize_model(src, dst, "int8")
    assert dst.is_dir() and list(dst.iterdir()) == [], "their directory is left as it was"
    assert not list(tmp_path.glob(".q.partial-*")), "our partial output is removed"


def test_output_follows_the_umask(src, tmp_path):
    old = os.umask(0o022)
    try:
        Q.quantize_model(src, tmp_path / "q", "int8")
    finally:
        os.umask(old)
    assert (tmp_path / "q").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "q" / "config.json").stat().st_mode & 0o777 == 0o644


def test_stale_partial_directories_are_removed(src, tmp_path, capsys):
    host = socket.gethostname()
    stale = tmp_path / f".q.partial-{host}.{_dead_pid()}.0badc0de"
    live = tmp_path / f".q.partial-{host}.{os.getpid()}.0000beef"      # a run still going (this process)
    old_style = tmp_path / ".q.partial-k3j2h1"                          # an older deepinfer's: owner unknown
    for d in (stale, live, old_style):
        d.mkdir()
        (d / "shard-00000.tmp").write_bytes(b"x" * 10)
    Q.quantize_model(src, tmp_path / "q", "int8")
    err = capsys.readouterr().err
    assert not stale.exists() and "removed" in err and stale.name in err
    assert live.exists(), "a live run's directory is not touched"
    assert old_style.exists() and old_style.name in err, "an unknown owner's directory is named, not removed"


@pytest.mark.parametrize("code, rc, fragment", [
    (errno.ENOSPC, EXIT_FAILURE, "no space left"),
    (errno.EROFS, 2, "cannot write"),
    (errno.EACCES, 2, "cannot write"),
])
def test_write_failures_are_clean_errors(src, tmp_path, monkeypatch, capsys, code, rc, fragment):
    def failing_write(path, tensors, metadata=None):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(Q, "write_safetensors", failing_write)
    assert cli.main(["quantize", str(src), str(tmp_path / "q"), "--format", "int8"]) == rc
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.partial-*"))


def test_eval_ppl_of_a_quantized_directory_measures_against_its_source(tmp_path, capsys):
    model = tmp_path / "nano"
    shutil.copytree(MODEL, model)
    q = tmp_path / "nano-int8"
    assert cli.main(["quantize", str(model), str(q), "--format", "int8"]) == 0
    assert json.loads((q / "config.json").read_text())["quantization_config"]["source"]["path"] == str(model.resolve())
    args = ["eval-ppl", str(q), "--precision", "int8", "--max-tokens", "120", "--backend", "cpu"]
    capsys.readouterr()
    assert cli.main(args) == 0
    vs_source = json.loads(capsys.readouterr().out)
    assert "source checkpoint" in vs_source["baseline"] and str(model.resolve()) in vs_source["baseline"]

    shutil.rmtree(model)                       # the source is gone: the baseline says what it is instead
    assert cli.main(args) == 0
    vs_self = json.loads(capsys.readouterr().out)
    assert "is not here" in vs_self["baseline"]
    assert vs_self["ppl"] == vs_source["ppl"]
    assert vs_self["bf16_ppl"] != vs_source["bf16_ppl"]
