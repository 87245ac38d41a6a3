"""The fallback policy: ops a host backend lacks run on the reference backend, only when the user
asks for it (EngineConfig.fallback)."""
from __future__ import annotations

import logging

from . import abi
from .backend_base import Backend, Comm

log = logging.getLogger("deepinfer")


class FallbackBackend(Backend):
    """Runs ops the primary backend lacks on the reference backend; only when the user asks for it.

    Host backends only (the reference cannot read device memory). Every fallback is logged once.
    """

    def __init__(self, primary: Backend, reference: Backend):
        if primary.device != "cpu":
            raise ValueError("per-op fallback to the reference needs a host-memory backend")
        self.primary, self.reference = primary, reference
        self.info = primary.info
        self._warned: set[str] = set()

    def ops(self) -> list[str]:
        return sorted(set(self.primary.ops()) | set(self.reference.ops()), key=abi.OP_NAMES.index)

    def _run(self, op: str, kwargs: dict) -> None:
        if self.primary.has_op(op):
            return self.primary._run(op, kwargs)
        if op not in self._warned:
            log.warning("backend %s lacks %s: falling back to the reference backend (config fallback=true)",
                        self.primary.name, op)
            self._warned.add(op)
        self.reference._run(op, kwargs)

    # communicators are the primary's (a collective cannot fall back: the reference has its own)
    @property
    def supports_comm(self) -> bool:
        return self.primary.supports_comm

    def comm_unique_id(self) -> bytes:
        return self.primary.comm_unique_id()

    def comm_create(self, comm_id: bytes, nranks: int, rank: int) -> Comm:
        return self.primary.comm_create(comm_id, nranks, rank)

    def synchronize(self) -> None:
        self.primary.synchronize()

    def close(self) -> None:
        self.primary.close()
