"""The expert cache's Python reader threads: they read experts off the main thread (host-memory
backends: prefetches and the background fill; a device without the native readers
(model.expert_cache.native): every piece of a disk load, which they also send to the slot)."""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
from concurrent.futures import Future

log = logging.getLogger("deepinfer")


class ReaderThreads:
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
