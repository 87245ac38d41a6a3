"""The expert cache: routed MoE experts held in a bounded number of slots per layer and loaded when a
step routes to them, from pinned host memory or straight from the checkpoint files, with the next
layer's experts pre-loaded while the current layer runs.

Why: every other weight of a DeepSeek model is small next to its routed experts (V3: 656 of 671B
parameters), and a token uses 8 of 256 per layer. Keeping all of them in device memory is what makes
a model fit or not; keeping the ones that recent tokens used (LRU hit rates of 75-98% are reported
for DeepSeek routers) and streaming the rest lets a model larger than the device run, and starting
with none resident (capacity 1.0: lazy loading) lets the first token come before they are all read.

Memory. All experts of a model share formats and shapes, so one expert's weights (gate, up, down,
each with its scales and zeros) have one byte layout, its *image* (ImageLayout). A slot holds one
image. Each MoE layer owns `slots` of them in one backend allocation; one shared overflow pool holds,
for one layer at a time, the misses of a step that routes to more experts than the layer's slots
minus those it needs (a prefill touching most experts).

The expert-to-slot table lives on the device. A streamed layer's moe_experts is traced over the
layer's slot descriptors, E of them (its slots, the shared overflow, then aliases of slot 0 that no
entry names, so a library sees as many resident experts as the eager model has and chooses the same
kernels), with the router's topk_ids as they are and the layer's row of `maps` (ABI 1.5
expert_map: expert -> descriptor, -1 = not resident): the kernel finds each expert's slot itself and
skips, flagging it in `misses`, a pair whose expert is not there. moe_experts computes each
(token, k) pair independently of how experts are numbered and sums the k contributions of a token
in k order (abi/README.md section 8), so the output is bit-identical to the eager model's.

A step at a MoE layer pauses once, after the router and the shared experts (model.plan): the
layer's topk_ids (and, with prefetch, the next layer's router applied to this layer's residual) are
read; the policy (model.expert_policy) names hits and places misses; their loads start, then the
prefetch loads of the next layer; this layer's loads are waited for (on a device: the working stream
waits for their copies' events) and the layer's row of the table sent; moe_experts follows. Misses
wait; what hides transfers is prefetch, issued a whole layer ahead. On a device the layer pauses twice: right
after the router its routing is copied to pinned memory behind an event (on_ids), the shared
experts run on the device while the host waits for that event and decides, and the step stops
only before moe_experts. (Computing the resident experts while the
misses arrive would split the op's sum over k into two calls and change its rounding: the output
would no longer be the resident model's.)

Pause-free steps. Once recent steps found every expert they routed to resident and no load is in
flight, a decode step runs a plan without pauses (the runner traces it with pause_free): the table
is on the device, so nothing needs the host until the step ends. Each layer writes its routing and
misses into a record the host reads once afterwards; the policy's bookkeeping follows from it. If
any pair missed, the step is run again with pauses (it rewrites the same cache positions, so
nothing of the failed attempt survives) and the next try waits twice as many clean steps. A step
whose experts were all in place then costs what a resident step costs, plus one small read-back.

Lazy loading (capacity 1.0) fills in: after the first step the experts nobody routed yet load in
the background, and once every expert is resident each layer gets direct descriptors (its slots in
expert order) and the runner traces its plans again without pauses: from then on a step is the
eager model's step over the cache's memory.

Loads. An expert's bytes come from the pinned host image (source "host": every expert read, and
converted where the precision says so, into host memory at start) or from the checkpoint files
(source "disk": one preadv per run of the expert's byte ranges when the experts are used as stored;
otherwise the expert is converted on the main thread as the eager load does). On a backend whose
memory is host memory (CPU, reference) a miss is read into its slot on the main thread (it is waited
for at once) and a prefetch by a reader thread (it overlaps the layers computed until its use). On a
device, reader threads read into pinned bounce buffers (disk) and the main thread sends each with an
asynchronous copy on a copy stream; the working stream waits for that copy's event before the
layer's moe_experts, so the host never waits for a transfer. A disk expert is read in CHUNK_BYTES
pieces by DEVICE_READ_THREADS readers, each of which sends its piece on the copy stream as soon as
it is read, so one miss arrives at the threads' aggregate rate; the readers take misses before
queued prefetches, and a slot that goes to another expert gives up the load in flight into it
instead of waiting for it. The readers are native threads (model.native_reader) that call the
backend's mem_copy_async and event_record themselves, so no piece takes the GIL the main thread
needs for the next pause; Python threads do the same where that library is not built or the
backend is not an ABI library.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import validate as V
from ..errors import ConfigError
from ..precision import meminfo_available
from ..tensor import Quant, Tensor
from .expert_policy import POLICIES, LayerSlots

log = logging.getLogger("deepinfer")

SOURCES = ("host", "disk")
ALIGN = 256
READ_THREADS = 1          # host-memory backends: the compute threads use the cores; one reader overlaps them
# device backends: readers of disk experts. One thread reads the page cache at ~9 GB/s (H100 host), so
# a miss read by one thread took 2 ms for V2-Lite's 17 MB expert; split in CHUNK_BYTES pieces over 8
# readers it arrives at the aggregate rate, and each piece is sent on as soon as it is read. 2 MiB:
# with the native readers a piece costs no hand-off, and 2 MiB pieces (9 a V2-Lite expert: all 8
# readers on one miss) beat 4 MiB at 50% and 75% capacity (results/expert_readers_cuda_h100_*)
DEVICE_READ_THREADS = 8
CHUNK_BYTES = 2 << 20
BOUNCE_BYTES = 1 << 30    # device backends: at most this much pinned memory for disk reads in flight
# reader priorities: a step waits for its misses now; a prefetch is needed a layer later; fill whenever
PRIORITY = {"miss": 0, "overflow": 0, "prefetch": 1, "fill": 2}
# host backends prefetch by default only experts this large: a read then lasts long enough (~200 us
# from the page cache) for the reader to overlap the compute; with small ones (the embedded model's
# 192 KiB) the hand-off and the wrong predictions' reads cost more than the overlap saves
HOST_PREFETCH_MIN_BYTES = 4 << 20
# pause-free steps start after this many paused steps that loaded nothing; each step that misses
# doubles it (up to PAUSE_FREE_AFTER_MAX), each that does not halves it again
PAUSE_FREE_AFTER = 2
PAUSE_FREE_AFTER_MAX = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ====================================================================== configuration
@dataclass
class ExpertCacheConfig:
    """engine config `expert_cache`: {"capacity": fraction of all routed expert bytes in (0, 1] or
    bytes (an integer > 1), "source": "host" | "disk", "prefetch": bool, "policy": "lfru" | "lru"}.

    capacity: a fraction is the share of each layer's experts that stays cached; the shared overflow
    (the misses of one layer's step beyond its slots: up to experts - slots) comes on top and is
    reported in expert_cache_bytes. A byte count is a budget for everything the cache allocates,
    the overflow included.

    fill (capacity 1.0 only, default on): after the first step, the experts not routed yet load in
    the background; once every expert is resident the plans are traced again without pauses (the
    step is then the eager model's, its experts in the cache's memory).

    pause_free (default on): decode steps run without pauses while recent steps needed no load,
    and are run again with pauses when one misses (the module docstring). Off: every step pauses.

    prefetch, when not given: on for device backends, where copies run on their own engine beside the
    kernels; on host backends only for experts of HOST_PREFETCH_MIN_BYTES or more: there the reader
    takes a core from the compute threads, and with small experts its hand-off and the reads of wrong
    predictions (a quarter of them on the embedded model) cost more than it hides
    (benchmarks/results/expert_cache_cpu_*.md: the embedded model, and V2-Lite-sized experts)."""

    capacity: float = 1.0
    source: Optional[str] = None      # None: see ExpertCache._default_source
    prefetch: Optional[bool] = None   # None: on for devices, on host backends for large experts
    policy: str = "lfru"
    fill: Optional[bool] = None       # capacity 1.0: load the rest in the background (None: yes)
    # steps without pauses once recent steps found every expert resident (None: yes); see ExpertCache
    pause_free: Optional[bool] = None
    # not a JSON key: False drives the device path (pinned bounce buffers, async copies on a copy
    # stream, events) on a host-memory backend, which is how tests cover it without a GPU
    host_memory: Optional[bool] = None
    # not a JSON key: device disk loads on the native readers (model.native_reader) where the library
    # is built and the backend an ABI library (None: yes), or False: the Python readers (benchmarks)
    native_readers: Optional[bool] = None

    @classmethod
    def parse(cls, d) -> Optional["ExpertCacheConfig"]:
        if d is None:
            return None
        if isinstance(d, ExpertCacheConfig):
            return d
        if not isinstance(d, dict):
            raise ConfigError(f"expert_cache must be an object such as {{\"capacity\": 0.5, \"source\": \"disk\"}}, "
                              f"not {d!r}")
        unknown = set(d) - {"capacity", "source", "prefetch", "policy", "fill", "pause_free"}
        if unknown:
            raise ConfigError(f"unknown expert_cache option(s) {sorted(map(str, unknown))}; valid: capacity, source, "
                              f"prefetch, policy, fill, pause_free")
        c = cls()
        if "capacity" in d:
            cap = d["capacity"]
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap != cap:
                raise ConfigError(f"expert_cache.capacity must be a number (a fraction in (0, 1] of the routed "
                                  f"experts' bytes, or a byte count > 1), not {cap!r}")
            if cap <= 0:
                raise ConfigError(f"expert_cache.capacity must be > 0, not {cap!r}")
            if cap > 1 and (isinstance(cap, float) and not cap.is_integer()):
                raise ConfigError(f"expert_cache.capacity {cap!r}: above 1 it is a byte count and must be an integer")
            c.capacity = float(cap) if cap <= 1 else int(cap)
        if "source" in d:
            if d["source"] not in SOURCES:
                raise ConfigError(f"expert_cache.source must be one of {', '.join(SOURCES)}, not {d['source']!r}")
            c.source = d["source"]
        if "prefetch" in d:
            c.prefetch = V.boolean("expert_cache.prefetch", d["prefetch"])
        if "pause_free" in d:
            c.pause_free = V.boolean("expert_cache.pause_free", d["pause_free"])
        if "fill" in d:
            c.fill = V.boolean("expert_cache.fill", d["fill"])
            if c.fill and c.capacity != 1.0:
                raise ConfigError(f"expert_cache.fill loads every expert after the first step, which needs "
                                  f"capacity 1.0 (lazy loading), not {c.capacity!r}")
        if "policy" in d:
            if d["policy"] not in POLICIES:
                raise ConfigError(f"expert_cache.policy must be one of {', '.join(POLICIES)}, not {d['policy']!r}")
            c.policy = d["policy"]
        return c


# ====================================================================== one expert's bytes
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


# ====================================================================== the cache
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
class _Load:
    dst: Optional[Tensor]    # device: the slot's bytes
    kind: str                # "miss", "prefetch", "overflow" or "fill"
    read: Optional[Future] = None    # device, disk: done once every piece is read and its copy issued
    event: object = None     # device: recorded after the load's copies (None until then)
    bounce: Optional[Tensor] = None
    ranges: Optional[list] = None    # device, disk: the file runs to read
    plan: object = None              # native readers: the same, as they take it (native_reader.Plan)
    # device, disk: the readers' shared state (under lock): pieces still to read, whether any copy
    # went out, whether the load was given up (its slot went to another expert), the first error
    lock: Optional[threading.Lock] = None
    left: int = 0
    copied: bool = False
    cancelled: bool = False
    error: Optional[BaseException] = None
    # native readers: the event they record after the load's copies, ld.event once read is done
    # and a copy went out (_read_done)
    native_event: object = None


@dataclass
class _Layer:
    pos: int
    index: int               # model layer index
    prefix: str
    slots: LayerSlots
    pool: Tensor
    views: list              # per slot: (gate, up, down)
    raw: list = field(default_factory=list)       # host-memory backends: per slot, its bytes as NumPy
    pending: dict = field(default_factory=dict)   # slot -> _Load in flight
    slot_ids: Optional[np.ndarray] = None         # this step's table: expert -> slot (overflow included)
    needed: list = field(default_factory=list)    # this step's distinct experts


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
        first = moe_layers[0].prefix
        tmpl, self.raw = self._template(first)
        self.layout = ImageLayout(tmpl)
        n_moe = len(moe_layers)
        per_expert = self.layout.nbytes
        # a step routes up to max_tokens x top_k experts of a layer: a shared overflow pool holds, for
        # one layer at a time, the misses beyond the layer's slots
        work = min(E, max_tokens * top_k)

        def overflow(n: int) -> int:
            return max(0, work - n)

        if isinstance(cfg.capacity, float):
            # a fraction: that share of each layer's experts stays cached; the overflow comes on top
            n = min(E, int(round(cfg.capacity * E)))
            if n < 1:
                raise ConfigError(f"expert_cache.capacity {cfg.capacity!r} holds no expert per layer: it is a share "
                                  f"of each layer's {E} experts and rounds to 0 slots; use at least {0.5 / E:.3g}")
        else:
            # a byte budget covers everything the cache allocates, the overflow included
            budget = int(cfg.capacity)
            n = next((k for k in range(E, 0, -1) if (k * n_moe + overflow(k)) * per_expert <= budget), 0)
            if n < 1:
                need = (n_moe + overflow(1)) * per_expert
                raise ConfigError(f"expert_cache.capacity {budget} bytes holds no expert per layer: one slot in each "
                                  f"of the {n_moe} MoE layers plus the {overflow(1)}-expert overflow a step may need "
                                  f"take {need} bytes ({per_expert} per expert); raise it to at least {need}")
        self.slots_per_layer = n
        self.n_overflow = overflow(n)
        self.fill = (n == E) if cfg.fill is None else bool(cfg.fill)
        self.prefetch = bool(cfg.prefetch) if cfg.prefetch is not None else \
            (not self.host_memory or per_expert >= HOST_PREFETCH_MIN_BYTES)
        if self.source is None:
            self.source = self._default_source(n == E, per_expert * E * n_moe)
        be = backend
        self.layers: list[_Layer] = []
        for pos, m in enumerate(moe_layers):
            pool = be.empty((n * per_expert,), "uint8")
            views = [self.layout.views(pool.buffer, pool.offset + s * per_expert) for s in range(n)]
            idx = int(m.prefix.split(".")[2])
            self.layers.append(_Layer(pos, idx, m.prefix, LayerSlots(E, n, cfg.policy), pool, views))
        self.overflow = be.empty((self.n_overflow * per_expert,), "uint8") if self.n_overflow else None
        self.overflow_views = [self.layout.views(self.overflow.buffer, self.overflow.offset + s * per_expert)
                               for s in range(self.n_overflow)]
        self._overflow_raw = []
        if self.host_memory:
            for L in self.layers:
                L.raw = [self._slot_tensor(L, s).numpy() for s in range(n)]
            self._overflow_raw = [self._slot_tensor(self.layers[0], n + j).numpy() for j in range(self.n_overflow)]
        self._moe = moe_layers
        # the device-side expert -> slot table, one row per layer (-1: not resident). Its host copy
        # (pinned on a device) is what the rows are sent from, each send on the working stream
        self.maps = be.empty((n_moe, E), "int32", fill=-1)
        self._maps_pinned = None
        if self.host_memory:
            self._maps_host = self.maps.numpy()
        else:
            h = self._host_buffer(n_moe * E * 4)
            self._maps_pinned = Tensor(h.buffer, (n_moe, E), "int32", None, h.offset)
            self._maps_host = self._maps_pinned.numpy()
        self._map_sends: dict = {}       # layer pos (or "all") -> (its copy, bound once; the stream)
        self._maps_clean = True          # the device rows hold the layers' tables, no overflow entries
        self._records: dict = {}         # rows T -> (device [2, n_moe, T, K] int32, host view, its copy)
        self._recorded: dict = {}        # rows T -> the layer positions its pause-free plans record
        for L, m in zip(self.layers, moe_layers):
            descs = list(L.views) + list(self.overflow_views)
            descs += [L.views[0]] * (E - len(descs))     # never named by the table; keeps E resident descriptors
            m.streamed = StreamedLayer(L.pos, [d[0] for d in descs], [d[1] for d in descs], [d[2] for d in descs],
                                       predict=False, early_read=not self.host_memory,
                                       expert_map=self.maps.narrow(0, L.pos, 1).view(E), record=self._record)
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
        self._ranges: dict = {}          # (layer pos, expert) -> its file runs (_merged)
        self._fds: dict = {}
        self.read_threads = READ_THREADS if self.host_memory else DEVICE_READ_THREADS
        self._reader = _Readers(self.read_threads, "deepinfer-experts")
        self._native = None              # device, disk: the native readers (set below where they run)
        self._plans: dict = {}           # (layer pos, expert) -> its pieces for them (native_reader.Plan)
        self.readers = "python"
        # the readers and the open files go with the cache (weakref.finalize: nothing they run holds
        # it), also when the rest of this constructor fails; the native readers join the list later
        self._natives: list = []
        self._closer = weakref.finalize(self, _close, self._reader, self._natives, self._fds)
        self._images: Optional[list] = None
        self._bounce_free: list = []     # device, disk: pinned buffers the readers read into
        self._queued: list = []          # loads waiting for a bounce buffer (misses first)
        self._reading: list = []         # loads being read into one (and sent on by the readers)
        self._copying: list = []        # device: loads whose copies are in flight (bounce buffers held)
        self._chunks: dict = {}          # (layer pos, expert) -> its pieces (_pieces)
        if not self.host_memory:
            try:      # copies on a stream of their own, ordered by events: ABI 1.1's optional entries
                self.copy_stream = be.create_stream()
                be.create_event().close()
            except Exception as e:
                raise ConfigError(f"expert_cache on {be.name} needs streams, events and asynchronous copies (ABI "
                                  f"1.1), which this library lacks ({e}); load the model without expert_cache")
            if self.source == "disk":
                nb = max(2, min(64, BOUNCE_BYTES // per_expert))
                self._bounce_free = [self._host_buffer(per_expert) for _ in range(nb)]
                if self.raw and cfg.native_readers is not False:
                    self._start_native(cfg.native_readers)
                if self.raw:
                    # every expert's pieces now (~0.1 ms each, 0.2 s for V2-Lite): planned at its
                    # first load instead, that time fell on the pause that waits for it
                    for L in self.layers:
                        for e in range(E):
                            self._plan_reads(L, e)
        if self.source == "host":
            self._build_images()
        self.setup_seconds = time.perf_counter() - t0
        self.route_seconds = 0.0         # host time of the routed pauses (reading ids, policy, issuing loads)
        self.sync_seconds = 0.0          # device: of that, waiting for the working stream to reach the pause
        self.pauses = 0                  # routed pauses run
        self._views: dict = {}           # id(pause tensor) -> (tensor, its host view / pinned copy)
        self._early: Optional[tuple] = None    # (layer pos, host views): a routing on_ids sent (_ids_event)
        self._ids_event = None
        # a list: every pause appends (layer pos, needed, predicted next); start_step (-1, [], predicted)
        self.trace: Optional[list] = None
        # dry: steps load nothing and route every pair nowhere (the runner's warm-up step, which only
        # sizes memory: with lazy loading it would otherwise read every expert before the first token)
        self.dry = False
        self.steps = 0                   # steps run through the pauses (the runner counts them)
        self._filling = False
        self.direct = False              # every expert resident: plans run without pauses
        # pause-free steps (module docstring): on while the last `_clean` paused steps started no
        # load and reached `_pf_after` of them; a step that misses doubles _pf_after
        self.pause_free = cfg.pause_free is None or bool(cfg.pause_free)
        self._clean = 0
        self._pf_after = PAUSE_FREE_AFTER
        self._step_loads = 0
        self.stats.update(expert_pause_free_steps=0, expert_pause_free_retries=0)

    def _start_native(self, required: Optional[bool]) -> None:
        """Device disk loads on native reader threads (model.native_reader): they pread and issue
        the copies without the GIL. Where they cannot run, the Python readers do the same work
        (an error instead if they were asked for explicitly)."""
        from . import native_reader

        try:
            self._native = native_reader.NativeReaders(self.backend, self.copy_stream, DEVICE_READ_THREADS)
            self._natives.append(self._native)
            self.readers = "native"
        except Exception as e:
            if required:
                raise ConfigError(f"expert_cache: the native readers cannot run ({e})")
            log.info("expert cache: Python readers for disk loads (native readers unavailable: %s)", e)

    def _default_source(self, lazy: bool, total: int) -> str:
        """disk on host-memory backends (their slots are host memory already) and for lazy loading
        (each expert is read once: reading all of them up front is what lazy loading avoids); on a
        device, host when every expert fits in 80% of the host's available memory (a miss is then a
        pinned copy instead of a file read), else disk."""
        if self.host_memory or lazy:
            return "disk"
        avail = meminfo_available() or 0
        if total <= 0.8 * avail:
            return "host"
        log.info("expert cache: the %.1f GiB of routed experts exceed 80%% of the host's %.1f GiB available; "
                 "misses read the checkpoint files", total / 2**30, avail / 2**30)
        return "disk"

    # ------------------------------------------------------------------ sizes
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

    # ------------------------------------------------------------------ sources
    def _template(self, prefix: str):
        """(gate, up, down) of expert 0 as the slots hold them, and whether images are raw file bytes."""
        names = self.loader.expert_names(prefix, 0)
        stored = [self.loader.stored_weight(n, s) for n, s in names]
        raw = all(w is not None and all(self._file_range(x) is not None for _, x in ImageLayout.components(w))
                  for w in stored)
        if raw:
            return tuple(stored), True
        conv = tuple(self.loader.expert_weight(n, s) for n, s in names)
        return conv, False

    def _file_range(self, t: Tensor):
        if not t.on_host or not t.is_contiguous():
            return None
        return self.ckpt.file_range(t.byte_view().numpy())

    def _fd(self, path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _expert_ranges(self, L: _Layer, e: int) -> list:
        key = (L.pos, e)
        r = self._ranges.get(key)
        if r is None:
            ws = tuple(self.loader.stored_weight(n, s) for n, s in self.loader.expert_names(L.prefix, e))
            if any(w is None for w in ws):
                raise ConfigError(f"{L.prefix}experts.{e} is stored in another format than expert 0 of the first "
                                  f"MoE layer; the expert cache needs one format for all routed experts")
            self.layout.check(ws, f"{L.prefix}experts.{e}")
            r = []
            parts = iter(self.layout.parts)
            # file ranges of the stored tensors, in image order
            for w in ws:
                for _, x in ImageLayout.components(w):
                    p = next(parts)
                    fr = self._file_range(x)
                    if fr is None:
                        raise ConfigError(f"{L.prefix}experts.{e} is not a plain byte range of the checkpoint")
                    r.append((self._fd(fr[0]), fr[1], p.nbytes, p.offset))
            r = self._ranges[key] = _merged(r)
        return r

    def _converted(self, L: _Layer, e: int) -> tuple:
        """The expert converted on the backend as the eager load converts it (main thread only)."""
        ws = tuple(self.loader.expert_weight(n, s) for n, s in self.loader.expert_names(L.prefix, e))
        self.layout.check(ws, f"{L.prefix}experts.{e}")
        return ws

    @staticmethod
    def _pread(ranges: list, dst: np.ndarray) -> None:
        """Read an expert's file runs (_merged) into its image `dst`: one preadv per run."""
        for fd, off, pieces in ranges:
            views = [memoryview(dst[at:at + n]) for at, n in pieces]
            total = sum(n for _, n in pieces)
            if os.preadv(fd, views, off) == total:
                continue
            pos = off      # a short read (rare): piece by piece, each from its start
            for v in views:
                done = 0
                while done < len(v):
                    g = os.preadv(fd, [v[done:]], pos + done)
                    if g <= 0:
                        raise OSError(f"short read of an expert at byte {pos + done} of its file (truncated?)")
                    done += g
                pos += len(v)

    def _build_images(self) -> None:
        """source "host": every expert's image in (pinned) host memory, read once at start."""
        nb = self.layout.nbytes
        self._images = []
        for L in self.layers:
            img = self._host_buffer(self.E * nb) if not self.host_memory else Tensor.empty((self.E * nb,), "uint8")
            raw = img.byte_view().numpy()
            for e in range(self.E):
                dst = raw[e * nb:(e + 1) * nb]
                if self.raw:
                    self._pread(self._expert_ranges(L, e), dst)
                else:
                    self._write_converted(self._converted(L, e), Tensor(dst, (nb,), "uint8"))
            self._images.append(raw)
        self.backend.synchronize()

    def _host_buffer(self, nbytes: int) -> Tensor:
        """Pinned host memory where the library has it (asynchronous copies), else pageable."""
        try:
            return self.backend.host_empty((nbytes,), "uint8")
        except Exception:     # a library without host_alloc: its copies are synchronous anyway
            return Tensor.empty((nbytes,), "uint8")

    def _write_converted(self, ws: tuple, dst: Tensor) -> None:
        """A converted expert's components into the image bytes `dst` (a host image or a slot),
        copies on the working stream."""
        parts = iter(self.layout.parts)
        for w in ws:
            for _, x in ImageLayout.components(w):
                p = next(parts)
                self.backend.copy_async(dst.byte_view(p.offset, p.nbytes), x.byte_view(0, p.nbytes))

    # ------------------------------------------------------------------ loads
    def _load(self, L: _Layer, e: int, slot: int, kind: str) -> None:
        """Load expert e of layer L into `slot` (>= the layer's slot count: the shared overflow).
        Misses are read at once on host-memory backends (they are waited for right away; the
        reader thread's hand-off would only add to that); everything else is recorded in
        L.pending until it is known to be complete."""
        nb = self.layout.nbytes
        self.stats["expert_bytes_streamed"] += nb
        self._step_loads += 1
        if self.host_memory:
            dst = L.raw[slot] if slot < L.slots.n else self._overflow_raw[slot - L.slots.n]
            if not self.raw and self._images is None:
                self._write_converted(self._converted(L, e), Tensor(dst, (nb,), "uint8"))
                self.backend.synchronize()
            elif kind in ("prefetch", "fill"):      # overlaps the layers computed until its use
                src = (np.copyto, (dst, self._images[L.pos][e * nb:(e + 1) * nb])) if self._images is not None \
                    else (self._pread, (self._expert_ranges(L, e), dst))
                L.pending[slot] = _Load(None, kind, read=self._reader.submit(PRIORITY[kind], src[0], *src[1]))
            elif self._images is not None:
                np.copyto(dst, self._images[L.pos][e * nb:(e + 1) * nb])
            else:
                self._pread(self._expert_ranges(L, e), dst)
            return
        L.pending[slot] = self._start(L, e, self._slot_tensor(L, slot), kind)

    def _start(self, L: _Layer, e: int, slot_t: Tensor, kind: str) -> _Load:
        """Device: begin loading expert e of layer L into the bytes of slot_t."""
        ld = _Load(slot_t, kind)
        nb = self.layout.nbytes
        # device: the bytes go through host memory, then one asynchronous copy on the copy stream
        if self._images is not None:
            src = self._images[L.pos][e * nb:(e + 1) * nb]
            self._issue_copy(ld, Tensor(src, (nb,), "uint8"))
            ld.read = _done()
        elif self.raw:
            ld.ranges = self._chunks[(L.pos, e)]       # planned when the cache was built
            ld.plan = self._plans.get((L.pos, e))
            # a reader takes it once a bounce buffer is free (_feed); misses go before queued prefetches
            p = PRIORITY[kind]
            at = next((i for i, q in enumerate(self._queued) if PRIORITY[q.kind] > p), len(self._queued))
            self._queued.insert(at, ld)
            self._feed()
        else:
            self._write_converted(self._converted(L, e), slot_t)
            ev = self.backend.create_event()
            ev.record(self.backend.stream)
            ld.event = ev
            ld.read = _done()
        return ld

    def _plan_reads(self, L: _Layer, e: int) -> None:
        """Expert e of layer L's disk pieces (and the native readers' form of them)."""
        key = (L.pos, e)
        self._chunks[key] = _pieces(self._expert_ranges(L, e), self.layout.nbytes, CHUNK_BYTES)
        if self._native is not None:
            from .native_reader import Plan

            self._plans[key] = Plan(self._chunks[key])

    def _feed(self) -> None:
        """Device, disk: hand queued loads to the readers while bounce buffers are free. Buffers are
        taken and given back on the main thread only, so a reader never waits for one (a reader
        blocked on a buffer that only the main thread can free would hang the process at exit)."""
        while self._queued and self._bounce_free:
            ld = self._queued.pop(0)
            ld.bounce = self._bounce_free.pop()
            if self._native is not None:
                ld.native_event = self.backend.create_event()
                ld.read = self._native.submit(PRIORITY[ld.kind], ld.plan, ld.bounce, ld.dst, ld.native_event)
                self._reading.append(ld)
                continue
            ld.lock, ld.left, ld.read = threading.Lock(), len(ld.ranges), Future()
            # every piece in one hand-off: each submit took the queue's lock and woke a reader, and
            # the GIL traffic of that was a third of a pause's host time (sweep_expert_chunks.py)
            self._reader.submit_many(PRIORITY[ld.kind], self._read_piece, [(ld, piece) for piece in ld.ranges])
            self._reading.append(ld)

    def _read_piece(self, ld: _Load, piece: tuple) -> None:
        """Reader thread: one piece of a device disk load into its bounce buffer, then its copy to
        the slot on the copy stream; the last piece records the load's event and completes ld.read.
        A copy is issued under the load's lock, so once _cancel holds it no copy of the load is
        still to come: a later load into the slot is ordered after all of them on the copy stream."""
        runs, at, n = piece
        err = None
        if not ld.cancelled:
            try:
                self._pread(runs, ld.bounce.numpy())
            except BaseException as e:       # handed to whoever waits for the load
                err = e
        with ld.lock:
            if err is None and not ld.cancelled:
                try:
                    self.backend.copy_async(ld.dst.byte_view(at, n), ld.bounce.byte_view(at, n), self.copy_stream)
                    ld.copied = True
                except BaseException as e:
                    err = e
            if err is not None and ld.error is None and not ld.cancelled:
                ld.error = err
            ld.left -= 1
            last = ld.left == 0
            if last and ld.copied:
                try:
                    ev = self.backend.create_event()
                    ev.record(self.copy_stream)
                    ld.event = ev
                except BaseException as e:
                    ld.error = ld.error or e
        if last:
            if ld.error is not None:
                ld.read.set_exception(ld.error)
            else:
                ld.read.set_result(None)

    def _cancel(self, L: _Layer, slot: int) -> None:
        """The slot goes to another expert: give up a load still in flight into it. Device only.
        Nothing is waited for: a queued load is dropped; a load being read issues no more copies
        (its bounce buffer comes back once its reads, and copies already out, are done); copies on
        the copy stream are ordered before the next load's. A load converted on the working stream
        (no raw bytes, no host images) is waited for, as before."""
        ld = L.pending.pop(slot, None)
        if ld is None:
            return
        self.stats["expert_loads_given_up"] += 1
        if ld.ranges is None:
            if self._images is None:           # written on the working stream: order the copy stream after it
                self.copy_stream.wait(ld.event)
            return
        if ld in self._queued:
            self._queued.remove(ld)
            return
        if ld.lock is None:            # the native readers' load
            ld.read.cancel()           # no copy of it is issued once this returns
            ld.cancelled = True
            return
        with ld.lock:
            ld.cancelled = True

    def _release(self, L: _Layer, slot: int) -> None:
        """Before a slot takes another expert: on a device the load in flight into it is given up
        (_cancel); on a host-memory backend the reader writes the slot itself and is waited for."""
        if self.host_memory:
            self._finish(L, slot, compute_waits=False)
        else:
            self._cancel(L, slot)

    def _issue_copy(self, ld: _Load, src: Tensor) -> None:
        nb = self.layout.nbytes
        self.backend.copy_async(ld.dst.byte_view(0, nb), src, self.copy_stream)
        ev = self.backend.create_event()
        ev.record(self.copy_stream)
        ld.event = ev

    def _pump(self) -> None:
        """Device: take back bounce buffers whose loads are read and copied, start queued reads. A
        load that failed raises here (or where it is waited for)."""
        if self.host_memory:
            return
        done = [x for x in self._reading if self._read_done(x)]
        for ld in done:
            self._reading.remove(ld)
            if ld.event is not None:
                self._copying.append(ld)
            else:                              # given up before any copy: the buffer is free now
                self._bounce_free.append(ld.bounce)
                ld.bounce = None
        for ld in done:
            if not ld.cancelled:
                ld.read.result()
        still = []
        for ld in self._copying:
            if ld.event.query():
                self._bounce_free.append(ld.bounce)
                ld.bounce = None
            else:
                still.append(ld)
        self._copying = still
        self._feed()

    def _wait_read(self, ld: _Load) -> None:
        """Until ld's bytes are in host memory (device: and its copy is issued)."""
        while True:
            self._pump()
            if ld.read is None:        # still queued for a bounce buffer: copies in flight will free one
                time.sleep(0.0001)
                continue
            try:
                ld.read.result(timeout=0.0005)
            except FutureTimeout:      # not the builtin TimeoutError before Python 3.11
                continue
            self._read_done(ld)
            return

    def _read_done(self, ld: _Load) -> bool:
        """Whether ld's reads are done (device: their copies issued); a native load's event
        becomes ld.event then, if a copy went out."""
        if ld.read is None or not ld.read.done():
            return False
        if ld.native_event is not None:
            ld.event, ld.native_event = (ld.native_event if ld.read.copied() else None), None
        return True

    def _complete(self, ld: _Load) -> bool:
        if not self._read_done(ld):
            return False
        return self.host_memory or (ld.event is not None and ld.event.query())

    def _finish(self, L: _Layer, slot: int, compute_waits: bool) -> None:
        """The load into `slot` (if any) done, or ordered before the working stream's next work."""
        ld = L.pending.pop(slot, None)
        if ld is None:
            return
        self._wait_read(ld)
        if not self.host_memory:
            if compute_waits:
                stream = self.backend.stream
                if stream is not None:
                    stream.wait(ld.event)
                else:
                    ld.event.synchronize()
            else:
                ld.event.synchronize()

    def _slot_tensor(self, L: _Layer, slot: int) -> Tensor:
        g = L.views[slot][0] if slot < L.slots.n else self.overflow_views[slot - L.slots.n][0]
        return g.byte_view(-self.layout.parts[0].offset, self.layout.nbytes)

    # ------------------------------------------------------------------ a step
    def before_step(self) -> bool:
        """Called by the runner before each step. With fill: after the first step, starts the
        background loads of every expert not yet resident; once they are all in place, switches the
        layers to direct descriptors and returns True: the runner then traces its plans again,
        without pauses. Never blocks."""
        if not self.fill or self.direct or self.steps < 1:
            return False
        if not self._filling:
            self._filling = True
            for L in self.layers:
                for e, s in L.slots.fill():
                    self._load(L, e, s, "fill")
                    self.stats["expert_fill_loads"] += 1
            return False
        self._pump()     # device: every read that is done has its copy issued after this
        if not all(self._read_done(ld) for L in self.layers for ld in L.pending.values()):
            return False
        for L in self.layers:
            for slot in list(L.pending):
                self._finish(L, slot, compute_waits=True)   # device: the working stream waits for the copies
            if not L.slots.full:
                return False
        for L, m in zip(self.layers, self._moe):
            v = [L.views[L.slots.slot_of[e]] for e in range(self.E)]
            m.streamed.direct = ([d[0] for d in v], [d[1] for d in v], [d[2] for d in v])
        self.direct = True
        log.info("expert cache: every routed expert is resident; steps run without pauses from now on")
        return True

    def _prefetch(self, L: _Layer, predicted: list) -> None:
        """Start the loads of the predicted experts of layer L that are not resident."""
        for e, s, _ in L.slots.prefetch(predicted):
            self._release(L, s)        # a load still in flight into the victim slot
            self._load(L, e, s, "prefetch")
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
        views = self._issue_ids(*_present(ids, pred))
        if self._ids_event is None:
            self._ids_event = self.backend.create_event()
        self._ids_event.record(self.backend.stream)
        self._early = (pos, views)
        self.route_seconds += time.perf_counter() - t0

    def _issue_ids(self, *ts) -> list:
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
                    h = self._host_buffer(t.nbytes)
                    view = Tensor(h.buffer, t.shape, t.dtype, None, h.offset)
                    v = (t, view.numpy(), self.backend.prepare_copy(view.byte_view(), t.byte_view()), stream)
                self._views[id(t)] = v
            views.append(v[1])
            if v[2] is not None:
                v[2]()
        return views

    def _read_ids(self, *ts) -> list:
        """The routings of a pause (this layer's, and the next layer's prediction), copied: the
        arena reuses their bytes after the pause. The padding rows of a bucketed batch are routed and
        loaded too: which rows share an expert can change a library's blocking, and so the last bits
        of the real rows (the CPU library's does). On a device: asynchronous copies into pinned
        buffers and one synchronization for all of them."""
        views = self._issue_ids(*ts)
        if not self.host_memory:
            t0 = time.perf_counter()
            self.backend.synchronize()
            self.sync_seconds += time.perf_counter() - t0
        return [v.copy() for v in views]

    def _early_ids(self, pos: int) -> list:
        """The routing on_ids sent for layer pos, once its copies are done (waits for them only)."""
        at, views = self._early
        if at != pos:
            raise RuntimeError(f"expert cache: layer {pos}'s pause found the routing of layer {at} (plan order)")
        self._early = None
        t0 = time.perf_counter()
        self._ids_event.synchronize()
        self.sync_seconds += time.perf_counter() - t0
        return [v.copy() for v in views]

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
        got = self._early_ids(pos) if ids is None else self._read_ids(*_present(ids, pred))
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
            self._release(L, s)        # a load still in flight into the victim slot
            self._load(L, e, s, "miss")
        slot_ids = L.slots.table                        # expert -> slot (read before the layer's next route)
        if overflow:
            if len(overflow) > self.n_overflow:
                raise RuntimeError(f"layer {L.index}: {len(needed)} experts routed in one step exceed its "
                                   f"{L.slots.n} slots and the {self.n_overflow} overflow slots")
            slot_ids = slot_ids.copy()
            for j, e in enumerate(overflow):
                s = L.slots.n + j
                slot_ids[e] = s
                self._load(L, e, s, "overflow")
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
        row = self._maps_host[pos]
        self._maps_clean = False
        if self.dry:       # every expert absent: moe_experts skips every pair (and flags it)
            row[...] = -1
            self._send_map(pos)
            return
        if L.pending:
            t0 = time.perf_counter()
            late = 0
            for e in L.needed:
                s = int(L.slot_ids[e])
                ld = L.pending.get(s)
                if ld is not None:
                    if ld.kind == "prefetch" and not self._complete(ld):
                        late += 1      # predicted in time, but its bytes are still on the way
                    self._finish(L, s, compute_waits=True)
            for s in [s for s in L.pending if s >= L.slots.n]:   # overflow loads (all needed by this step)
                self._finish(L, s, compute_waits=True)
            self.stats["expert_prefetch_late"] += late
            self.stats["expert_wait_seconds"] += time.perf_counter() - t0
        # the whole table: entries of loads still in flight are never routed by this step
        row[...] = L.slot_ids
        self._send_map(pos)
        if not self.host_memory:
            self._pump()

    def _send_map(self, pos) -> None:
        """The host rows of the table (one layer's, or "all") to the device, on the working stream."""
        if self.host_memory:
            return
        stream = self.backend.stream
        send = self._map_sends.get(pos)
        if send is None or send[1] is not stream:
            dev, host = (self.maps, self._maps_pinned) if pos == "all" else \
                (self.maps.narrow(0, pos, 1), self._maps_pinned.narrow(0, pos, 1))
            send = self._map_sends[pos] = (self.backend.prepare_copy(dev.byte_view(), host.byte_view()), stream)
        send[0]()

    def end_step(self) -> None:
        """After a step run with pauses (the runner): one more step that loaded nothing, or none."""
        if self.dry:
            return
        self.steps += 1
        self._clean = self._clean + 1 if self._step_loads == 0 else 0
        self._step_loads = 0

    # ------------------------------------------------------------------ pause-free steps
    @contextlib.contextmanager
    def tracing(self, pause_free: bool):
        """`with cache.tracing(True):` the runner traces a pause-free plan (StreamedLayer.pause_free)."""
        for m in self._moe:
            m.streamed.pause_free = pause_free
        try:
            yield
        finally:
            for m in self._moe:
                m.streamed.pause_free = False

    def _record(self, T: int, pos: int) -> tuple:
        """(ids, misses) [T, K] int32: where layer pos of a pause-free T-row step writes its routing
        and misses, views of one record per T that the host reads with one copy."""
        rec = self._records.get(T)
        if rec is None:
            shape = (2, len(self.layers), T, self.K)
            dev = self.backend.empty(shape, "int32", fill=0)
            if self.host_memory:
                rec = (dev, dev.numpy(), None)
            else:
                h = self._host_buffer(dev.nbytes)
                host = Tensor(h.buffer, shape, "int32", None, h.offset)
                rec = (dev, host.numpy(), self.backend.prepare_copy(host.byte_view(), dev.byte_view()))
            self._records[T] = rec
            self._recorded[T] = set()
        self._recorded[T].add(pos)      # the layers a T-row pause-free plan runs (not the MTP layer's)
        rows = rec[0].view(2 * len(self.layers), T, self.K)
        return (rows.narrow(0, pos, 1).view(T, self.K),
                rows.narrow(0, len(self.layers) + pos, 1).view(T, self.K))

    def pause_free_ready(self) -> bool:
        """Whether the coming decode step may run without pauses: recent steps loaded nothing and no
        load is in flight (one whose bytes have all arrived is ordered before the step here)."""
        if not self.pause_free or self.dry or self.direct or self.steps < 1 or self._clean < self._pf_after:
            return False
        self._pump()
        for L in self.layers:
            for slot in list(L.pending):
                if not self._complete(L.pending[slot]):
                    return False
                self._finish(L, slot, compute_waits=True)
        if not self._maps_clean:
            # the tables as they are: the paused steps' rows may name the overflow, which holds
            # another layer's experts by now
            for L in self.layers:
                self._maps_host[L.pos] = L.slots.table
            self._send_map("all")
            self._maps_clean = True
        return True

    def after_pause_free(self, T: int) -> bool:
        """After a pause-free step of T rows: False if some pair missed (the runner then runs the step
        again with pauses); else the policy learns the step's routing, as a paused step would."""
        _, host, copy = self._records[T]
        t0 = time.perf_counter()
        if copy is not None:
            copy()
            self.backend.synchronize()
        ids, missed = host[0], host[1]
        if missed.any():
            self.stats["expert_pause_free_retries"] += 1
            self._pf_after = min(2 * self._pf_after, PAUSE_FREE_AFTER_MAX)
            self._clean = 0
            self.route_seconds += time.perf_counter() - t0
            return False
        S = self.stats
        S["expert_pause_free_steps"] += 1
        self._pf_after = max(PAUSE_FREE_AFTER, self._pf_after // 2)
        self._clean += 1
        self.steps += 1
        for pos in sorted(self._recorded[T]):
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


class _Readers:
    """Reader threads taking jobs by priority (lowest first), in submission order within one: a
    step's misses go ahead of prefetches queued before them, which go ahead of the background fill."""

    def __init__(self, n: int, name: str):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn, *args) -> Future:
        f: Future = Future()
        with self._cv:
            if self._stop:
                raise RuntimeError("expert cache: the readers were shut down (the cache is closed)")
            heapq.heappush(self._heap, (priority, next(self._seq), f, fn, args))
            self._cv.notify()
        return f

    def submit_many(self, priority: int, fn, args_list: list) -> None:
        """fn(*args) for every args of args_list, at one priority, with no Future each (fn reports
        its own outcome): one lock and one wake-up round for all of them."""
        with self._cv:
            if self._stop:
                raise RuntimeError("expert cache: the readers were shut down (the cache is closed)")
            for args in args_list:
                heapq.heappush(self._heap, (priority, next(self._seq), None, fn, args))
            self._cv.notify(len(args_list))

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stop:
                    self._cv.wait()
                if not self._heap:
                    return                        # stopped, nothing left
                _, _, f, fn, args = heapq.heappop(self._heap)
            if f is None:                         # submit_many: fn hands on its own errors
                try:
                    fn(*args)
                except BaseException:             # a bug, not a read error: keep the reader alive
                    log.exception("expert cache: a reader job failed")
                continue
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:            # the waiter re-raises it
                f.set_exception(e)

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the threads."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


