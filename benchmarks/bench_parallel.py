"""Decode throughput of a model split over the ranks of one machine (issue 20).

    mpirun -n 8 python benchmarks/bench_parallel.py --backend cuda --v3-layers 12 --work /data/v3rand
    mpirun -n 2 python benchmarks/bench_parallel.py --backend cpu --model runtime/deepinfer/assets/deepseek-v3-nano --quick

A V3-shaped random bf16 checkpoint (tests/data/hub_configs/deepseek-v3.json cut to --v3-layers
layers, the first dense, the rest MoE with 256 routed experts, top 8, one shared; made once under
--work) or any --model directory runs with tensor parallelism for attention and expert parallelism
for the routed experts over all ranks (tensor_parallel = expert_parallel = ranks), in --precision
(fp8 by default on a GPU: 671B-class weights are served in FP8). At each concurrency (default
1, 8, 64) rank 0 admits that many requests of --prompt random tokens, lets them all prefill, then
times --new decode steps; it reports output tokens/s in total and per GPU and the time per output
token of one sequence (TPOT), the figures SGLang publishes for R1 on 8 GPUs. Rank 0 writes JSON and
a markdown table to --out-dir. The collectives' own bandwidth, beside NCCL's, is
benchmarks/bench_comm.py's job (backends/cuda/device.sh dist and parallel run both in one session).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def decode_rate(engine, concurrency: int, prompt: int, new: int, seed: int) -> dict:
    """Admit `concurrency` requests, run until every one has its first token (prefill), then time the
    steps that produce the remaining new - 1 tokens of each."""
    V = engine.runner.cfg.vocab_size
    rng = np.random.default_rng(seed)
    for _ in range(concurrency):
        engine.add_request(rng.integers(2, V, prompt).tolist(), max_new_tokens=new, temperature=0.0,
                           ignore_eos=True)
    got: dict = {}
    t_prefill = time.perf_counter()
    while len(got) < concurrency:
        for o in engine.step():
            got[o.request_id] = got.get(o.request_id, 0) + len(o.token_ids)
    engine.backend.synchronize()
    t0 = time.perf_counter()
    steps, tokens = 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        tokens += sum(len(o.token_ids) for o in outs)
    engine.backend.synchronize()
    dt = time.perf_counter() - t0
    return {"concurrency": concurrency, "prefill_s": t0 - t_prefill, "decode_steps": steps,
            "decode_tokens": tokens, "decode_s": dt, "tokens_per_s": tokens / dt if dt else 0.0,
            "tpot_ms": 1e3 * dt / steps if steps else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--model", help="a model directory (default: a V3-shaped random checkpoint under --work)")
    ap.add_argument("--work", default="/tmp/deepinfer-v3-random")
    ap.add_argument("--v3-layers", type=int, default=8)
    ap.add_argument("--precision", default=None, help="default: fp8 on a GPU, bf16 on the CPU")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--gpu", default="", help="the device, for the results file (e.g. 8x H200)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 8 new tokens (a smoke test)")
    a = ap.parse_args(argv)

    from deepinfer.config import EngineConfig
    from deepinfer.engine import Engine
    from deepinfer.parallel.launch import world_from_env
    from deepinfer.parallel.worker import guard, run_worker

    rank, world = world_from_env()
    model = Path(a.model) if a.model else Path(a.work)
    if not a.model and rank == 0:
        import _v2lite_random

        _v2lite_random.make(model, a.v3_layers, hub=ROOT / "tests/data/hub_configs/deepseek-v3.json", dense_layers=1)
    if world > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()    # the checkpoint is written before anyone reads it
    precision = a.precision or ("bf16" if a.backend == "cpu" else "fp8")
    conc = [1, 4] if a.quick else [int(c) for c in a.concurrency.split(",")]
    new = 8 if a.quick else a.new
    cfg = EngineConfig.from_any(dict(
        backend=a.backend, precision=precision, tensor_parallel=world, expert_parallel=world,
        max_batch=max(conc), max_seq_len=a.prompt + new + 16, max_num_batched_tokens=max(512, a.prompt * 8),
        kv_cache_tokens=max(conc) * (a.prompt + new + 16) + 1024))
    if rank != 0:
        guard(run_worker, model, cfg)
        return 0

    def drive() -> dict:
        t0 = time.perf_counter()
        eng = Engine(model, cfg)
        load_s = time.perf_counter() - t0
        try:
            decode_rate(eng, 1, a.prompt, 4, 0)      # warm-up: plans traced, graphs captured
            rows = [decode_rate(eng, c, a.prompt, new, 1 + i) for i, c in enumerate(conc)]
        finally:
            eng.close()
        for r in rows:
            r["tokens_per_s_per_rank"] = r["tokens_per_s"] / world
        return {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "backend": a.backend,
                "device": a.gpu or a.backend, "ranks": world, "model": str(model), "precision": precision,
                "layers": eng.runner.cfg.num_hidden_layers, "prompt": a.prompt, "new": new, "load_s": load_s,
                "rows": rows}

    res = guard(drive)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"parallel_{a.backend}_{world}r_{res['date'].replace('-', '')}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Decode, {world} ranks ({res['device']}), {res['precision']}, {res['layers']} layers, "
             f"commit {res['commit']}, {res['date']}", "",
             "| concurrency | tokens/s | tokens/s per rank | TPOT ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s_per_rank']:.1f} | "
              f"{r['tpot_ms']:.2f} |" for r in res["rows"]]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
