"""Shared fixtures: the backends under test and the tiny DeepSeek checkpoints (made once per session)."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_checkpoints
_ROOT = Path(__file__).resolve().parents[1]

# probe verdicts of the test plugins (built fresh each session) go to a cache of the session's own,
# not the user's ~/.cache/deepinfer; child processes inherit it
os.environ.setdefault("DEEPINFER_CACHE_DIR", tempfile.mkdtemp(prefix="deepinfer-test-cache-"))

# DEEPINFER_CPU_LIB picks a library explicitly; otherwise the installed one (pip install -e .), and
# failing that a plain CMake build in the checkout
CPU_LIB_ENV = os.environ.get("DEEPINFER_CPU_LIB", "")
CPU_LIB_BUILD_DIRS = [str(_ROOT / "build/backends/cpu/libdeepinfer_cpu.so")]


def _cpu_backend():
    import deepinfer
    from deepinfer.errors import BackendLoadError

    if CPU_LIB_ENV:
        return deepinfer.loader.load_library(CPU_LIB_ENV)
    try:
        return deepinfer.get_backend("cpu")
    except (BackendLoadError, ValueError, LookupError) as e:
        for p in CPU_LIB_BUILD_DIRS:
            if Path(p).is_file():
                return deepinfer.loader.load_library(p)
        pytest.skip(f"CPU backend library not built ({e}); pip install -e . builds it, or set DEEPINFER_CPU_LIB")


@pytest.fixture(scope="session")
def cpu_backend():
    """The C CPU backend (skips with the reason when it is not built)."""
    return _cpu_backend()


@pytest.fixture(scope="session")
def cc() -> str:
    """A C compiler for the test plugins of the loader and conformance tests (skips without one)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))
    from plugin_build import c_compiler

    path = c_compiler()
    if path is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH: cannot build test plugins")
    return path


_BACKENDS: dict = {}


@pytest.fixture(scope="module")
def torch_one_thread():
    """The transformers oracles are tiny: one torch thread is ~10x faster than two contending ones
    on a loaded 2-core runner. Model test modules opt in with pytestmark; restored afterwards."""
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# DEEPINFER_TEST_BACKENDS=cuda DEEPINFER_CUDA_LIB=... runs the model tests on a device library
# (backends/cuda/device.sh certify does this on the GPU machine)
MODEL_BACKENDS = os.environ.get("DEEPINFER_TEST_BACKENDS", "reference,cpu").split(",")


@pytest.fixture(scope="session", params=MODEL_BACKENDS)
def model_backend(request):
    """Each model test runs on the reference backend and on the CPU library (skipped if not built)."""
    name = request.param
    if name not in _BACKENDS:
        import deepinfer

        if name == "reference":
            _BACKENDS[name] = deepinfer.get_backend("reference")
        elif name == "cpu":
            _BACKENDS[name] = _cpu_backend()
        else:
            lib = os.environ.get(f"DEEPINFER_{name.upper()}_LIB")
            _BACKENDS[name] = deepinfer.loader.load_library(lib) if lib else deepinfer.get_backend(name)
    return _BACKENDS[name]


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path):
    """tiny_copy(family) -> a fresh copy of the session's tiny checkpoint, for a test to damage."""
    import shutil

    def copy(family: str) -> Path:
        src, _, _ = tiny_checkpoint(family)
        dst = tmp_path / family
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family) -> (model dir, transformers oracle, MTP block or None), cached per session."""
    import tiny_checkpoints

    made: dict = {}

    def get(family: str):
        if family not in made:
            made[family] = tiny_checkpoints.make(family, tmp_path_factory.mktemp(f"ckpt_{family}"))
        return made[family]

    return get
