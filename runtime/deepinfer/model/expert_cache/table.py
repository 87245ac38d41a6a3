"""The expert cache's expert -> slot table on the device, one row per MoE layer (-1: not resident).

A streamed layer's moe_experts takes the router's topk_ids as they are and the layer's row
(ABI 1.5 expert_map: expert -> descriptor): the kernel finds each expert's slot itself and skips,
flagging it in `misses`, a pair whose expert is not there. moe_experts computes each (token, k) pair
independently of how experts are numbered and sums the k contributions of a token in k order
(abi/README.md section 8), so the output is bit-identical to the eager model's.
"""
from __future__ import annotations

from ...tensor import Tensor
from .layout import host_buffer


class SlotTable:
    """The table on the device (`maps` [n_moe, E] int32) and its host copy (pinned on a device),
    which rows are sent from, each send on the working stream. `clean`: the device rows hold the
    layers' own tables, no overflow entries (a paused step's rows may name the overflow)."""

    def __init__(self, backend, host_memory: bool, n_moe: int, E: int):
        self.backend, self.host_memory, self.E = backend, host_memory, E
        self.maps = backend.empty((n_moe, E), "int32", fill=-1)
        self._pinned = None
        if host_memory:
            self.host = self.maps.numpy()
        else:
            h = host_buffer(backend, n_moe * E * 4)
            self._pinned = Tensor(h.buffer, (n_moe, E), "int32", None, h.offset)
            self.host = self._pinned.numpy()
        self._sends: dict = {}           # layer pos (or "all") -> (its copy, bound once; the stream)
        self.clean = True

    def row(self, pos: int) -> Tensor:
        """Layer pos's row on the device (StreamedLayer.expert_map)."""
        return self.maps.narrow(0, pos, 1).view(self.E)

    def send(self, pos) -> None:
        """The host rows of the table (one layer's, or "all") to the device, on the working stream."""
        if self.host_memory:
            return
        stream = self.backend.stream
        send = self._sends.get(pos)
        if send is None or send[1] is not stream:
            dev, host = (self.maps, self._pinned) if pos == "all" else \
                (self.maps.narrow(0, pos, 1), self._pinned.narrow(0, pos, 1))
            send = self._sends[pos] = (self.backend.prepare_copy(dev.byte_view(), host.byte_view()), stream)
        send[0]()

    def restore(self, layers: list) -> None:
        """Every row back to its layer's own table, unless they are already (before a pause-free step)."""
        if not self.clean:
            # the tables as they are: the paused steps' rows may name the overflow, which holds
            # another layer's experts by now
            for L in layers:
                self.host[L.pos] = L.slots.table
            self.send("all")
            self.clean = True
