"""Pause-free steps of the expert cache: when a decode step may run without pauses, where such a
step records its routing, and what the host learns from that record afterwards.

Once recent steps found every expert they routed to resident and no load is in flight, a decode
step runs a plan without pauses (the runner traces it with ExpertCache.tracing(True)): the table is
on the device, so nothing needs the host until the step ends. Each layer writes its routing and
misses into a record the host reads once afterwards; the policy's bookkeeping follows from it. If
any pair missed, the step is run again with pauses (it rewrites the same cache positions, so nothing
of the failed attempt survives) and the next try waits twice as many clean steps. A step whose
experts were all in place then costs what a resident step costs, plus one small read-back.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from ...tensor import Tensor
from .layout import host_buffer

# pause-free steps start after this many paused steps that loaded nothing; each step that misses
# doubles it (up to PAUSE_FREE_AFTER_MAX), each that does not halves it again
PAUSE_FREE_AFTER = 2
PAUSE_FREE_AFTER_MAX = 256


class PauseFreeSteps:
    """The back-off (`clean` paused steps that loaded nothing in a row; a pause-free step is due
    once they reach `after`) and the records pause-free plans write their routing and misses to."""

    def __init__(self, backend, host_memory: bool, moe_layers: list, K: int, stats: dict):
        self.backend, self.host_memory = backend, host_memory
        self._moe, self.K, self.stats = moe_layers, K, stats
        self.clean = 0
        self.after = PAUSE_FREE_AFTER
        self.records: dict = {}          # rows T -> (device [2, n_moe, T, K] int32, host view, its copy)
        self.recorded: dict = {}         # rows T -> the layer positions its pause-free plans record
        stats.update(expert_pause_free_steps=0, expert_pause_free_retries=0)

    @contextlib.contextmanager
    def tracing(self, pause_free: bool):
        """While the runner traces a pause-free plan: every streamed layer's StreamedLayer.pause_free."""
        for m in self._moe:
            m.streamed.pause_free = pause_free
        try:
            yield
        finally:
            for m in self._moe:
                m.streamed.pause_free = False

    def record(self, T: int, pos: int) -> tuple:
        """(ids, misses) [T, K] int32: where layer pos of a pause-free T-row step writes its routing
        and misses, views of one record per T that the host reads with one copy (StreamedLayer.record)."""
        n = len(self._moe)
        rec = self.records.get(T)
        if rec is None:
            shape = (2, n, T, self.K)
            dev = self.backend.empty(shape, "int32", fill=0)
            if self.host_memory:
                rec = (dev, dev.numpy(), None)
            else:
                h = host_buffer(self.backend, dev.nbytes)
                host = Tensor(h.buffer, shape, "int32", None, h.offset)
                rec = (dev, host.numpy(), self.backend.prepare_copy(host.byte_view(), dev.byte_view()))
            self.records[T] = rec
            self.recorded[T] = set()
        self.recorded[T].add(pos)      # the layers a T-row pause-free plan runs (not the MTP layer's)
        rows = rec[0].view(2 * n, T, self.K)
        return (rows.narrow(0, pos, 1).view(T, self.K),
                rows.narrow(0, n + pos, 1).view(T, self.K))

    def due(self) -> bool:
        """Enough paused steps in a row loaded nothing for the next to try without pauses."""
        return self.clean >= self.after

    def paused(self, loads: int) -> None:
        """A step ran with pauses and started `loads` loads."""
        self.clean = self.clean + 1 if loads == 0 else 0

    def finish(self, T: int) -> Optional[tuple]:
        """After a pause-free step of T rows, its record read back: None if some pair missed (the
        next try then waits twice as long), else (ids [n_moe, T, K], the layer positions it ran)."""
        _, host, copy = self.records[T]
        if copy is not None:
            copy()
            self.backend.synchronize()
        ids, missed = host[0], host[1]
        if missed.any():
            self.stats["expert_pause_free_retries"] += 1
            self.after = min(2 * self.after, PAUSE_FREE_AFTER_MAX)
            self.clean = 0
            return None
        self.stats["expert_pause_free_steps"] += 1
        self.after = max(PAUSE_FREE_AFTER, self.after // 2)
        self.clean += 1
        return ids, sorted(self.recorded[T])
