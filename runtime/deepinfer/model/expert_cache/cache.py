"""ExpertCache: routed experts of every MoE layer in bounded per-layer slots, and the hooks the runner
calls around and inside a step.

A step at a MoE layer pauses once, after the router and the shared experts (model.plan): the
layer's topk_ids (and, with prefetch, the next layer's router applied to this layer's residual) are
read (model.expert_cache.routing); the policy (model.expert_cache.policy) names hits and places
misses; their loads start (model.expert_cache.loads), then the prefetch loads of the next layer;
this layer's loads are waited for (on a device: the working stream waits for their copies' events)
and the layer's row of the table (model.expert_cache.table) sent; moe_experts follows. Misses wait;
what hides transfers is prefetch, issued a whole layer ahead. (Computing the resident experts while
the misses arrive would split the op's sum over k into two calls and change its rounding: the output
would no longer be the resident model's.) Decode steps whose experts are all in place run without
pauses (model.expert_cache.pause_free).

Lazy loading (capacity 1.0) fills in: after the first step the experts nobody routed yet load in
the background, and once every expert is resident each layer gets direct descriptors (its slots in
expert order) and the runner traces its plans again without pauses: from then on a step is the
eager model's step over the cache's memory.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Optional

import numpy as np

from ...errors import ConfigError
from ...tensor import Tensor
from .config import ExpertCacheConfig, default_prefetch, default_source
from .layout import CachedLayer, ImageLayout, StreamedLayer, slot_counts
from .loads import Loads
from .pause_free import PauseFreeSteps
from .policy import LayerSlots
from .readers import ReaderThreads
from .routing import RoutingReads, present
from .sources import ExpertSources, template
from .table import SlotTable

log = logging.getLogger("deepinfer")


class ExpertCache:
    """Routed experts of every MoE layer in bounded per-layer slots (see the module docstring)."""

    def __init__(self, backend, loader, moe_layers: list, cfg: ExpertCacheConfig, *, top_k: int,
                 max_tokens: int, main_layers: int):
        self.backend, self.loader, self.cfg = backend, loader, cfg
        if backend.abi_minor < 5:
            raise ConfigError(f"expert_cache needs moe_experts' expert_map (ABI 1.5), and backend {backend.name} "
                              f"implements ABI 1.{backend.abi_minor}; update that library, or load the model without "
                              f"expert_cache")
        self.ckpt = loader.ckpt
        # slots in host memory the reader writes itself (CPU / reference backends), else the device path
        self.host_memory = backend.device == "cpu" if cfg.host_memory is None else bool(cfg.host_memory)
        self.source = cfg.source
        self.E = E = loader.cfg.n_routed_experts
        self.K = top_k
        self.stats = dict(expert_hits=0, expert_misses=0, expert_overflow_loads=0, expert_prefetch_issued=0,
                          expert_prefetch_used=0, expert_prefetch_late=0, expert_bytes_streamed=0,
                          expert_wait_seconds=0.0, expert_predicted=0, expert_predicted_used=0,
                          expert_needed=0, expert_needed_predicted=0, expert_fill_loads=0, expert_loads_given_up=0)
        t0 = time.perf_counter()
        tmpl, self.raw = template(loader, moe_layers[0].prefix)
        self.layout = ImageLayout(tmpl)
        n_moe = len(moe_layers)
        per_expert = self.layout.nbytes
        # a step routes up to max_tokens x top_k experts of a layer: a shared overflow pool holds, for
        # one layer at a time, the misses beyond the layer's slots
        n, self.n_overflow = slot_counts(cfg.capacity, E, n_moe, per_expert, min(E, max_tokens * top_k))
        self.slots_per_layer = n
        self.fill = (n == E) if cfg.fill is None else bool(cfg.fill)
        self.prefetch = bool(cfg.prefetch) if cfg.prefetch is not None else \
            default_prefetch(self.host_memory, per_expert)
        if self.source is None:
            self.source = default_source(self.host_memory, n == E, per_expert * E * n_moe)
        be = backend
        self.layers: list[CachedLayer] = []
        for pos, m in enumerate(moe_layers):
            pool = be.empty((n * per_expert,), "uint8")
            views = [self.layout.views(pool.buffer, pool.offset + s * per_expert) for s in range(n)]
            idx = int(m.prefix.split(".")[2])
            self.layers.append(CachedLayer(pos, idx, m.prefix, LayerSlots(E, n, cfg.policy), pool, views))
        self.overflow = be.empty((self.n_overflow * per_expert,), "uint8") if self.n_overflow else None
        self.overflow_views = [self.layout.views(self.overflow.buffer, self.overflow.offset + s * per_expert)
                               for s in range(self.n_overflow)]
        overflow_raw = []
        if self.host_memory:
            for L in self.layers:
                L.raw = [self.layout.image(v).numpy() for v in L.views]
            overflow_raw = [self.layout.image(v).numpy() for v in self.overflow_views]
        self._moe = moe_layers
        self.table = SlotTable(be, self.host_memory, n_moe, E)
        self.pause_free_steps = PauseFreeSteps(be, self.host_memory, moe_layers, top_k, self.stats)
        for L, m in zip(self.layers, moe_layers):
            descs = list(L.views) + list(self.overflow_views)
            descs += [L.views[0]] * (E - len(descs))     # never named by the table; keeps E resident descriptors
            m.streamed = StreamedLayer(L.pos, [d[0] for d in descs], [d[1] for d in descs], [d[2] for d in descs],
                                       predict=False, early_read=not self.host_memory,
                                       expert_map=self.table.row(L.pos), record=self.pause_free_steps.record)
        for i, m in enumerate(moe_layers[:-1]):
            # the next layer's router runs on this layer's residual; the MTP layer is another plan
            m.streamed.predict = self.prefetch and self.layers[i + 1].index == self.layers[i].index + 1 \
                and self.layers[i + 1].index < main_layers
        # a step's first MoE layer has no layer before it to predict it; when it routes by token id
        # (V4's hash layers) its experts are known before the step starts (start_step), from the
        # host's copy of its token -> experts table
        first = moe_layers[0].hash_table
        self._first_table = backend.to_numpy(first) if self.prefetch and first is not None else None
        self.hashed_first = self._first_table is not None
        self.sources = ExpertSources(be, loader, self.layout, self.raw, self.host_memory)
        self.loads = Loads(be, self.layout, self.sources, self.host_memory, self.stats, self.overflow_views,
                           overflow_raw)
        # the readers and the open files go with the cache (weakref.finalize: nothing they run holds
        # it), also when the rest of this constructor fails; the native readers join the list later
        self._closer = weakref.finalize(self, _close, self.loads.reader, self.loads.natives, self.sources.fds)
        if not self.host_memory:
            self.loads.start_device(self.source, cfg.native_readers, self.layers, E)
        if self.source == "host":
            self.sources.build_images(self.layers, E)
        self.setup_seconds = time.perf_counter() - t0
        self.route_seconds = 0.0         # host time of the routed pauses (reading ids, policy, issuing loads)
        self.pauses = 0                  # routed pauses run
        self.routing = RoutingReads(be, self.host_memory)
        # a list: every pause appends (layer pos, needed, predicted next); start_step (-1, [], predicted)
        self.trace: Optional[list] = None
        # dry: steps load nothing and route every pair nowhere (the runner's warm-up step, which only
        # sizes memory: with lazy loading it would otherwise read every expert before the first token)
        self.dry = False
        self.steps = 0                   # steps run through the pauses (the runner counts them)
        self._filling = False
        self.direct = False              # every expert resident: plans run without pauses
        # pause-free steps (model.expert_cache.pause_free), unless configured off
        self.pause_free = cfg.pause_free is None or bool(cfg.pause_free)

    # ------------------------------------------------------------------ sizes, readers
    @property
    def expert_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def total_expert_bytes(self) -> int:
        return self.layout.nbytes * self.E * len(self.layers)

    @property
    def slot_bytes(self) -> int:
        """Device memory of the cache: every layer's slots plus the shared overflow."""
        return self.layout.nbytes * (self.slots_per_layer * len(self.layers) + self.n_overflow)

    @property
    def readers(self) -> str:
        """Which readers load disk experts: "native" or "python"."""
        return self.loads.readers

    @property
    def read_threads(self) -> int:
        return self.loads.read_threads

    @property
    def copy_stream(self):
        """Device: the stream the loads' copies run on."""
        return self.loads.copy_stream

    @property
    def sync_seconds(self) -> float:
        """Device: of route_seconds, the time spent waiting for the working stream to reach a pause."""
        return self.routing.sync_seconds

    # ------------------------------------------------------------------ a step
    def before_step(self) -> bool:
        """Called by the runner before each step. With fill: after the first step, starts the
        background loads of every expert not yet resident; once they are all in place, switches the
        layers to direct descriptors and returns True: the runner then traces its plans again,
        without pauses. Never blocks."""
        if not self.fill or self.direct or self.steps < 1:
            return False
        loads = self.loads
        if not self._filling:
            self._filling = True
            for L in self.layers:
                for e, s in L.slots.fill():
                    loads.load(L, e, s, "fill")
                    self.stats["expert_fill_loads"] += 1
            return False
        loads.pump()     # device: every read that is done has its copy issued after this
        if not all(loads.read_done(ld) for L in self.layers for ld in L.pending.values()):
            return False
        for L in self.layers:
            for slot in list(L.pending):
                loads.finish(L, slot, compute_waits=True)   # device: the working stream waits for the copies
            if not L.slots.full:
                return False
        for L, m in zip(self.layers, self._moe):
            v = [L.views[L.slots.slot_of[e]] for e in range(self.E)]
            m.streamed.direct = ([d[0] for d in v], [d[1] for d in v], [d[2] for d in v])
        self.direct = True
        log.info("expert cache: every routed expert is resident; steps run without pauses from now on")
        return True

    def _prefetch(self, L: CachedLayer, predicted: list) -> None:
        """Start the loads of the predicted experts of layer L that are not resident."""
        for e, s, _ in L.slots.prefetch(predicted):
            self.loads.release(L, s)   # a load still in flight into the victim slot
            self.loads.load(L, e, s, "prefetch")
            self.stats["expert_prefetch_issued"] += 1

    def start_step(self, ids: np.ndarray) -> None:
        """Before a step that starts at the first MoE layer, when that layer routes by token id:
        its experts follow from the step's token ids (padding rows included: they are routed too),
        so their loads start now and overlap everything the step computes before the layer's pause."""
        table = self._first_table
        if table is None or self.dry or self.direct:
            return
        t0 = time.perf_counter()
        ids = np.asarray(ids)
        predicted, _ = self._distinct(table[ids[(ids >= 0) & (ids < len(table))]])
        self._prefetch(self.layers[0], predicted)
        if self.trace is not None:
            self.trace.append((-1, [], predicted))
        self.route_seconds += time.perf_counter() - t0

    def on_ids(self, pos: int, ids: Tensor, pred: Optional[Tensor]) -> None:
        """Device: the routing of layer pos (and the next layer's prediction) is complete on the
        working stream: copy it to pinned memory and record an event, without waiting. The shared
        experts run on the device meanwhile; on_routed, at the pause before moe_experts, waits only
        for this event."""
        if self.dry:
            return
        t0 = time.perf_counter()
        self.routing.send_early(pos, *present(ids, pred))
        self.route_seconds += time.perf_counter() - t0

    def _distinct(self, ids: np.ndarray) -> tuple:
        """(distinct experts in first-use order, whether some id was outside [0, E))."""
        seen = dict.fromkeys(ids.reshape(-1).tolist())
        out = [e for e in seen if 0 <= e < self.E]
        return out, len(out) != len(seen)

    def on_routed(self, pos: int, ids: Tensor, pred: Optional[Tensor]) -> None:
        L = self.layers[pos]
        if self.dry:
            return
        t0 = time.perf_counter()
        self.pauses += 1
        # ids None: sent at the routing's own pause (on_ids)
        got = self.routing.take_early(pos) if ids is None else self.routing.read(*present(ids, pred))
        rid, rpred = got[0], (got[1] if len(got) > 1 else None)
        needed, _ = self._distinct(rid)
        S = self.stats
        if L.slots.predicted:
            S["expert_predicted"] += len(L.slots.predicted)
            S["expert_predicted_used"] += len(L.slots.predicted.intersection(needed))
            S["expert_needed_predicted"] += len(needed)
        hits, used_pf, loads, overflow = L.slots.route(needed)
        S["expert_needed"] += len(needed)
        S["expert_hits"] += len(hits)
        S["expert_prefetch_used"] += len(used_pf)
        S["expert_misses"] += len(loads) + len(overflow)
        S["expert_overflow_loads"] += len(overflow)
        for e, s, _ in loads:
            self.loads.release(L, s)   # a load still in flight into the victim slot
            self.loads.load(L, e, s, "miss")
        slot_ids = L.slots.table                        # expert -> slot (read before the layer's next route)
        if overflow:
            if len(overflow) > self.n_overflow:
                raise RuntimeError(f"layer {L.index}: {len(needed)} experts routed in one step exceed its "
                                   f"{L.slots.n} slots and the {self.n_overflow} overflow slots")
            slot_ids = slot_ids.copy()
            for j, e in enumerate(overflow):
                s = L.slots.n + j
                slot_ids[e] = s
                self.loads.load(L, e, s, "overflow")
        L.needed, L.slot_ids = needed, slot_ids
        predicted = None
        if rpred is not None:
            predicted, _ = self._distinct(rpred)
            self._prefetch(self.layers[pos + 1], predicted)
        if self.trace is not None:
            self.trace.append((pos, needed, predicted))
        self.route_seconds += time.perf_counter() - t0

    def on_experts(self, pos: int) -> None:
        """Before layer pos's moe_experts: its experts in place, its row of the table on the device."""
        L = self.layers[pos]
        row = self.table.host[pos]
        self.table.clean = False
        if self.dry:       # every expert absent: moe_experts skips every pair (and flags it)
            row[...] = -1
            self.table.send(pos)
            return
        loads = self.loads
        if L.pending:
            t0 = time.perf_counter()
            late = 0
            for e in L.needed:
                s = int(L.slot_ids[e])
                ld = L.pending.get(s)
                if ld is not None:
                    if ld.kind == "prefetch" and not loads.complete(ld):
                        late += 1      # predicted in time, but its bytes are still on the way
                    loads.finish(L, s, compute_waits=True)
            for s in [s for s in L.pending if s >= L.slots.n]:   # overflow loads (all needed by this step)
                loads.finish(L, s, compute_waits=True)
            self.stats["expert_prefetch_late"] += late
            self.stats["expert_wait_seconds"] += time.perf_counter() - t0
        # the whole table: entries of loads still in flight are never routed by this step
        row[...] = L.slot_ids
        self.table.send(pos)
        if not self.host_memory:
            loads.pump()

    def end_step(self) -> None:
        """After a step run with pauses (the runner): one more step that loaded nothing, or none."""
        if self.dry:
            return
        self.steps += 1
        self.pause_free_steps.paused(self.loads.started)
        self.loads.started = 0

    # ------------------------------------------------------------------ pause-free steps
    def tracing(self, pause_free: bool):
        """`with cache.tracing(True):` the runner traces a pause-free plan (StreamedLayer.pause_free)."""
        return self.pause_free_steps.tracing(pause_free)

    def pause_free_ready(self) -> bool:
        """Whether the coming decode step may run without pauses: recent steps loaded nothing and no
        load is in flight (one whose bytes have all arrived is ordered before the step here)."""
        if not self.pause_free or self.dry or self.direct or self.steps < 1 or not self.pause_free_steps.due():
            return False
        loads = self.loads
        loads.pump()
        for L in self.layers:
            for slot in list(L.pending):
                if not loads.complete(L.pending[slot]):
                    return False
                loads.finish(L, slot, compute_waits=True)
        self.table.restore(self.layers)
        return True

    def after_pause_free(self, T: int) -> bool:
        """After a pause-free step of T rows: False if some pair missed (the runner then runs the step
        again with pauses); else the policy learns the step's routing, as a paused step would."""
        t0 = time.perf_counter()
        found = self.pause_free_steps.finish(T)
        if found is None:
            self.route_seconds += time.perf_counter() - t0
            return False
        ids, positions = found
        S = self.stats
        self.steps += 1
        for pos in positions:
            L = self.layers[pos]
            needed, _ = self._distinct(ids[pos])
            hits, used_pf, loads, overflow = L.slots.route(needed)
            if loads or overflow:     # the device found them resident: the host's table must agree
                raise RuntimeError(f"expert cache: layer {L.index}'s table on the device and on the host disagree "
                                   f"(experts {[e for e, _, _ in loads] + list(overflow)})")
            S["expert_needed"] += len(needed)
            S["expert_hits"] += len(hits)
            S["expert_prefetch_used"] += len(used_pf)
            if self.trace is not None:
                self.trace.append((pos, needed, None))
        self.route_seconds += time.perf_counter() - t0
        return True

    def close(self) -> None:
        """Wait for reads in flight, stop the readers, close the checkpoint files (also done when
        the cache is collected)."""
        self._closer()

    # ------------------------------------------------------------------ reporting
    def report(self) -> dict:
        S = dict(self.stats)
        need = S["expert_needed"]
        S["expert_hit_rate"] = S["expert_hits"] / need if need else None
        pn = S.pop("expert_needed_predicted")
        S["expert_prefetch_recall"] = S["expert_predicted_used"] / pn if pn else None
        S["expert_prefetch_precision"] = S["expert_predicted_used"] / S["expert_predicted"] if S["expert_predicted"] \
            else None
        S.update(expert_cache_slots_per_layer=self.slots_per_layer, expert_cache_overflow_slots=self.n_overflow,
                 expert_cache_bytes=self.slot_bytes, expert_total_bytes=self.total_expert_bytes,
                 expert_bytes=self.layout.nbytes, expert_source=self.source, expert_policy=self.cfg.policy,
                 expert_prefetch=self.prefetch, expert_setup_seconds=self.setup_seconds,
                 expert_fill=self.fill, expert_direct=self.direct, expert_pause_free=self.pause_free,
                 expert_readers=self.readers)
        return S


def _close(reader: ReaderThreads, natives: list, fds: dict) -> None:
    reader.shutdown(wait=True)
    for native in natives:
        native.shutdown()
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
