"""Exceptions that carry what went wrong and what to do about it.

Two families, told apart by the exit code of the `deepinfer` command:
  InputError (exit 2)      something the user gave us is wrong: an argument, an option, a config, a
                           model directory, a prompt. The message names it and says how to fix it.
                           It is also a ValueError (InputTypeError a TypeError), so library callers
                           can catch it the Python way.
  DeepinferError (exit 1)  the input was fine but the work failed: a backend op, a library that
                           cannot be loaded, a failed certification.
Anything else escaping is a bug in deepinfer (a traceback, exit 1 from Python itself).
"""

EXIT_OK = 0
EXIT_FAILURE = 1        # the work failed (a backend, a library, a failed certificate)
EXIT_USAGE = 2          # bad input: arguments, options, config, files, prompt (argparse uses 2 too)
EXIT_INTERRUPTED = 130  # SIGINT


class DeepinferError(Exception):
    """Base class of every error deepinfer raises on purpose."""

    exit_code = EXIT_FAILURE


class InputError(DeepinferError, ValueError):
    """Something the user gave us is wrong; the message says what and what to do."""

    exit_code = EXIT_USAGE


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (a str where a list of prompts belongs, "8" for an int)."""


class BackendLoadError(DeepinferError):
    """A backend library was found but cannot be used (not a .so, wrong ABI, missing symbol...)."""


class BackendNotFoundError(BackendLoadError, InputError):
    """The backend the user named does not exist (no library of that name, no file at that path):
    a usage error, unlike a library that exists but cannot be used."""


class BackendCallError(DeepinferError):
    """A backend op returned a non-OK status; the message is the library's last_error."""

    def __init__(self, op: str, status: int, status_name: str, message: str):
        self.op, self.status, self.status_name, self.message = op, status, status_name, message
        super().__init__(f"{op}: {status_name}: {message}")


class UnsupportedOpError(BackendCallError):
    """The backend does not implement this op (NULL entry) or this combination of formats."""


class CheckpointError(InputError):
    """A model directory is missing something or holds something malformed."""


class ConfigError(InputError):
    """An engine config (JSON or dict), a request or its sampling options have unknown keys or bad values."""


class CacheFullError(DeepinferError):
    """No free KV cache blocks left, or a sequence longer than max_seq_len (raise kv_cache_tokens /
    max_seq_len or finish sequences)."""
