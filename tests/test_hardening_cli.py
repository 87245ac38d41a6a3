"""Hostile input to the `deepinfer` command and the Python API: each case gets a clean message that
says what is wrong, the usage/input exit code (2), and never a traceback or a silent rc 0.

The table is data: (id, argv, stdin, files to create, expected exit code, fragment of stderr).
Cases that fail before a model loads run in-process through cli.main; the few that need a real
process (argv bytes, a closed pipe) run as subprocesses.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import cli
from deepinfer.errors import EXIT_FAILURE, EXIT_USAGE, ConfigError, InputError, InputTypeError

MODEL = Path(__file__).resolve().parents[1] / "runtime/deepinfer/assets/deepseek-v3-nano"
BACKEND = ["--backend", "reference"]      # always present; the embedded model loads in about a second


def _files(tmp: Path) -> dict:
    """Named inputs the cases refer to as {name}."""
    (tmp / "dir").mkdir()
    made = {"dir": tmp / "dir", "missing": tmp / "missing.json", "model": MODEL}
    for name, data in {
        "kv0": {"kv_cache_tokens": 0}, "kvneg": {"kv_cache_tokens": -5}, "fallback_no": {"fallback": "no"},
        "batch_true": {"max_batch": True}, "seq_float": {"max_seq_len": 256.7}, "seq_str": {"max_seq_len": "256"},
        "frac_nan": {"kv_cache_memory_fraction": float("nan")}, "spec_str": {"speculative": "mtp"},
        "list": [1, 2], "huge_kv": {"backend": "reference", "kv_cache_tokens": 1 << 39},
        "unknown": {"max_btach": 2},
        "huge_seq": {"backend": "reference", "max_seq_len": 1 << 24, "kv_block_size": 1 << 16},
    }.items():
        made[name] = tmp / f"{name}.json"
        made[name].write_text(json.dumps(data))
    made["deep"] = tmp / "deep.json"
    made["deep"].write_text("[" * 100000 + "]" * 100000)
    made["latin1"] = tmp / "latin1.json"
    made["latin1"].write_bytes(b'{"backend": "caf\xe9"}')
    made["empty_txt"] = tmp / "empty.txt"
    made["empty_txt"].write_text("  \n")
    made["binary_txt"] = tmp / "binary.txt"
    made["binary_txt"].write_bytes(b"\x7fELF\x00\x01\x02")
    made["a_file"] = tmp / "a_file"
    made["a_file"].write_text("not a directory")
    return made


CASES = [
    # id, argv, stdin, rc, stderr fragment
    ("run-no-prompt", ["run"], "", EXIT_USAGE, "standard input was empty"),
    ("run-dir-no-prompt", ["run", "{model}"], "", EXIT_USAGE, "standard input was empty"),
    ("run-max-new-neg", ["run", "x", "--max-new-tokens", "-1"], None, EXIT_USAGE, "must be at least 0"),
    ("run-max-new-str", ["run", "x", "--max-new-tokens", "8.5"], None, EXIT_USAGE, "not an integer"),
    ("run-temp-nan", ["run", "x", "--temperature", "nan", *BACKEND], None, EXIT_USAGE, "temperature must be a finite"),
    ("run-top-k-huge", ["run", "x", "--top-k", "1000000000000", *BACKEND], None, EXIT_USAGE, "top_k must be between"),
    ("run-top-p-0", ["run", "x", "--top-p", "0", *BACKEND], None, EXIT_USAGE, "top_p must be in (0, 1]"),
    ("run-surrogate", ["run", "ab\udcff"], None, EXIT_USAGE, "0xff (not valid UTF-8)"),
    ("cfg-missing", ["run", "x", "--config", "{missing}"], None, EXIT_USAGE, "not found"),
    ("cfg-dir", ["run", "x", "--config", "{dir}"], None, EXIT_USAGE, "is a directory"),
    ("cfg-deep", ["run", "x", "--config", "{deep}"], None, EXIT_USAGE, "JSON nested too deeply"),
    ("cfg-latin1", ["run", "x", "--config", "{latin1}"], None, EXIT_USAGE, "not UTF-8"),
    ("cfg-list", ["run", "x", "--config", "{list}"], None, EXIT_USAGE, "must hold a JSON object"),
    ("cfg-unknown", ["run", "x", "--config", "{unknown}"], None, EXIT_USAGE, "'max_btach'"),
    ("cfg-kv0", ["run", "x", "--config", "{kv0}"], None, EXIT_USAGE, "kv_cache_tokens must be between 1"),
    ("cfg-kvneg", ["run", "x", "--config", "{kvneg}"], None, EXIT_USAGE, "kv_cache_tokens must be between 1"),
    ("cfg-fallback-no", ["run", "x", "--config", "{fallback_no}"], None, EXIT_USAGE, "fallback must be true or false"),
    ("cfg-batch-true", ["run", "x", "--config", "{batch_true}"], None, EXIT_USAGE, "max_batch must be an integer"),
    ("cfg-seq-float", ["run", "x", "--config", "{seq_float}"], None, EXIT_USAGE, "max_seq_len must be an integer"),
    ("cfg-seq-str", ["run", "x", "--config", "{seq_str}"], None, EXIT_USAGE, "max_seq_len must be an integer"),
    ("cfg-frac-nan", ["run", "x", "--config", "{frac_nan}"], None, EXIT_USAGE, "kv_cache_memory_fraction"),
    ("cfg-spec-str", ["run", "x", "--config", "{spec_str}"], None, EXIT_USAGE, "speculative must be an object"),
    ("cfg-seq-too-big", ["run", "x", "--config", "{huge_seq}"], None, EXIT_USAGE, "lower max_seq_len"),
    ("cfg-kv-too-big", ["run", "x", "--config", "{huge_kv}"], None, EXIT_USAGE, "tokens fit"),
    ("run-prompt-too-long", ["run", "word " * 5000, "--max-new-tokens", "4", *BACKEND], None, EXIT_USAGE,
     "> max_seq_len"),
    ("ppl-window-0", ["eval-ppl", "--window", "0"], None, EXIT_USAGE, "must be at least 2"),
    ("ppl-window-1", ["eval-ppl", "--window", "1"], None, EXIT_USAGE, "must be at least 2"),
    ("ppl-window-neg", ["eval-ppl", "--window", "-4"], None, EXIT_USAGE, "must be at least 2"),
    ("ppl-max-0", ["eval-ppl", "--max-tokens", "0"], None, EXIT_USAGE, "must be at least 2"),
    ("ppl-max-neg", ["eval-ppl", "--max-tokens", "-1"], None, EXIT_USAGE, "must be at least 2"),
    ("ppl-text-missing", ["eval-ppl", "--text", "{missing}"], None, EXIT_USAGE, "no such file"),
    ("ppl-text-dir", ["eval-ppl", "--text", "{dir}"], None, EXIT_USAGE, "is a directory"),
    ("ppl-text-empty", ["eval-ppl", "--text", "{empty_txt}"], None, EXIT_USAGE, "is empty"),
    ("ppl-text-binary", ["eval-ppl", "--text", "{binary_txt}"], None, EXIT_USAGE, "binary file"),
    ("quantize-dst-exists", ["quantize", "{model}", "{dir}", "--format", "int8"], None, EXIT_USAGE, "already exists"),
    ("quantize-dst-under-file", ["quantize", "{model}", "{a_file}/q", "--format", "int8"], None, EXIT_USAGE,
     "cannot write"),
    ("quantize-calibration-dir", ["quantize", "{model}", "{dir}/q", "--format", "int4", "--calibration", "{dir}"],
     None, EXIT_USAGE, "is a directory"),
    ("quantize-calibration-binary", ["quantize", "{model}", "{dir}/q", "--format", "int4", "--calibration",
                                     "{binary_txt}"], None, EXIT_USAGE, "binary file"),
    ("serve-port", ["serve", "--port", "99999"], None, EXIT_USAGE, "between 0 and 65535"),
    ("serve-drain", ["serve", "--drain-timeout", "-1"], None, EXIT_USAGE, "seconds >= 0"),
    ("serve-body", ["serve", "--max-body-bytes", "0"], None, EXIT_USAGE, "at least 1"),
    ("quantize-src-missing", ["quantize", "{dir}/nope", "{dir}/q", "--format", "int8"], None, EXIT_USAGE,
     "does not exist"),
    ("backend-unknown-name", ["run", "x", "--backend", "bogus"], None, EXIT_USAGE, "no libdeepinfer_bogus.so"),
    ("backend-missing-path", ["run", "x", "--backend", "{dir}/libdeepinfer_x.so"], None, EXIT_USAGE, "no such file"),
    ("bad-subcommand", ["frobnicate"], None, EXIT_USAGE, "invalid choice"),
]


def _run_main(argv, stdin, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((stdin or "").encode())))
    try:
        rc = cli.main(argv)
    except SystemExit as e:     # argparse's own usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_cli_input(case, tmp_path, monkeypatch, capsys):
    _, argv, stdin, want_rc, fragment = case
    files = _files(tmp_path)
    argv = [a.format(**files) for a in argv]
    rc, out, err = _run_main(argv, stdin, monkeypatch, capsys)
    assert rc == want_rc, (rc, err)
    assert fragment in err, err
    assert "Traceback" not in err
    if argv[0] == "run":
        assert out == "", "nothing is printed before the input is checked"


def test_verbose_after_the_command(monkeypatch, capsys):
    rc, out, _ = _run_main(["backends", "-v"], None, monkeypatch, capsys)
    assert rc == 0 and "ops:" in out                 # -v lists each backend's ops


@pytest.mark.parametrize("argv, verbose", [
    (["-v", "run", "x"], True), (["run", "x", "-v"], True), (["run", "x"], False),
    (["-v", "conformance", "reference"], True), (["conformance", "reference", "--verbose"], True),
    (["conformance", "reference"], False), (["-v", "eval-ppl"], True), (["quantize", "a", "b", "--format", "int8", "-v"], True),
])
def test_verbose_before_or_after_every_command(argv, verbose):
    assert cli.build_parser().parse_args(argv).verbose is verbose


def test_eval_ppl_shows_progress_on_a_terminal(monkeypatch, capsys):
    from deepinfer import evaluate

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert evaluate._progress_bar("bf16") is None          # stderr is captured: not a terminal, no bar
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    show = evaluate._progress_bar("bf16")
    show(512, 1024)
    show(1024, 1024)
    assert term.getvalue() == ("\rdeepinfer eval-ppl: bf16: 512/1024 tokens (50%)"
                               "\rdeepinfer eval-ppl: bf16: 1024/1024 tokens (100%)\n")


def test_run_reads_the_prompt_from_stdin_for_a_model_directory(monkeypatch, capsys):
    rc, out, err = _run_main(["run", str(MODEL), "--max-new-tokens", "2", *BACKEND], "def f(", monkeypatch, capsys)
    assert rc == 0, err
    assert out.startswith("def f(")


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1] / "runtime")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_undecodable_argv_bytes():
    r = subprocess.run([sys.executable, "-m", "deepinfer.cli", "run", b"caf\xe9 \xff"], capture_output=True,
                       env=_env(), timeout=120)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == EXIT_USAGE, err
    assert "not valid UTF-8" in err and "Traceback" not in err


def test_closed_pipe_ends_quietly():
    """`deepinfer run ... | head -c 1`: the reader goes away; no traceback, the SIGPIPE status."""
    p = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "run", "def f(", "--max-new-tokens", "300",
                          "--backend", "reference"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=300)
    assert rc == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err


# ---------------------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def engine():
    import deepinfer

    return deepinfer.load(config={"backend": "reference", "max_seq_len": 256, "kv_cache_tokens": 64,
                                  "max_batch": 2})


API_CASES = [
    # id, call, expected error class, message fragment
    ("batch-of-a-str", lambda e: e.generate_batch("abc"), InputTypeError, "list of prompts"),
    ("generate-ids-list", lambda e: e.generate([1, 2]), InputTypeError, "str prompt"),
    ("prompt-of-floats", lambda e: e.generate_ids([[1.5, 2]]), InputTypeError, "integers only"),
    ("prompt-of-bools", lambda e: e.generate_ids([[True]]), InputTypeError, "integers only"),
    ("prompt-surrogate", lambda e: e.generate("a\ud800"), ConfigError, "lone surrogate"),
    ("seed-str", lambda e: e.generate("x", seed="abc"), ConfigError, "seed must be an integer"),
    ("top-k-float", lambda e: e.generate("x", top_k=1e12), ConfigError, "top_k must be an integer"),
    ("max-new-str", lambda e: e.generate("x", max_new_tokens="8"), ConfigError, "max_new_tokens must be an integer"),
    ("stop-non-str", lambda e: e.generate("x", stop=[1, None]), ConfigError, "stop must hold strings"),
    ("temp-nan", lambda e: e.generate("x", temperature=float("nan")), ConfigError, "finite"),
    ("temp-huge-int", lambda e: e.generate("x", temperature=10**400), ConfigError, "finite"),
    ("n-zero", lambda e: e.add_request("x", n=0), ConfigError, "n must be between 1"),
    ("kv-too-small", lambda e: e.generate("x", max_new_tokens=100), ConfigError, "whole KV cache holds 64"),
    ("stream-checks-eagerly", lambda e: e.stream("x", max_new_tokens=100), ConfigError, "whole KV cache"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_hostile_api_input(engine, case):
    _, call, cls, fragment = case
    with pytest.raises(cls, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(engine)
    assert not engine.has_unfinished()       # nothing half-added stays behind


def test_run_without_a_prompt_is_an_error():
    import deepinfer

    with pytest.raises(InputError, match="has no prompt"):
        deepinfer.run(str(MODEL))


def test_errors_carry_their_exit_codes():
    from deepinfer.errors import BackendCallError, CheckpointError, DeepinferError

    assert InputError("x").exit_code == CheckpointError("x").exit_code == ConfigError("x").exit_code == EXIT_USAGE
    assert DeepinferError("x").exit_code == BackendCallError("op", 1, "E", "m").exit_code == EXIT_FAILURE
    assert isinstance(InputTypeError("x"), TypeError) and isinstance(ConfigError("x"), ValueError)


def test_listing_backends_does_not_import_ml_dtypes():
    """ml_dtypes costs 0.5-1.6 s to import: --help, backends and argument errors run without it."""
    code = ("import sys; from deepinfer import cli; rc = cli.main(['backends']); "
            "assert rc == 0; assert 'ml_dtypes' not in sys.modules, 'ml_dtypes was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr


def test_serve_on_a_taken_port_fails_with_status_1():
    """uvicorn says why and exits 3; deepinfer adds its own line and the failure status."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port), "--backend",
                            "reference"], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == EXIT_FAILURE, r.stderr
    assert "could not start" in r.stderr and "Traceback" not in r.stderr
