"""One model, computed by one process or by the ranks of an MPI job (tests/test_parallel.py).

    python check_model.py MODEL_DIR OUT.npz --backend cpu                   one process
    mpirun -n 2 python check_model.py MODEL_DIR OUT.npz --backend cpu --tp 2 --ep 2

Rank 0 runs the offline API (prefill of three prompts of different lengths, greedy decode steps, a
decode-mode step with several tokens of one sequence beside one token of another: the chunked-prefill
shape) and greedy generation through the Engine, and writes every logits row and token to OUT; the
other ranks only serve its steps. The test compares the files of one process and of the job.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

PROMPT_LENS = (5, 9, 3)
DECODE_STEPS = 4
GEN_TOKENS = 8


def prompts(vocab: int) -> list:
    rng = np.random.default_rng(1234)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def compute(engine) -> dict:
    """Logits of the offline API and greedy tokens of the engine (the same on every layout)."""
    runner = engine.runner
    be = runner.backend
    V = runner.cfg.vocab_size
    ps = prompts(V)
    out = {}
    sids = [runner.new_sequence() for _ in ps]
    logits = be.to_numpy(runner.forward([(s, p, 0) for s, p in zip(sids, ps)])).copy()
    out["prefill"] = logits
    pos = [len(p) for p in ps]
    steps = []
    for _ in range(DECODE_STEPS):
        toks = logits.argmax(-1).tolist()
        logits = be.to_numpy(runner.forward([(s, [t], n) for s, t, n in zip(sids, toks, pos)])).copy()
        pos = [n + 1 for n in pos]
        steps.append(logits)
    out["decode"] = np.stack(steps)
    # decode mode with several tokens of one sequence (chunked prefill) beside one token of another
    extra = prompts(V)[1][:3]
    logits = be.to_numpy(runner.forward([(sids[0], extra, pos[0]), (sids[2], [7], pos[2])],
                                        all_logits=True)).copy()
    out["chunk"] = logits
    for s in sids:
        runner.free(s)
    gen = engine.generate_ids(ps, max_new_tokens=GEN_TOKENS, temperature=0.0)
    out["greedy"] = np.array([list(g) + [-1] * (GEN_TOKENS - len(g)) for g in gen], np.int64)
    return out


def config(args) -> dict:
    return dict(backend=args.backend, tensor_parallel=args.tp, expert_parallel=args.ep, max_batch=4,
                max_seq_len=64, kv_cache_tokens=1024, activation_dtype=args.dtype, precision=args.precision,
                enforce_eager=not args.graphs)


def die_in_third_step(model, cfg) -> None:
    """A worker that loads, serves two steps, then is killed inside the third (as an OOM kill would)."""
    import signal

    from deepinfer.engine.llm_engine import load_backend_and_runner
    from deepinfer.parallel.group import ParallelGroup, serve_steps

    group = ParallelGroup(cfg.tensor_parallel, cfg.expert_parallel)
    _, runner = load_backend_and_runner(Path(model), cfg, group)
    run, n = runner.run_remote, [0]

    def dying(key, inputs):
        n[0] += 1
        if n[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        run(key, inputs)

    runner.run_remote = dying
    serve_steps(runner, group)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--precision", default="f32")
    ap.add_argument("--graphs", action="store_true", help="device backends: capture decode steps as graphs")
    ap.add_argument("--die", type=int, default=-1, help="this rank dies (SIGKILL) in the middle of its third step")
    args = ap.parse_args(argv)

    from deepinfer.config import EngineConfig
    from deepinfer.engine import Engine
    from deepinfer.parallel.launch import world_from_env
    from deepinfer.parallel.worker import guard, run_worker

    cfg = EngineConfig.from_any(config(args))
    rank, size = world_from_env()
    if rank == args.die and rank != 0:
        die_in_third_step(args.model, cfg)
    if cfg.world_size > 1 and rank != 0:
        guard(run_worker, Path(args.model), cfg)
        return 0

    def driver():
        eng = Engine(Path(args.model), cfg)
        try:
            res = compute(eng)
        finally:
            eng.close()
        np.savez(args.out, **res)

    if cfg.world_size > 1:
        guard(driver)
    else:
        driver()
    return 0


if __name__ == "__main__":
    sys.exit(main())
