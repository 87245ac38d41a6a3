"""The expert cache's native disk readers (runtime/native/expert_reader.c), bound with cffi.

On a device, a disk expert load is read in pieces into a pinned bounce buffer and each piece is sent
to its slot with an asynchronous copy on the cache's copy stream. NativeReaders runs that on native
threads, which call the backend's ABI entries (mem_copy_async, event_record) themselves: no piece
touches the Python interpreter, so the main thread -- deciding the next loads on the device's
critical path -- no longer shares the GIL with the readers. The cache falls back to its Python
readers (model.expert_cache.readers) where the library is missing or the backend has no such
entries (reference backend).
"""
from __future__ import annotations

import os
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Optional

import cffi

from ...abi import ffi as abi_ffi
from ...loader import bundled_lib_dirs

LIB_NAME = "libdi_expert_reader.so"
ENV_LIB = "DEEPINFER_READER_LIB"      # a path to the library, or "off": the Python readers

_CDEF = """
typedef struct er_seg { int32_t fd; int32_t reserved; uint64_t file_off; uint64_t at; uint64_t len; } er_seg;
typedef struct er_pool er_pool;
typedef struct er_job er_job;
er_pool* er_pool_create(int32_t n_threads, void* ctx, void* copy, void* record, void* last_error, void* stream,
                        int32_t kind);
void er_pool_destroy(er_pool* pool);
er_job* er_submit(er_pool* pool, int32_t priority, const er_seg* segs, const uint32_t* piece_first,
                  const uint64_t* piece_at, const uint64_t* piece_len, uint32_t n_pieces, uint8_t* bounce,
                  uint8_t* dst, void* event);
int32_t er_done(er_job* j);
int32_t er_wait(er_job* j, int64_t timeout_us);
void er_cancel(er_job* j);
int32_t er_copied(er_job* j);
int32_t er_error(er_job* j, char* buf, uint64_t size);
void er_release(er_job* j);
void er_pool_hold(er_pool* pool, int32_t hold);
void er_pool_delay(er_pool* pool, int64_t delay_us);
uint64_t er_done_order(er_job* j);
"""

ffi = cffi.FFI()
ffi.cdef(_CDEF)
_lib = None
_lib_error: Optional[str] = None


def library_path() -> Optional[Path]:
    """Where the library is: $DEEPINFER_READER_LIB, else next to the bundled backends."""
    env = os.environ.get(ENV_LIB)
    if env:
        return None if env.lower() == "off" else Path(env)
    for d in bundled_lib_dirs():
        if (d / LIB_NAME).is_file():
            return d / LIB_NAME
    return None


def load():
    """The opened library, or None (why: unavailable_reason())."""
    global _lib, _lib_error
    if _lib is None and _lib_error is None:
        p = library_path()
        if p is None:
            _lib_error = (f"{LIB_NAME} is not built (pip install . builds it) or {ENV_LIB}=off" if
                          os.environ.get(ENV_LIB, "").lower() != "off" else f"{ENV_LIB}=off")
        else:
            try:
                _lib = ffi.dlopen(str(p))
            except OSError as e:
                _lib_error = f"{p}: {e}"
    return _lib


def unavailable_reason() -> Optional[str]:
    load()
    return _lib_error


class Plan:
    """One expert's pieces as the library takes them (built once per expert, reused by every load):
    pieces is [(runs, image offset, bytes)] with runs [(fd, file offset, [(image offset, bytes)])]
    (sources.pieces)."""

    __slots__ = ("segs", "first", "at", "len", "n")

    def __init__(self, pieces: list):
        segs, first, at, ln = [], [0], [], []
        for runs, lo, n in pieces:
            for fd, off, parts in runs:
                fo = off
                for a, k in parts:
                    segs.append((fd, fo, a, k))
                    fo += k
            first.append(len(segs))
            at.append(lo)
            ln.append(n)
        self.segs = ffi.new("er_seg[]", max(1, len(segs)))
        for i, (fd, fo, a, k) in enumerate(segs):
            g = self.segs[i]
            g.fd, g.file_off, g.at, g.len = fd, fo, a, k
        self.first = ffi.new("uint32_t[]", first)
        self.at = ffi.new("uint64_t[]", at)
        self.len = ffi.new("uint64_t[]", ln)
        self.n = len(pieces)


