"""deepinfer: a vertical inference engine for the DeepSeek model family with a vendor-neutral kernel ABI.

    import deepinfer
    print(deepinfer.run("def fibonacci(n):"))            # the embedded default model
    engine = deepinfer.load("deepseek-ai/DeepSeek-V2-Lite", config={"backend": "cpu"})   # or a directory
    for piece in engine.stream("hello"): print(piece, end="")
"""
__version__ = "0.1.0"

import os as _os

# The reference backend's source lives in backends/reference; an install maps it to
# deepinfer/reference (pyproject.toml). Running from a source tree (PYTHONPATH=runtime, as on the
# device machine) finds it through the package path instead.
_src_backends = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))),
                              "backends")
if not _os.path.isdir(_os.path.join(__path__[0], "reference")) and _os.path.isfile(
        _os.path.join(_src_backends, "reference", "__init__.py")):
    __path__.append(_src_backends)

from .errors import (  # noqa: E402
    BackendCallError,
    BackendLoadError,
    CheckpointError,
    ConfigError,
    DeepinferError,
    InputError,
    InputTypeError,
    UnsupportedOpError,
)
from .loader import candidates, get_backend  # noqa: E402


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
    import os

    return os.path.isdir(os.path.expanduser(s))


__all__ = [
    "__version__", "run", "load", "get_backend", "candidates",
    "DeepinferError", "InputError", "InputTypeError", "BackendLoadError", "BackendCallError", "UnsupportedOpError",
    "CheckpointError", "ConfigError",
]
