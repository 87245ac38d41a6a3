"""The expert cache's loads: an expert's bytes into a slot, from the host images or the checkpoint
files, and what is known about each load until its bytes are in place.

On a backend whose memory is host memory (CPU, reference) a miss is read into its slot on the main
thread (it is waited for at once) and a prefetch by a reader thread (it overlaps the layers computed
until its use). On a device, reader threads read into pinned bounce buffers (disk) and the main
thread sends each with an asynchronous copy on a copy stream; the working stream waits for that
copy's event before the layer's moe_experts, so the host never waits for a transfer. A disk expert
is read in CHUNK_BYTES pieces by DEVICE_READ_THREADS readers, each of which sends its piece on the
copy stream as soon as it is read, so one miss arrives at the threads' aggregate rate; the readers
take misses before queued prefetches, and a slot that goes to another expert gives up the load in
flight into it instead of waiting for it. The readers are native threads (model.expert_cache.native)
that call the backend's mem_copy_async and event_record themselves, so no piece takes the GIL the
main thread needs for the next pause; Python threads (model.expert_cache.readers) do the same where
that library is not built or the backend is not an ABI library.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...errors import ConfigError
from ...tensor import Tensor
from . import native
from .layout import CachedLayer, ImageLayout, host_buffer
from .readers import ReaderThreads
from .sources import ExpertSources, pieces

log = logging.getLogger("deepinfer")

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


@dataclass
class Load:
    dst: Optional[Tensor]    # device: the slot's bytes
    kind: str                # "miss", "prefetch", "overflow" or "fill"
    read: Optional[Future] = None    # device, disk: done once every piece is read and its copy issued
    event: object = None     # device: recorded after the load's copies (None until then)
    bounce: Optional[Tensor] = None
    ranges: Optional[list] = None    # device, disk: the file runs to read
    plan: object = None              # native readers: the same, as they take it (native.Plan)
    # device, disk: the readers' shared state (under lock): pieces still to read, whether any copy
    # went out, whether the load was given up (its slot went to another expert), the first error
    lock: Optional[threading.Lock] = None
    left: int = 0
    copied: bool = False
    cancelled: bool = False
    error: Optional[BaseException] = None
    # native readers: the event they record after the load's copies, ld.event once read is done
    # and a copy went out (read_done)
    native_event: object = None


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class Loads:
    """Starts the loads into the layers' slots (each recorded in CachedLayer.pending until it is
    complete), gives up or waits for them, and owns the readers, the copy stream and the bounce
    buffers they use. `started` counts the loads begun since the cache's last step ended."""

    def __init__(self, backend, layout: ImageLayout, sources: ExpertSources, host_memory: bool, stats: dict,
                 overflow_views: list, overflow_raw: list):
        self.backend, self.layout, self.sources = backend, layout, sources
        self.host_memory, self.stats = host_memory, stats
        self.overflow_views, self.overflow_raw = overflow_views, overflow_raw
        self.read_threads = READ_THREADS if host_memory else DEVICE_READ_THREADS
        self.reader = ReaderThreads(self.read_threads, "deepinfer-experts")
        self.native = None               # device, disk: the native readers (set by start_native)
        self.plans: dict = {}            # (layer pos, expert) -> its pieces for them (native.Plan)
        self.readers = "python"
        self.natives: list = []          # the native readers to shut down with the cache
        self.copy_stream = None          # device: the stream the loads' copies run on
        self.bounce_free: list = []      # device, disk: pinned buffers the readers read into
        self.queued: list = []           # loads waiting for a bounce buffer (misses first)
        self.reading: list = []          # loads being read into one (and sent on by the readers)
        self.copying: list = []          # device: loads whose copies are in flight (bounce buffers held)
        self.chunks: dict = {}           # (layer pos, expert) -> its pieces (sources.pieces)
        self.started = 0

    def start_device(self, source: str, native_readers: Optional[bool], layers: list, E: int) -> None:
        """A device: the copy stream, and for disk loads the bounce buffers, the native readers
        (where they run) and every expert's read plan."""
        be = self.backend
        try:      # copies on a stream of their own, ordered by events: ABI 1.1's optional entries
            self.copy_stream = be.create_stream()
            be.create_event().close()
        except Exception as e:
            raise ConfigError(f"expert_cache on {be.name} needs streams, events and asynchronous copies (ABI "
                              f"1.1), which this library lacks ({e}); load the model without expert_cache")
        if source == "disk":
            per_expert = self.layout.nbytes
            nb = max(2, min(64, BOUNCE_BYTES // per_expert))
            self.bounce_free = [host_buffer(be, per_expert) for _ in range(nb)]
            if self.sources.raw and native_readers is not False:
                self.start_native(native_readers)
            if self.sources.raw:
                # every expert's pieces now (~0.1 ms each, 0.2 s for V2-Lite): planned at its
                # first load instead, that time fell on the pause that waits for it
                for L in layers:
                    for e in range(E):
                        self._plan_reads(L, e)

    def start_native(self, required: Optional[bool]) -> None:
        """Device disk loads on native reader threads (model.expert_cache.native): they pread and
        issue the copies without the GIL. Where they cannot run, the Python readers do the same work
        (an error instead if they were asked for explicitly)."""
        try:
            self.native = native.NativeReaders(self.backend, self.copy_stream, DEVICE_READ_THREADS)
            self.natives.append(self.native)
            self.readers = "native"
        except Exception as e:
            if required:
                raise ConfigError(f"expert_cache: the native readers cannot run ({e})")
            log.info("expert cache: Python readers for disk loads (native readers unavailable: %s)", e)

    def _plan_reads(self, L: CachedLayer, e: int) -> None:
        """Expert e of layer L's disk pieces (and the native readers' form of them)."""
        key = (L.pos, e)
        self.chunks[key] = pieces(self.sources.expert_ranges(L, e), self.layout.nbytes, CHUNK_BYTES)
        if self.native is not None:
            self.plans[key] = native.Plan(self.chunks[key])

    # ------------------------------------------------------------------ starting
    def load(self, L: CachedLayer, e: int, slot: int, kind: str) -> None:
        """Load expert e of layer L into `slot` (>= the layer's slot count: the shared overflow).
        Misses are read at once on host-memory backends (they are waited for right away; the
        reader thread's hand-off would only add to that); everything else is recorded in
        L.pending until it is known to be complete."""
        nb = self.layout.nbytes
        self.stats["expert_bytes_streamed"] += nb
        self.started += 1
        src = self.sources
        if self.host_memory:
            dst = L.raw[slot] if slot < L.slots.n else self.overflow_raw[slot - L.slots.n]
            if not src.raw and src.images is None:
                src.write_converted(src.converted(L, e), Tensor(dst, (nb,), "uint8"))
                self.backend.synchronize()
            elif kind in ("prefetch", "fill"):      # overlaps the layers computed until its use
                job = (np.copyto, (dst, src.images[L.pos][e * nb:(e + 1) * nb])) if src.images is not None \
                    else (src.pread, (src.expert_ranges(L, e), dst))
                L.pending[slot] = Load(None, kind, read=self.reader.submit(PRIORITY[kind], job[0], *job[1]))
            elif src.images is not None:
                np.copyto(dst, src.images[L.pos][e * nb:(e + 1) * nb])
            else:
                src.pread(src.expert_ranges(L, e), dst)
            return
        L.pending[slot] = self._start(L, e, self._slot_tensor(L, slot), kind)

    def _start(self, L: CachedLayer, e: int, slot_t: Tensor, kind: str) -> Load:
        """Device: begin loading expert e of layer L into the bytes of slot_t."""
        ld = Load(slot_t, kind)
        nb = self.layout.nbytes
        src = self.sources
        # device: the bytes go through host memory, then one asynchronous copy on the copy stream
        if src.images is not None:
            img = src.images[L.pos][e * nb:(e + 1) * nb]
            self._issue_copy(ld, Tensor(img, (nb,), "uint8"))
            ld.read = _done()
        elif src.raw:
            ld.ranges = self.chunks[(L.pos, e)]       # planned when the cache was built
            ld.plan = self.plans.get((L.pos, e))
            # a reader takes it once a bounce buffer is free (_feed); misses go before queued prefetches
            p = PRIORITY[kind]
            at = next((i for i, q in enumerate(self.queued) if PRIORITY[q.kind] > p), len(self.queued))
            self.queued.insert(at, ld)
            self._feed()
        else:
            src.write_converted(src.converted(L, e), slot_t)
            ev = self.backend.create_event()
            ev.record(self.backend.stream)
            ld.event = ev
            ld.read = _done()
        return ld

    def _feed(self) -> None:
        """Device, disk: hand queued loads to the readers while bounce buffers are free. Buffers are
        taken and given back on the main thread only, so a reader never waits for one (a reader
        blocked on a buffer that only the main thread can free would hang the process at exit)."""
        while self.queued and self.bounce_free:
            ld = self.queued.pop(0)
            ld.bounce = self.bounce_free.pop()
            if self.native is not None:
                ld.native_event = self.backend.create_event()
                ld.read = self.native.submit(PRIORITY[ld.kind], ld.plan, ld.bounce, ld.dst, ld.native_event)
                self.reading.append(ld)
                continue
            ld.lock, ld.left, ld.read = threading.Lock(), len(ld.ranges), Future()
            # every piece in one hand-off: each submit took the queue's lock and woke a reader, and
            # the GIL traffic of that was a third of a pause's host time (sweep_expert_chunks.py)
            self.reader.submit_many(PRIORITY[ld.kind], self._read_piece, [(ld, piece) for piece in ld.ranges])
            self.reading.append(ld)

    def _read_piece(self, ld: Load, piece: tuple) -> None:
        """Reader thread: one piece of a device disk load into its bounce buffer, then its copy to
        the slot on the copy stream; the last piece records the load's event and completes ld.read.
        A copy is issued under the load's lock, so once _cancel holds it no copy of the load is
        still to come: a later load into the slot is ordered after all of them on the copy stream."""
        runs, at, n = piece
        err = None
        if not ld.cancelled:
            try:
                self.sources.pread(runs, ld.bounce.numpy())
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

    def _issue_copy(self, ld: Load, src: Tensor) -> None:
        nb = self.layout.nbytes
        self.backend.copy_async(ld.dst.byte_view(0, nb), src, self.copy_stream)
        ev = self.backend.create_event()
        ev.record(self.copy_stream)
        ld.event = ev

    def _slot_tensor(self, L: CachedLayer, slot: int) -> Tensor:
        return self.layout.image(L.views[slot] if slot < L.slots.n else self.overflow_views[slot - L.slots.n])

    # ------------------------------------------------------------------ giving up, completing
    def _cancel(self, L: CachedLayer, slot: int) -> None:
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
            if self.sources.images is None:    # written on the working stream: order the copy stream after it
                self.copy_stream.wait(ld.event)
            return
        if ld in self.queued:
            self.queued.remove(ld)
            return
        if ld.lock is None:            # the native readers' load
            ld.read.cancel()           # no copy of it is issued once this returns
            ld.cancelled = True
            return
        with ld.lock:
            ld.cancelled = True

    def release(self, L: CachedLayer, slot: int) -> None:
        """Before a slot takes another expert: on a device the load in flight into it is given up
        (_cancel); on a host-memory backend the reader writes the slot itself and is waited for."""
        if self.host_memory:
            self.finish(L, slot, compute_waits=False)
        else:
            self._cancel(L, slot)

    def pump(self) -> None:
        """Device: take back bounce buffers whose loads are read and copied, start queued reads. A
        load that failed raises here (or where it is waited for)."""
        if self.host_memory:
            return
        done = [x for x in self.reading if self.read_done(x)]
        for ld in done:
            self.reading.remove(ld)
            if ld.event is not None:
                self.copying.append(ld)
            else:                              # given up before any copy: the buffer is free now
                self.bounce_free.append(ld.bounce)
                ld.bounce = None
        for ld in done:
            if not ld.cancelled:
                ld.read.result()
        still = []
        for ld in self.copying:
            if ld.event.query():
                self.bounce_free.append(ld.bounce)
                ld.bounce = None
            else:
                still.append(ld)
        self.copying = still
        self._feed()

    def _wait_read(self, ld: Load) -> None:
        """Until ld's bytes are in host memory (device: and its copy is issued)."""
        while True:
            self.pump()
            if ld.read is None:        # still queued for a bounce buffer: copies in flight will free one
                time.sleep(0.0001)
                continue
            try:
                ld.read.result(timeout=0.0005)
            except FutureTimeout:      # not the builtin TimeoutError before Python 3.11
                continue
            self.read_done(ld)
            return

    def read_done(self, ld: Load) -> bool:
        """Whether ld's reads are done (device: their copies issued); a native load's event
        becomes ld.event then, if a copy went out."""
        if ld.read is None or not ld.read.done():
            return False
        if ld.native_event is not None:
            ld.event, ld.native_event = (ld.native_event if ld.read.copied() else None), None
        return True

    def complete(self, ld: Load) -> bool:
        if not self.read_done(ld):
            return False
        return self.host_memory or (ld.event is not None and ld.event.query())

    def finish(self, L: CachedLayer, slot: int, compute_waits: bool) -> None:
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
