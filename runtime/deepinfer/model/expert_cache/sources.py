"""Where an expert's bytes come from. The cache's `source` picks between the checkpoint files
("disk") and host images of every expert read at start ("host"); either way an expert is read as
stored when its tensors are plain byte ranges of the checkpoint files in the slots' formats (raw:
one preadv per run of its byte ranges), else converted on the main thread as the eager load
converts it.
"""
from __future__ import annotations

import os

import numpy as np

from ...errors import ConfigError
from ...tensor import Tensor
from .layout import CachedLayer, ImageLayout, host_buffer


def merged(ranges: list) -> list:
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


def pieces(runs: list, nbytes: int, chunk: int) -> list:
    """An expert's file runs (merged) cut at every `chunk` bytes of its image: [(runs of the piece,
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
            out.append((merged(sub), lo, hi - lo))
    return out


def _file_range(ckpt, t: Tensor):
    if not t.on_host or not t.is_contiguous():
        return None
    return ckpt.file_range(t.byte_view().numpy())


def template(loader, prefix: str) -> tuple:
    """(gate, up, down) of expert 0 of the layer at `prefix` as the slots hold them, and whether
    images are raw file bytes."""
    names = loader.expert_names(prefix, 0)
    stored = [loader.stored_weight(n, s) for n, s in names]
    raw = all(w is not None and all(_file_range(loader.ckpt, x) is not None for _, x in ImageLayout.components(w))
              for w in stored)
    if raw:
        return tuple(stored), True
    conv = tuple(loader.expert_weight(n, s) for n, s in names)
    return conv, False


class ExpertSources:
    """An expert's bytes for the loads: its file runs (the open files are kept), its conversion, and
    with source "host" the images of every expert (`images`: per layer, E images in NumPy)."""

    def __init__(self, backend, loader, layout: ImageLayout, raw: bool, host_memory: bool):
        self.backend, self.loader, self.layout = backend, loader, layout
        self.ckpt = loader.ckpt
        self.raw, self.host_memory = raw, host_memory
        self.ranges: dict = {}           # (layer pos, expert) -> its file runs (merged)
        self.fds: dict = {}
        self.images = None

    def fd(self, path) -> int:
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def expert_ranges(self, L: CachedLayer, e: int) -> list:
        key = (L.pos, e)
        r = self.ranges.get(key)
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
                    fr = _file_range(self.ckpt, x)
                    if fr is None:
                        raise ConfigError(f"{L.prefix}experts.{e} is not a plain byte range of the checkpoint")
                    r.append((self.fd(fr[0]), fr[1], p.nbytes, p.offset))
            r = self.ranges[key] = merged(r)
        return r

    def converted(self, L: CachedLayer, e: int) -> tuple:
        """The expert converted on the backend as the eager load converts it (main thread only)."""
        ws = tuple(self.loader.expert_weight(n, s) for n, s in self.loader.expert_names(L.prefix, e))
        self.layout.check(ws, f"{L.prefix}experts.{e}")
        return ws

    @staticmethod
    def pread(ranges: list, dst: np.ndarray) -> None:
        """Read an expert's file runs (merged) into its image `dst`: one preadv per run."""
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

    def write_converted(self, ws: tuple, dst: Tensor) -> None:
        """A converted expert's components into the image bytes `dst` (a host image or a slot),
        copies on the working stream."""
        parts = iter(self.layout.parts)
        for w in ws:
            for _, x in ImageLayout.components(w):
                p = next(parts)
                self.backend.copy_async(dst.byte_view(p.offset, p.nbytes), x.byte_view(0, p.nbytes))

    def build_images(self, layers: list, E: int) -> None:
        """source "host": every expert's image in (pinned) host memory, read once at start."""
        nb = self.layout.nbytes
        self.images = []
        for L in layers:
            img = host_buffer(self.backend, E * nb) if not self.host_memory else Tensor.empty((E * nb,), "uint8")
            raw = img.byte_view().numpy()
            for e in range(E):
                dst = raw[e * nb:(e + 1) * nb]
                if self.raw:
                    self.pread(self.expert_ranges(L, e), dst)
                else:
                    self.write_converted(self.converted(L, e), Tensor(dst, (nb,), "uint8"))
            self.images.append(raw)
        self.backend.synchronize()
