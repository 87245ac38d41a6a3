"""The expert cache's memory: one expert's byte layout (its image), how many slots a capacity
gives, a layer's slots, and what the graph traces a streamed layer over.

All experts of a model share formats and shapes, so one expert's weights (gate, up, down, each with
its scales and zeros) have one byte layout, its *image* (ImageLayout). A slot holds one image. Each
MoE layer owns `slots` of them in one backend allocation (CachedLayer); one shared overflow pool
holds, for one layer at a time, the misses of a step that routes to more experts than the layer's
slots minus those it needs (a prefill touching most experts).

A streamed layer's moe_experts is traced over the layer's slot descriptors, E of them (its slots,
the shared overflow, then aliases of slot 0 that no entry names, so a library sees as many resident
experts as the eager model has and chooses the same kernels), with the router's topk_ids as they are
and the layer's row of the expert -> slot table (model.expert_cache.table).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...errors import ConfigError
from ...tensor import Quant, Tensor
from .policy import LayerSlots

ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class _Part:
    weight: int          # 0 gate, 1 up, 2 down
    kind: str            # "q", "scales" or "zeros"
    offset: int          # in the image
    nbytes: int


class ImageLayout:
    """The byte layout of one expert (gate, up, down with their scales / zeros), from a template."""

    def __init__(self, template: tuple):
        self.template = template
        self.parts: list[_Part] = []
        off = 0
        for i, w in enumerate(template):
            for kind, t in self.components(w):
                self.parts.append(_Part(i, kind, off, t.nbytes))
                off = _align(off + t.nbytes)
        self.nbytes = max(off, ALIGN)

    @staticmethod
    def components(w: Tensor) -> list:
        out = [("q", w)]
        if w.quant is not None:
            out.append(("scales", w.quant.scales))
            if w.quant.zeros is not None:
                out.append(("zeros", w.quant.zeros))
        return out

    def check(self, ws: tuple, what: str) -> None:
        """ws must have the template's formats and shapes (every expert of a model does)."""
        for w, t in zip(ws, self.template):
            a = [(k, x.shape, x.dtype.name) for k, x in self.components(w)]
            b = [(k, x.shape, x.dtype.name) for k, x in self.components(t)]
            if a != b or (w.quant is not None and tuple(w.quant.block) != tuple(t.quant.block)):
                raise ConfigError(f"{what} is stored as {w!r}, unlike the layer's first expert {t!r}: the expert "
                                  f"cache needs one format for all routed experts (load this model without it)")

    def views(self, buffer, base: int) -> tuple:
        """(gate, up, down) Tensors over an image that starts at byte `base` of `buffer`."""
        out = []
        for i, t in enumerate(self.template):
            comps = {p.kind: p for p in self.parts if p.weight == i}

            def at(kind, x):
                return Tensor(buffer, x.shape, x.dtype, None, base + comps[kind].offset)

            q = None
            if t.quant is not None:
                q = Quant(at("scales", t.quant.scales), t.quant.block,
                          at("zeros", t.quant.zeros) if t.quant.zeros is not None else None)
            w = at("q", t)
            w.quant = q
            out.append(w)
        return tuple(out)

    def image(self, views: tuple) -> Tensor:
        """The image's bytes, from its (gate, up, down) views."""
        return views[0].byte_view(-self.parts[0].offset, self.nbytes)


def slot_counts(capacity, E: int, n_moe: int, per_expert: int, work: int) -> tuple:
    """(slots per layer, overflow slots) for a capacity (ExpertCacheConfig.capacity) over n_moe
    layers of E experts of per_expert bytes, when a step routes a layer to up to `work` experts;
    a ConfigError for a capacity that holds no expert per layer."""

    def overflow(n: int) -> int:
        return max(0, work - n)

    if isinstance(capacity, float):
        # a fraction: that share of each layer's experts stays cached; the overflow comes on top
        n = min(E, int(round(capacity * E)))
        if n < 1:
            raise ConfigError(f"expert_cache.capacity {capacity!r} holds no expert per layer: it is a share "
                              f"of each layer's {E} experts and rounds to 0 slots; use at least {0.5 / E:.3g}")
    else:
        # a byte budget covers everything the cache allocates, the overflow included
        budget = int(capacity)
        n = next((k for k in range(E, 0, -1) if (k * n_moe + overflow(k)) * per_expert <= budget), 0)
        if n < 1:
            need = (n_moe + overflow(1)) * per_expert
            raise ConfigError(f"expert_cache.capacity {budget} bytes holds no expert per layer: one slot in each "
                              f"of the {n_moe} MoE layers plus the {overflow(1)}-expert overflow a step may need "
                              f"take {need} bytes ({per_expert} per expert); raise it to at least {need}")
    return n, overflow(n)


def host_buffer(backend, nbytes: int) -> Tensor:
    """Pinned host memory where the library has it (asynchronous copies), else pageable."""
    try:
        return backend.host_empty((nbytes,), "uint8")
    except Exception:     # a library without host_alloc: its copies are synchronous anyway
        return Tensor.empty((nbytes,), "uint8")


@dataclass
class StreamedLayer:
    """What the graph needs to trace one streamed MoE layer (MoEWeights.streamed)."""

    pos: int                 # index among the streamed layers
    w_gate: list             # E slot descriptors each (own slots, overflow, aliases of slot 0)
    w_up: list
    w_down: list
    predict: bool            # trace the next layer's router on this layer's residual (prefetch)
    # a device: the routing is read at its own pause right after the router, and the shared experts
    # run while the host decides (on_ids); host backends run ops synchronously and pause once
    early_read: bool = False
    # every expert resident (a filled lazy cache): E descriptors in expert order, no pause; None before
    direct: Optional[tuple] = None
    expert_map: Optional[Tensor] = None    # [E] int32 on the device: expert -> descriptor, -1 = not resident
    # set while the runner traces a pause-free plan (ExpertCache.tracing): no pause, no prediction;
    # the routing and misses go to record(T, pos) = (ids [T, K], misses [T, K]) for the host to read after
    pause_free: bool = False
    record: object = None


@dataclass
class CachedLayer:
    """One MoE layer in the cache: its slots' memory and bookkeeping, its loads in flight, and the
    table of the step at hand."""

    pos: int
    index: int               # model layer index
    prefix: str
    slots: LayerSlots
    pool: Tensor
    views: list              # per slot: (gate, up, down)
    raw: list = field(default_factory=list)       # host-memory backends: per slot, its bytes as NumPy
    pending: dict = field(default_factory=dict)   # slot -> loads.Load in flight
    slot_ids: Optional[np.ndarray] = None         # this step's table: expert -> slot (overflow included)
    needed: list = field(default_factory=list)    # this step's distinct experts
