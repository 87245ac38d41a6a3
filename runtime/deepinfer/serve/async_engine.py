"""The engine thread: one thread owns the Engine and runs its step loop; asyncio handlers talk to it
through a command queue and get their outputs on per-request asyncio queues.

HTTP handlers never call the model: they tokenize and validate (pure, thread-safe work), then
`submit` a request and read RequestOutputs as the engine thread produces them. `abort` (a client
went away) and `shutdown` (SIGINT / SIGTERM: finish what runs, then stop) are commands too, so
every change to the scheduler happens on the engine thread between steps.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ..engine import Engine, QueueFullError, SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("deepinfer")


@dataclass
class _Submitted:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    n: int
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    accepted: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    last_token: dict = field(default_factory=dict)    # choice -> time of its last token (per-token latency)
    done: set = field(default_factory=set)
    priority: int = 0


class EngineStopped(RuntimeError):
    """The engine thread is shutting down or died; no new requests are taken."""


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Optional[ServerMetrics] = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._commands: "queue.Queue" = queue.Queue()
        self._live: dict = {}                 # request id -> _Submitted
        self._stopping = False
        self._draining = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from asyncio handlers
    async def submit(self, request_id: str, prompt_ids: list, params: SamplingParams, n: int = 1,
                     priority: int = 0) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its RequestOutputs arrive on (None after the last
        choice finished). Raises QueueFullError or EngineStopped."""
        if self._stopping or self._draining or self.error is not None:
            raise EngineStopped("the server is shutting down" if self.error is None else f"engine failed: {self.error}")
        loop = asyncio.get_running_loop()
        sub = _Submitted(request_id, prompt_ids, params, n, loop, asyncio.Queue(), loop.create_future(),
                         priority=priority)
        self._commands.put(("add", sub))
        await sub.accepted
        return sub.outputs

    def abort(self, request_id: str) -> None:
        """Stop a request (its client disconnected); safe from any thread, a no-op when it finished."""
        self._commands.put(("abort", request_id))

    def snapshot(self) -> dict:
        """Engine counters for /metrics and /health (read without locking: plain ints)."""
        m = self.engine.stats()
        m["alive"] = self._thread.is_alive() and self.error is None
        return m

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Take no new requests, let running ones finish (up to drain_timeout s), then stop the thread."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while self._live and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                block = not eng.has_unfinished()
                try:
                    while True:
                        cmd, arg = self._commands.get(block=block, timeout=0.5 if block else None)
                        block = False
                        if cmd == "stop":
                            self._abort_all("the server stopped")
                            eng.close()      # a split model's other ranks leave their step loop
                            return
                        self._handle(cmd, arg)
                except queue.Empty:
                    pass
                if eng.has_unfinished():
                    t0 = time.monotonic()
                    outs = eng.step()
                    self.metrics.step_time.observe(time.monotonic() - t0)
                    self._dispatch(outs)
        except BaseException as e:   # the engine failed: fail every request, never hang a client
            log.exception("engine thread failed")
            self.error = e
            self._abort_all(f"engine failed: {e}")
            if getattr(eng, "group", None) is not None:
                # the other ranks of a split model may be waiting inside a step for this one
                eng.group.abort(1)

    def _handle(self, cmd: str, arg) -> None:
        eng = self.engine
        if cmd == "add":
            sub = arg
            try:
                eng.add_request(sub.prompt_ids, sub.params, request_id=sub.request_id, n=sub.n,
                                priority=sub.priority)
            except BaseException as e:      # QueueFullError, ConfigError: the handler answers
                sub.loop.call_soon_threadsafe(_set_exception, sub.accepted, e)
                return
            self._live[sub.request_id] = sub
            self.metrics.requests_started.inc()
            sub.loop.call_soon_threadsafe(_set_result, sub.accepted, True)
            # a request with max_tokens 0 finishes at once: step() returns its outputs
        elif cmd == "abort":
            sub = self._live.pop(arg, None)
            if sub is not None and eng.abort(arg):
                self.metrics.requests_aborted.inc()
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, None)

    def _dispatch(self, outs: list) -> None:
        now = time.monotonic()
        for o in outs:
            sub = self._live.get(o.request_id)
            if sub is None:
                continue          # aborted meanwhile
            if o.token_ids:
                last = sub.last_token.get(o.index)
                if last is None:
                    self.metrics.ttft.observe(now - sub.arrival)
                else:
                    self.metrics.itl.observe(now - last)
                sub.last_token[o.index] = now
                self.metrics.generation_tokens.inc(len(o.token_ids))
                self.metrics.note_tokens(now, len(o.token_ids))
            sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, o)
            if o.finished:
                sub.done.add(o.index)
                if len(sub.done) == sub.n:
                    del self._live[o.request_id]
                    self.metrics.e2e.observe(now - sub.arrival)
                    self.metrics.requests_finished.labels(reason=o.finish_reason or "stop").inc()
                    self.metrics.prompt_tokens.inc(o.num_prompt_tokens * sub.n)
                    sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, None)

    def _abort_all(self, why: str) -> None:
        for rid, sub in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, EngineStopped(why))
        self._live.clear()
        # adds still queued get an answer too
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd == "add":
                arg.loop.call_soon_threadsafe(_set_exception, arg.accepted, EngineStopped(why))


def _set_result(fut, v):
    if not fut.done():
        fut.set_result(v)


def _set_exception(fut, e):
    if not fut.done():
        fut.set_exception(e)


__all__ = ["AsyncEngine", "EngineStopped", "QueueFullError"]
