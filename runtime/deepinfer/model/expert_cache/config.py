"""The expert cache's configuration: the engine config's `expert_cache` object, parsed and checked,
and the defaults chosen per backend and model where a key is left out."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from ... import validate as V
from ...errors import ConfigError
from ...host_memory import meminfo_available
from .policy import POLICIES

log = logging.getLogger("deepinfer")

SOURCES = ("host", "disk")
# host backends prefetch by default only experts this large: a read then lasts long enough (~200 us
# from the page cache) for the reader to overlap the compute; with small ones (the embedded model's
# 192 KiB) the hand-off and the wrong predictions' reads cost more than the overlap saves
HOST_PREFETCH_MIN_BYTES = 4 << 20


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
    and are run again with pauses when one misses (model.expert_cache.pause_free). Off: every step
    pauses.

    prefetch, when not given: on for device backends, where copies run on their own engine beside the
    kernels; on host backends only for experts of HOST_PREFETCH_MIN_BYTES or more: there the reader
    takes a core from the compute threads, and with small experts its hand-off and the reads of wrong
    predictions (a quarter of them on the embedded model) cost more than it hides
    (benchmarks/results/expert_cache_cpu_*.md: the embedded model, and V2-Lite-sized experts)."""

    capacity: float = 1.0
    source: Optional[str] = None      # None: see default_source
    prefetch: Optional[bool] = None   # None: on for devices, on host backends for large experts
    policy: str = "lfru"
    fill: Optional[bool] = None       # capacity 1.0: load the rest in the background (None: yes)
    # steps without pauses once recent steps found every expert resident (None: yes); see ExpertCache
    pause_free: Optional[bool] = None
    # not a JSON key: False drives the device path (pinned bounce buffers, async copies on a copy
    # stream, events) on a host-memory backend, which is how tests cover it without a GPU
    host_memory: Optional[bool] = None
    # not a JSON key: device disk loads on the native readers (model.expert_cache.native) where the
    # library is built and the backend an ABI library (None: yes), or False: the Python readers
    # (benchmarks)
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


def default_prefetch(host_memory: bool, expert_bytes: int) -> bool:
    """prefetch when not configured: on for devices, on host backends for experts of
    HOST_PREFETCH_MIN_BYTES or more (ExpertCacheConfig says why)."""
    return not host_memory or expert_bytes >= HOST_PREFETCH_MIN_BYTES


def default_source(host_memory: bool, lazy: bool, total: int) -> str:
    """source when not configured: disk on host-memory backends (their slots are host memory
    already) and for lazy loading (each expert is read once: reading all of them up front is what
    lazy loading avoids); on a device, host when every expert (`total` bytes) fits in 80% of the
    host's available memory (a miss is then a pinned copy instead of a file read), else disk."""
    if host_memory or lazy:
        return "disk"
    avail = meminfo_available() or 0
    if total <= 0.8 * avail:
        return "host"
    log.info("expert cache: the %.1f GiB of routed experts exceed 80%% of the host's %.1f GiB available; "
             "misses read the checkpoint files", total / 2**30, avail / 2**30)
    return "disk"
