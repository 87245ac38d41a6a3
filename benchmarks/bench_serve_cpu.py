"""Serving benchmark on the CPU backend with the embedded model: output tokens/s and p50/p99 time
to first token against the number of concurrent clients, continuous batching against static
batches (the engine before issue 11: a batch of up to max_batch requests runs until all of them
finish, arrivals wait), in the same run; then the HTTP server with the same load through the
openai client; then the number of distinct plans after a 1,000-request run.

Workload: `c` closed-loop clients; each sends its next request the moment its previous one ends
(random prompt of 3..60 tokens from the held-out text, random 8..48 new tokens, greedy, eos
ignored so lengths are exact). Every mode sees the same request list.

    python benchmarks/bench_serve_cpu.py [--clients 1 4 16 64] [--out benchmarks/results/serve_cpu_DATE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from deepinfer.engine import Engine, SamplingParams, default_model_dir

CFG = {"backend": "cpu", "precision": "f32", "max_batch": 16, "max_seq_len": 256, "max_queue": 4096}


def workload(n: int, seed: int, tok) -> list:
    rng = random.Random(seed)
    text = (default_model_dir() / "heldout.txt").read_text()
    ids = tok.encode(text)
    out = []
    for _ in range(n):
        L = rng.randint(3, 60)
        s = rng.randrange(0, len(ids) - L)
        out.append((ids[s:s + L], rng.randint(8, 48)))
    return out


def run_engine(eng: Engine, reqs: list, clients: int, static: bool) -> dict:
    """Closed-loop clients on the engine itself (no HTTP): continuous admission or static batches."""
    todo = list(reqs)
    issued, first, done_t, ntok = {}, {}, {}, 0
    t0 = time.perf_counter()

    ready = [t0] * clients      # when each waiting client wanted to send (TTFT counts the wait for a batch)

    def issue():
        ids, n = todo.pop(0)
        rid = eng.add_request(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        issued[rid] = ready.pop(0)
        return rid

    live = set()
    waiting_clients = clients
    while todo or live:
        if static:
            if not live:     # a new static batch: up to max_batch of the clients that wait
                k = min(waiting_clients, eng.config.max_batch, len(todo))
                for _ in range(k):
                    live.add(issue())
                waiting_clients -= k
        else:
            while waiting_clients and todo:
                live.add(issue())
                waiting_clients -= 1
        for o in eng.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter()
            ntok += len(o.token_ids)
            if o.finished:
                done_t[o.request_id] = time.perf_counter()
                live.discard(o.request_id)
                waiting_clients += 1     # this client sends its next request
                ready.append(time.perf_counter())
    wall = time.perf_counter() - t0
    ttft = np.array([first[r] - issued[r] for r in first]) * 1e3
    return {"requests": len(reqs), "output_tokens": ntok, "wall_s": wall, "tokens_per_s": ntok / wall,
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99))}


def run_http(reqs: list, clients: int) -> dict:
    import openai
    import uvicorn

    from deepinfer.serve import build

    app, aengine = build(None, CFG, None, "nano", drain_timeout=5)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    todo = list(reqs)
    ttft, ntok = [], [0]

    async def worker():
        while todo:
            ids, n = todo.pop(0)
            t = time.perf_counter()
            got_first = False
            stream = await client.completions.create(model="nano", prompt=ids, max_tokens=n, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if not got_first and chunk.choices and chunk.choices[0].text:
                    ttft.append((time.perf_counter() - t) * 1e3)
                    got_first = True
            ntok[0] += n

    async def main():
        await asyncio.gather(*(worker() for _ in range(clients)))
        await client.close()

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    server.should_exit = True
    th.join()
    return {"requests": len(reqs), "output_tokens": ntok[0], "wall_s": wall, "tokens_per_s": ntok[0] / wall,
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99))}


def plans_after(eng: Engine, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    reqs = workload(n, seed, eng.tokenizer)
    before = len(eng.runner.plans)
    for i, (ids, _) in enumerate(reqs):
        eng.add_request(ids, SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True))
        if i % 3 == 0:
            eng.step()
    while eng.has_unfinished():
        eng.step()
    keys = sorted(str(k) for k in eng.runner.plans)
    return {"requests": n, "plans_before": before, "plans_after": len(keys), "keys": keys}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-client", type=float, default=2.0)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-http", action="store_true")
    a = ap.parse_args()
    eng = Engine.from_pretrained(None, config=CFG)
    rows = []
    for c in a.clients:
        reqs = workload(max(a.min_requests, int(c * a.requests_per_client)), c, eng.tokenizer)
        row = {"clients": c}
        row["static"] = run_engine(eng, reqs, c, static=True)
        row["continuous"] = run_engine(eng, reqs, c, static=False)
        if not a.no_http:
            row["http"] = run_http(reqs, c)
        rows.append(row)
        print(json.dumps(row), flush=True)
    plans = plans_after(Engine.from_pretrained(None, config=CFG), 1000, 99)
    print(json.dumps({k: v for k, v in plans.items() if k != "keys"}), flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": sys.version.split()[0], "config": CFG, "backend": eng.backend.name}
    result = {"meta": meta, "rows": rows, "plans_after_1000_requests": plans}
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(result, indent=1))
        lines = [f"# Serving on the CPU: continuous vs static batching ({meta['date']}, {meta['machine']}, commit {commit})",
                 "", f"Embedded model, {eng.backend.name} backend, f32, max_batch {CFG['max_batch']}; closed-loop clients, "
                 "prompts 3-60 tokens, 8-48 new tokens (eos ignored). `python benchmarks/bench_serve_cpu.py --out ...`",
                 "", "| clients | requests | mode | output tok/s | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|---|"]
        for r in rows:
            for mode in ("static", "continuous", "http"):
                if mode in r:
                    m = r[mode]
                    lines.append(f"| {r['clients']} | {m['requests']} | {mode} | {m['tokens_per_s']:.0f} | "
                                 f"{m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} |")
        lines += ["", "static: the engine before issue 11 (a batch runs to its end, arrivals wait); continuous: the "
                  "scheduler, on the engine directly; http: the continuous engine behind `deepinfer serve`, streamed "
                  "through the openai client (same requests).", "",
                  f"Distinct plans after {plans['requests']} requests of random lengths: {plans['plans_after']} "
                  f"({', '.join(plans['keys'])})."]
        Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
