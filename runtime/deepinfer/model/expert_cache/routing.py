"""A pause's routing read back to the host: the layer's topk_ids (and, with prefetch, the next layer's
router applied to this layer's residual), copied out of the plan's arena.

On a host-memory backend the pause reads them in place. On a device the layer pauses twice: right
after the router its routing is copied to pinned memory behind an event (ExpertCache.on_ids), the
shared experts run on the device while the host waits for that event and decides, and the step
stops only before moe_experts.
"""
from __future__ import annotations

import time
from typing import Optional

from ...tensor import Tensor
from .layout import host_buffer


def present(*ts) -> list:
    """A pause's routing tensors that the plan has (the prediction is absent without prefetch)."""
    return [t for t in ts if t is not None]


class RoutingReads:
    """Host views of the pause tensors (on a device: pinned copies, each copy bound once), and the
    routing sent early (on_ids) until its pause takes it. sync_seconds: time spent waiting for the
    device to reach a pause."""

    def __init__(self, backend, host_memory: bool):
        self.backend, self.host_memory = backend, host_memory
        self._views: dict = {}           # id(pause tensor) -> (tensor, its host view / pinned copy)
        self._early: Optional[tuple] = None    # (layer pos, host views): a routing send_early sent (_ids_event)
        self._ids_event = None
        self.sync_seconds = 0.0

    def _issue(self, *ts) -> list:
        """Host views of the pause tensors ts; on a device their copies are issued (not waited for)."""
        views = []
        stream = self.backend.stream
        for t in ts:
            v = self._views.get(id(t))
            if v is None or v[0] is not t or v[3] is not stream:
                if len(self._views) > 4096:   # plans retraced over a long run: drop the old entries
                    self._views.clear()
                if self.host_memory:
                    v = (t, t.numpy(), None, stream)     # the plan binds its tensors once: one view each
                else:
                    # a pinned copy, and the copy into it bound once (a pause's Python is on the GPU's
                    # critical path: the device idles from the synchronize until the next segment)
                    h = host_buffer(self.backend, t.nbytes)
                    view = Tensor(h.buffer, t.shape, t.dtype, None, h.offset)
                    v = (t, view.numpy(), self.backend.prepare_copy(view.byte_view(), t.byte_view()), stream)
                self._views[id(t)] = v
            views.append(v[1])
            if v[2] is not None:
                v[2]()
        return views

    def send_early(self, pos: int, *ts) -> None:
        """Device: the routing of layer pos is complete on the working stream: issue its copies and
        record an event behind them, without waiting (take_early waits only for that event)."""
        views = self._issue(*ts)
        if self._ids_event is None:
            self._ids_event = self.backend.create_event()
        self._ids_event.record(self.backend.stream)
        self._early = (pos, views)

    def read(self, *ts) -> list:
        """The routings of a pause (this layer's, and the next layer's prediction), copied: the
        arena reuses their bytes after the pause. The padding rows of a bucketed batch are routed and
        loaded too: which rows share an expert can change a library's blocking, and so the last bits
        of the real rows (the CPU library's does). On a device: asynchronous copies into pinned
        buffers and one synchronization for all of them."""
        views = self._issue(*ts)
        if not self.host_memory:
            t0 = time.perf_counter()
            self.backend.synchronize()
            self.sync_seconds += time.perf_counter() - t0
        return [v.copy() for v in views]

    def take_early(self, pos: int) -> list:
        """The routing send_early sent for layer pos, once its copies are done (waits for them only)."""
        at, views = self._early
        if at != pos:
            raise RuntimeError(f"expert cache: layer {pos}'s pause found the routing of layer {at} (plan order)")
        self._early = None
        t0 = time.perf_counter()
        self._ids_event.synchronize()
        self.sync_seconds += time.perf_counter() - t0
        return [v.copy() for v in views]
