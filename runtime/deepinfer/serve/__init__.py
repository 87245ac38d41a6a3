"""`deepinfer serve`: the OpenAI-compatible server.

    app.py           FastAPI routes, OpenAI error shapes, body limit
    protocol.py      pydantic request bodies
    async_engine.py  the engine thread and the asyncio bridge
    metrics.py       Prometheus metrics
"""
from __future__ import annotations

import logging
import signal
from typing import Optional

from ..engine import Engine
from .app import ServerLimits, create_app
from .async_engine import AsyncEngine

log = logging.getLogger("deepinfer")


def build(model=None, config=None, limits=None, served_model_name: Optional[str] = None, drain_timeout: float = 30.0):
    """(FastAPI app, AsyncEngine) for a model; the engine thread is already running."""
    engine = Engine.from_pretrained(model, config=config)
    aengine = AsyncEngine(engine)
    name = served_model_name or (str(model) if model else "deepseek-v3-nano")
    return create_app(aengine, name, limits or ServerLimits(), drain_timeout), aengine


def serve(model=None, config=None, host: str = "127.0.0.1", port: int = 8000, limits=None,
          served_model_name: Optional[str] = None, drain_timeout: float = 30.0, log_level: str = "info") -> None:
    """Run the server until SIGINT / SIGTERM; then stop taking requests, let running ones finish
    (up to drain_timeout seconds) and stop the engine thread."""
    import uvicorn

    app, _ = build(model, config, limits, served_model_name, drain_timeout)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s: reachable from other machines (no authentication)", host)

    # uvicorn drains on SIGTERM, then re-raises it to the handler that was there before: make that
    # one a no-op so a drained server exits 0 (SIGINT still ends as KeyboardInterrupt, status 130)
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(drain_timeout),
                limit_concurrency=None)
