"""runtime/native/expert_reader.c under load: tests/native/expert_reader_stress.c drives 300 loads on 8
native readers with a fifth of them given up, once built with ThreadSanitizer (a data race or a lock
order problem fails the run) and once with AddressSanitizer and UBSan (a use after free of a job, an
overflow of its arrays). Where the compiler lacks a sanitizer, that build is skipped; a plain build
always runs."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "tests" / "native" / "expert_reader_stress.c", ROOT / "runtime" / "native" / "expert_reader.c"]


@pytest.mark.parametrize("flags", [[], ["-fsanitize=thread"], ["-fsanitize=address,undefined"]],
                         ids=["plain", "tsan", "asan-ubsan"])
def test_native_readers_under_load(flags, cc, tmp_path):
    exe = tmp_path / "stress"
    build = subprocess.run([cc, "-g", "-O1", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pthread", *flags,
                            *map(str, SOURCES), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
        if flags:
            pytest.skip(f"{cc} cannot build with {' '.join(flags)}: {build.stderr[-300:]}")
        raise AssertionError(build.stderr)
    env = {"TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1"}
    if flags:       # a sanitizer's runtime may not start on this machine (kernel memory layout, ptrace)
        probe_src = tmp_path / "probe.c"
        probe_src.write_text("int main(void) { return 0; }\n")
        probe = tmp_path / "probe"
        ok = subprocess.run([cc, *flags, str(probe_src), "-o", str(probe)], capture_output=True).returncode == 0 \
            and subprocess.run([str(probe)], capture_output=True, env=env, timeout=60).returncode == 0
        if not ok:
            pytest.skip(f"a program built with {' '.join(flags)} does not run on this machine")
    run = subprocess.run([str(exe), str(tmp_path / "experts.bin")], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "300 loads, 0 failures" in run.stdout
