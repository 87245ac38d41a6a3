"""Exceptions that carry what went wrong and what to do about it."""


class DeepinferError(Exception):
    """Base class of every error deepinfer raises on purpose."""


class BackendLoadError(DeepinferError):
    """A backend library was found but cannot be used (not a .so, wrong ABI, missing symbol...)."""


class BackendCallError(DeepinferError):
    """A backend op returned a non-OK status; the message is the library's last_error."""

    def __init__(self, op: str, status: int, status_name: str, message: str):
        self.op, self.status, self.status_name, self.message = op, status, status_name, message
        super().__init__(f"{op}: {status_name}: {message}")


class UnsupportedOpError(BackendCallError):
    """The backend does not implement this op (NULL entry) or this combination of formats."""


class CheckpointError(DeepinferError):
    """A model directory is missing something or holds something malformed."""


class ConfigError(DeepinferError):
    """An engine config (JSON or dict) has unknown keys or bad values."""


class CacheFullError(DeepinferError):
    """No free KV cache blocks left, or a sequence longer than max_seq_len (raise kv_cache_tokens /
    max_seq_len or finish sequences)."""
