"""Fixtures of the conformance tests: a C compiler, small plugins compiled from plugins/*.c against
abi/deepinfer_abi.h alone, and the CPU backend library (found, or built with CMake into a tmp dir).

DEEPINFER_CONFORMANCE_THOROUGH=1 switches the suite and the hypothesis tests to the vendor profile
(more random shapes); CI uses the quick one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from plugin_build import (ABI_DIR, ABI_V1_0_DIR, ABI_V1_1_DIR, ABI_V1_2_DIR, ABI_V1_3_DIR, ABI_V1_4_DIR, ABI_V1_5_DIR,
                          ABI_V1_6_DIR, PLUGINS, ROOT, c_compiler, compile_shared, find_cpu_lib)


@pytest.fixture(scope="session")
def plugin_factory(cc, tmp_path_factory):
    """plugin_factory(filename, abi="1.0", **defines) -> path of a compiled variant of plugins/tiny_plugin.c.

    abi="1.0" (the default) builds against the frozen 1.0 header: every library shipped before 1.1
    must keep loading and passing; abi="1.1" to "1.6" against the frozen 1.1 to 1.6 headers. abi="current" builds against abi/deepinfer_abi.h."""
    base = tmp_path_factory.mktemp("plugins")
    made: dict = {}

    def make(filename: str, src: str = "tiny_plugin.c", abi: str = "1.0", **defines) -> Path:
        key = (filename, src, abi, tuple(sorted(defines.items())))
        if key not in made:
            d = base / f"v{len(made)}"
            made[key] = compile_shared(cc, PLUGINS / src, d / filename, defines,
                                       abi_dir={"1.0": ABI_V1_0_DIR, "1.1": ABI_V1_1_DIR, "1.2": ABI_V1_2_DIR,
                                                "1.3": ABI_V1_3_DIR, "1.4": ABI_V1_4_DIR, "1.5": ABI_V1_5_DIR,
                                                "1.6": ABI_V1_6_DIR}.get(abi, ABI_DIR))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_lib(plugin_factory) -> Path:
    return plugin_factory("libdeepinfer_tiny.so")


@pytest.fixture(scope="session")
def cpu_lib(tmp_path_factory) -> Path:
    """The CPU backend: an installed/bundled/built one if there is one, else built here with CMake."""
    found = find_cpu_lib()
    if found:
        # a private copy: a build directory may be rebuilt while the suite runs
        snap = tmp_path_factory.mktemp("cpu-lib") / found.name
        shutil.copy2(found, snap)
        return snap
    if c_compiler() is None:
        pytest.skip("the CPU backend is not built and there is no C compiler to build it")
    if shutil.which("cmake") is None:
        pytest.skip("the CPU backend is not built and cmake is not installed "
                    "(cmake -S . -B /tmp/build && cmake --build /tmp/build)")
    build = tmp_path_factory.mktemp("cpu-build")
    for cmd in (["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise AssertionError(f"building the CPU backend failed: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    libs = sorted(build.rglob("libdeepinfer_cpu.so"))
    assert libs, f"the CMake build in {build} produced no libdeepinfer_cpu.so"
    return libs[0]