def _present(*ts) -> list:
    """A pause's routing tensors that the plan has (the prediction is absent without prefetch)."""
    return [t for t in ts if t is not None]


def _pieces(runs: list, nbytes: int, chunk: int) -> list:
    """An expert's file runs (_merged) cut at every `chunk` bytes of its image: [(runs of the piece,
    image offset, bytes)], each piece a contiguous image range [at, at + bytes) (alignment gaps
    between parts included: their bytes are copied but never read)."""
    out = []
    for lo in range(0, nbytes, chunk):
        hi = min(lo + chunk, nbytes)
        sub = []
        for fd, off, parts in runs:
            fo = off
            for at, n in parts:
                a, b = max(at, lo), min(at + n, hi)
                if a < b:
                    sub.append((fd, fo + (a - at), b - a, a))
                fo += n
        if sub:
            out.append((_merged(sub), lo, hi - lo))
    return out


def _close(reader: "_Readers", natives: list, fds: dict) -> None:
    reader.shutdown(wait=True)
    for native in natives:
        native.shutdown()
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _merged(ranges: list) -> list:
    """[(fd, file offset, bytes, image offset)] -> [(fd, file offset, [(image offset, bytes)])]: ranges
    that follow each other in one file become one run (an expert's gate, up and down usually do,
    in some order), so one preadv reads them into their places in the image."""
    runs = []
    for fd, off, n, at in sorted(ranges, key=lambda r: (r[0], r[1])):
        if runs and runs[-1][0] == fd and runs[-1][1] + sum(k for _, k in runs[-1][2]) == off:
            runs[-1][2].append((at, n))
        else:
            runs.append((fd, off, [(at, n)]))
    return runs


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f