class Job:
    """One load in the native readers: done() once every piece is read and its copy issued (or the
    load given up); result(timeout) as a Future's (raises the load's error)."""

    __slots__ = ("_h", "_keep")

    def __init__(self, handle, keep):
        self._h = ffi.gc(handle, _lib.er_release)
        self._keep = keep          # the bounce buffer and event stay alive while the readers use them

    def done(self) -> bool:
        return bool(_lib.er_done(self._h))

    def wait(self, timeout: Optional[float]) -> bool:
        """Waits (the GIL released) until done or `timeout` seconds; returns done()."""
        us = -1 if timeout is None else max(0, int(timeout * 1e6))
        return bool(_lib.er_wait(self._h, us))

    def result(self, timeout: Optional[float] = None) -> None:
        if not self.wait(timeout):
            raise FutureTimeout()
        err = self.error()
        if err:
            raise OSError(err)

    def error(self) -> Optional[str]:
        buf = ffi.new("char[]", 256)
        return ffi.string(buf).decode("utf-8", "replace") if _lib.er_error(self._h, buf, 256) else None

    def cancel(self) -> None:
        """No copy of the load is issued once this returns."""
        _lib.er_cancel(self._h)

    def copied(self) -> bool:
        return bool(_lib.er_copied(self._h))

    def done_order(self) -> int:
        """Its place among the readers' finished loads (1: the first), 0 while it runs."""
        return int(_lib.er_done_order(self._h))


class NativeReaders:
    """n native reader threads copying to the device on `stream` through `backend`'s own entries."""

    def __init__(self, backend, stream, n: int):
        lib = load()
        ent = backend.native_copy_entries(stream)
        if lib is None or ent is None:
            raise RuntimeError(unavailable_reason() or f"backend {backend.name} has no native copy entries")

        def p(x):
            return ffi.cast("void*", x)

        h = lib.er_pool_create(n, p(ent["ctx"]), p(ent["copy"]), p(ent["record"]), p(ent["last_error"]),
                               p(ent["stream"]), ent["h2d"])
        if h == ffi.NULL:
            raise RuntimeError(f"could not start {n} native expert readers")
        self._pool = h
        # the context and the stream must outlive the readers (shutdown runs first)
        self._backend, self._stream = backend, stream

    def submit(self, priority: int, plan: Plan, bounce, dst=None, event=None) -> Job:
        """Read `plan` into the pinned tensor `bounce` and copy each piece into the device tensor
        `dst`; record `event` (a backend Event) on the stream after the last copy. dst None: read
        only (the bytes stay in `bounce`)."""
        if self._pool is None:
            raise RuntimeError("expert cache: the readers were shut down (the cache is closed)")
        b = ffi.cast("uint8_t*", bounce.data_ptr + bounce.offset)
        d = ffi.NULL if dst is None else ffi.cast("uint8_t*", dst.data_ptr + dst.offset)
        ev = ffi.NULL if event is None else ffi.cast("void*", int(abi_ffi.cast("uintptr_t", event.handle)))
        h = _lib.er_submit(self._pool, priority, plan.segs, plan.first, plan.at, plan.len, plan.n, b, d, ev)
        if h == ffi.NULL:
            raise RuntimeError("expert cache: the native readers refused a load (shut down, or out of memory)")
        return Job(h, (bounce, dst, event, plan))

    def hold(self, on: bool) -> None:
        """While on, the readers take no new piece (tests: fill the queue, then let it run)."""
        _lib.er_pool_hold(self._pool, int(bool(on)))

    def delay(self, seconds: float) -> None:
        """Every piece's read waits this long first: a slow disk (tests)."""
        _lib.er_pool_delay(self._pool, int(seconds * 1e6))

    def shutdown(self) -> None:
        """Give up what is queued, finish the pieces being read, stop the threads."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            _lib.er_pool_destroy(pool)
