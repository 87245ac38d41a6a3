"""deepinfer: a vertical inference engine for the DeepSeek model family with a vendor-neutral kernel ABI.

    import deepinfer
    print(deepinfer.run("def fibonacci(n):"))            # the embedded default model
    engine = deepinfer.load("deepseek-ai/DeepSeek-V2-Lite", config={"backend": "cpu"})   # or a directory
    for piece in engine.stream("hello"): print(piece, end="")
"""
import importlib as _importlib
import os as _os

from ._version import __version__
from .errors import (
    BackendCallError,
    BackendLoadError,
    CheckpointError,
    ConfigError,
    DeepinferError,
    InputError,
    InputTypeError,
    UnsupportedOpError,
)

# get_backend, candidates and the loader module are bound on first use: the loader brings numpy and
# the reference backend, and `import deepinfer` stays light for what imports only the package (the
# probe child, which every library probed pays for, and the command line's --help)
_FROM_LOADER = ("get_backend", "candidates", "loader")


def __getattr__(name: str):
    if name in _FROM_LOADER:
        loader = _importlib.import_module(".loader", __name__)   # not `from . import`: it asks this hook again
        return loader if name == "loader" else getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_FROM_LOADER))


def load(model=None, config=None, **overrides):
    """An engine for repeated generation (see deepinfer.engine.Engine). `model`: a directory, a
    Hugging Face hub id (`deepseek-ai/DeepSeek-V2-Lite`; config `revision` picks a branch, tag or
    commit) or None for the embedded model."""
    from .engine import Engine

    return Engine.from_pretrained(model, config=config, **overrides)


def run(model=None, prompt=None, config=None, **options) -> str:
    """Generate text for one prompt and return it; `options` are sampling options
    (max_new_tokens, temperature, top_k, top_p, seed, stop).

    `run("def f():")` runs the embedded model on that prompt; `run(model, prompt)` a directory or hub
    id. A model directory without a prompt is an error rather than a prompt made of its path."""
    if prompt is None:
        if isinstance(model, str) and not _looks_like_model(model):
            model, prompt = None, model
        else:
            raise ConfigError(f"deepinfer.run({model!r}) has no prompt; call deepinfer.run(model, prompt)")
    return load(model, config=config).generate(prompt, **options)


def _looks_like_model(s: str) -> bool:
    return _os.path.isdir(_os.path.expanduser(s))


__all__ = [
    "__version__", "run", "load", "get_backend", "candidates",
    "DeepinferError", "InputError", "InputTypeError", "BackendLoadError", "BackendCallError", "UnsupportedOpError",
    "CheckpointError", "ConfigError",
]
