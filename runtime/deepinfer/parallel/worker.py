"""Ranks 1..N-1 of a split model: load this rank's share, then run the steps rank 0 sends."""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from ..config import EngineConfig
from ..engine.llm_engine import load_backend_and_runner
from ..errors import DeepinferError
from .group import ParallelGroup, serve_steps



def run_worker(model_dir, config: EngineConfig) -> int:
    """Load the model's share of this rank and execute steps until rank 0 stops; returns the steps
    run. Rank 0 runs an Engine with the same model and config (the two must agree)."""
    group = ParallelGroup(config.tensor_parallel, config.expert_parallel)
    if group.is_driver:
        raise RuntimeError("run_worker is for ranks 1..N-1; rank 0 runs the Engine")
    _, runner = load_backend_and_runner(Path(model_dir), config, group)
    return serve_steps(runner, group)


def guard(fn, *args, **kwargs):
    """Run `fn` on a rank of a multi-rank job; any failure ends the whole job at once (MPI_Abort)
    with the reason on stderr, so no rank is left waiting in a collective for one that is gone."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        if e.code not in (0, None):
            _abort(e.code if isinstance(e.code, int) else 1)
        raise
    except KeyboardInterrupt:
        print("deepinfer: interrupted; stopping every rank", file=sys.stderr)
        _abort(130)
    except BaseException as e:   # noqa: BLE001 (every failure must stop the job)
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
        clean = isinstance(e, DeepinferError)     # errors meant for users: their message, no traceback
        msg = str(e) if clean else "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
        print(f"deepinfer: rank {rank} failed, stopping every rank: {msg}", file=sys.stderr)
        _abort(getattr(e, "exit_code", None) or 1)


def _abort(code: int) -> None:
    sys.stderr.flush()
    sys.stdout.flush()
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(int(code))
    finally:
        os._exit(int(code))
