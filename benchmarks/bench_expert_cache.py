"""The expert cache (runtime/deepinfer/model/expert_cache/) against the resident model and its bounds.

    python benchmarks/bench_expert_cache.py [--backend cpu] [--model DIR] [--tokens 384] [--commit SHA]

What it measures, on one model and one backend, in one process:
  1. Real routing: a teacher-forced decode of the model's held-out text (the embedded model's
     heldout.txt: Python files it never trained on), one token per step, recording every MoE layer's
     experts and the experts the next layer's router predicts from this layer's residual.
  2. Policies on that trace (model.expert_cache.policy, the code the engine runs, replayed): hit rate,
     prefetch recall and precision, expert bytes moved per token, for capacities 25/50/75/100% of
     the routed experts, LRU vs LFRU, prefetch off vs on.
  3. Real decode of the same tokens: resident (every expert loaded at start) and streamed at each
     capacity, plain LRU without prefetch vs LFRU with prefetch: tokens/s, the engine's own counters,
     output bit-identical to the resident run, and the transfer bound: the resident step time plus
     the bytes a streamed step moved divided by the source bandwidth measured here (pread of the
     experts' byte ranges for source "disk"; host-to-device copies on a device).
  4. Cold start: process start to first generated token, lazy (capacity 1.0: experts load when first
     routed) against eager, in fresh processes.
Results: benchmarks/results/expert_cache_<backend>_<date>_<commit>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from deepinfer.engine.llm_engine import default_model_dir  # noqa: E402
from deepinfer.engine.model_runner import ModelRunner  # noqa: E402
from deepinfer.engine.runner_config import RunnerConfig  # noqa: E402
from deepinfer.engine.tokenizer import Tokenizer  # noqa: E402
from deepinfer.loader import get_backend  # noqa: E402
from deepinfer.model.expert_cache.policy import LayerSlots  # noqa: E402
from deepinfer.precision import default_activation_dtype  # noqa: E402

CAPACITIES = (0.25, 0.5, 0.75, 1.0)
REPEATS = 7           # timed passes of each bandwidth measurement (the best one counts)
CONFIGS = {    # the streamed runs of each capacity
    "lru": ("lru, no prefetch", {"policy": "lru", "prefetch": False}),
    "lfru": ("lfru, no prefetch", {"policy": "lfru", "prefetch": False}),
    "lfru+prefetch": ("lfru + prefetch", {"policy": "lfru", "prefetch": True}),
}


# ---------------------------------------------------------------------------------------- the runs
def runner_for(args, expert_cache):
    be = get_backend(args.backend, num_threads=args.threads)
    if isinstance(expert_cache, dict) and args.source:     # (an ExpertCacheConfig is taken as it is)
        expert_cache = {**expert_cache, "source": args.source}
    # the activations the engine picks for this backend (bf16 on a device: a runner's own default is f32)
    return ModelRunner(args.model, be, RunnerConfig(max_batch=1, precision=args.precision, expert_cache=expert_cache,
                                                    max_seq_len=args.tokens + 8, dtype=default_activation_dtype(be)))


def decode(r: ModelRunner, tokens: list) -> dict:
    """Teacher-forced decode: token i goes in at position i, one step each; returns step times and
    the argmax of every step (what bit-identity is checked on)."""
    sid = r.new_sequence()
    times, argmax, logits = [], [], []
    for i, t in enumerate(tokens):
        t0 = time.perf_counter()
        lg = r.forward([(sid, [t], i)])
        row = r.backend.to_numpy(lg)[0]
        times.append(time.perf_counter() - t0)
        argmax.append(int(np.argmax(row)))
        logits.append(row.copy())
    r.free(sid)
    return {"times": times, "argmax": argmax, "logits": logits}


def trace_routing(args, tokens: list):
    # prefetch: the predictions are traced; no fill and no pause-free steps: every step keeps its
    # pauses (and so its trace)
    r = runner_for(args, {"capacity": 1.0, "prefetch": True, "fill": False, "pause_free": False})
    r.experts.trace = []
    decode(r, tokens)
    ex = r.experts
    # the same tokens again: every expert they route to is resident now, so this pass is a step with
    # every expert in place that still pauses at each MoE layer (reads the routing, runs the policy,
    # writes the slot ids): what selection costs on the critical path when nothing is missing
    trace, ex.trace = ex.trace, None
    misses = ex.stats["expert_misses"]
    before = (ex.route_seconds, ex.sync_seconds, ex.stats["expert_wait_seconds"], ex.pauses)
    again = decode(r, tokens)
    n = max(ex.pauses - before[3], 1)
    paused = {"times": again["times"], "misses": ex.stats["expert_misses"] - misses,
              # per pause: host time in the routed pause, of it waiting for the GPU to get there, and
              # time waiting for loads before moe_experts (none: everything is resident)
              "route_us_per_pause": 1e6 * (ex.route_seconds - before[0]) / n,
              "sync_us_per_pause": 1e6 * (ex.sync_seconds - before[1]) / n,
              "wait_us_per_pause": 1e6 * (ex.stats["expert_wait_seconds"] - before[2]) / n,
              "pauses_per_step": n / len(tokens)}
    # a third time with pause-free steps allowed (the default): the kernels find every expert in the
    # table on the device, the host reads the step's routing afterwards
    ex.pause_free = True
    s0, r0 = ex.stats["expert_pause_free_steps"], ex.stats["expert_pause_free_retries"]
    free = decode(r, tokens)
    paused["pause_free"] = {"times": free["times"], "steps": ex.stats["expert_pause_free_steps"] - s0,
                            "retries": ex.stats["expert_pause_free_retries"] - r0,
                            "logits": free["logits"]}
    steps, cur = [], {}
    for pos, needed, pred in trace:
        # pos -1: the step-start prefetch of a hash-routed first layer (V4), before layer 0's pause
        if pos <= 0 and (cur.keys() - {-1}):
            steps.append(cur)
            cur = {}
        cur[pos] = (needed, pred)
    if cur:
        steps.append(cur)
    out = steps, len(ex.layers), ex.E, ex.layout.nbytes, r.backend.name, r.dtype, paused
    ex.close()
    del r, ex
    gc.collect()        # its device memory goes now, not when a cycle is next collected (a GPU's 31 GB)
    return out


def simulate(steps: list, n_layers: int, E: int, capacity: float, policy: str, prefetch: bool) -> dict:
    """The engine's bookkeeping (LayerSlots.route / prefetch, in pause order) over a routing trace."""
    n = min(E, max(1, int(round(capacity * E))))
    layers = [LayerSlots(E, n, policy) for _ in range(n_layers)]
    need = hits = loads = pf = pf_used_pred = pred_total = need_pred = 0
    for step in steps:
        for pos in range(-1, n_layers):
            if pos not in step:
                continue
            if pos < 0:         # the step-start prefetch of layer 0 (hash-routed: exact)
                if prefetch:
                    pf += len(layers[0].prefetch(step[pos][1]))
                continue
            needed, pred = step[pos]
            L = layers[pos]
            if L.predicted:
                pred_total += len(L.predicted)
                pf_used_pred += len(L.predicted.intersection(needed))
                need_pred += len(needed)
            h, _, ld, ov = L.route(needed)
            need += len(needed)
            hits += len(h)
            loads += len(ld) + len(ov)
            if prefetch and pred is not None and pos + 1 < n_layers:
                got = layers[pos + 1].prefetch(pred)
                pf += len(got)
    T = max(len(steps), 1)
    return {"capacity": capacity, "policy": policy, "prefetch": prefetch, "slots_per_layer": n,
            "hit_rate": hits / need if need else None, "misses_per_token": loads / T,
            "prefetch_loads_per_token": pf / T, "loads_per_token": (loads + pf) / T,
            "prefetch_recall": pf_used_pred / need_pred if need_pred else None,
            "prefetch_precision": pf_used_pred / pred_total if pred_total else None}


def source_bandwidth(r: ModelRunner) -> dict:
    """Bytes/s of the expert source as the cache reads it, each path measured as the cache runs it
    (the page cache warm: everything is read once untimed first): "read", pread of the experts'
    byte ranges (source disk; as many Python threads as the cache runs readers), and where the cache
    runs native readers "read_native" (the same reads on them, into its pinned bounce buffers) and
    "pipeline_native" (reads and their copies to the device together, as a load does them); or
    "memcpy" from the host images (source host on a host backend); "h2d", a pinned host to device
    copy (devices). Each is the best of REPEATS timed passes (the highest rate: the tightest bound).
    "bound" is the slowest stage a load passes through, the faster of the two reads counting as
    the read stage (so a faster reader tightens the bound; pipeline_native is reported, not used)."""
    from concurrent.futures import ThreadPoolExecutor

    ex = r.experts
    nb = ex.layout.nbytes
    out = {}
    if ex.source == "host" and ex.host_memory:
        buf = np.empty(nb, np.uint8)
        imgs = [img[e * nb:(e + 1) * nb] for img in ex.sources.images for e in range(ex.E)]
        for src in imgs:
            np.copyto(buf, src)
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for src in imgs:
                np.copyto(buf, src)
            best = min(best, time.perf_counter() - t0)
        out["memcpy"] = len(imgs) * nb / best
    elif ex.source == "disk" and ex.raw:
        jobs = [ex.sources.expert_ranges(L, e) for L in ex.layers for e in range(ex.E)][:256]
        threads = ex.read_threads         # as many readers as the cache runs
        bufs = [np.empty(nb, np.uint8) for _ in range(threads)]

        def read(i):
            ex.sources.pread(jobs[i], bufs[i % threads])

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(len(jobs))))
            best = float("inf")
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                list(pool.map(read, range(len(jobs))))
                best = min(best, time.perf_counter() - t0)
            out["read"] = len(jobs) * nb / best
        if ex.loads.native is not None:
            out.update(native_bandwidth(r, len(jobs)))
    if not ex.host_memory:
        be = r.backend
        host = be.host_empty((nb * 8,), "uint8")
        dev = be.empty((nb * 8,), "uint8")
        be.copy_async(dev, host)
        be.synchronize()
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for _ in range(5):
                be.copy_async(dev, host)
            be.synchronize()
            best = min(best, time.perf_counter() - t0)
        out["h2d"] = 5 * nb * 8 / best
    stages = {k: v for k, v in out.items() if k != "pipeline_native"}
    if "read_native" in stages:
        stages["read"] = max(stages.pop("read"), stages.pop("read_native"))
    out["bound"] = min(stages.values()) if stages else float("nan")
    return out


def native_bandwidth(r: ModelRunner, count: int) -> dict:
    """The cache's native readers (model.expert_cache.native) on its first `count` experts, with the read
    plans the cache made for them: reads only into its pinned bounce buffers ("read_native"), and
    reads with each piece's copy to the device ("pipeline_native"), as many loads in flight as the
    cache has bounce buffers."""
    ex = r.experts
    nb = ex.layout.nbytes
    bounces = list(ex.loads.bounce_free)
    plans = [ex.loads.plans[(L.pos, e)] for L in ex.layers for e in range(ex.E)][:count]
    dev = [r.backend.empty((nb,), "uint8") for _ in range(min(8, len(bounces)))]

    def run(copy: bool) -> float:
        t0 = time.perf_counter()
        inflight = []
        for i, plan in enumerate(plans):
            if len(inflight) == len(bounces):      # a bounce buffer is free once its copies are done
                job, ev = inflight.pop(0)
                job.result()
                if ev is not None:
                    ev.synchronize()
            ev = r.backend.create_event() if copy else None
            inflight.append((ex.loads.native.submit(0, plan, bounces[i % len(bounces)],
                                               dev[i % len(dev)] if copy else None, ev), ev))
        for job, _ in inflight:
            job.result()
        r.backend.synchronize()
        ex.copy_stream.synchronize()
        return time.perf_counter() - t0

    out = {}
    for name, copy in (("read_native", False), ("pipeline_native", True)):
        run(copy)
        out[name] = len(plans) * nb / min(run(copy) for _ in range(REPEATS))
    return out


def cold_start(args, cache: bool, repeats: int) -> list:
    """Seconds from process start to the first generated token (fresh interpreter each time)."""
    code = (
        "import time, sys\n"
        "t_spawn = float(sys.argv[1])\n"
        "import deepinfer\n"
        "from deepinfer.engine import Engine\n"
        "cfg = {'backend': sys.argv[2], 'max_batch': 1, 'max_seq_len': 256}\n"
        "if sys.argv[4] == '1': cfg['expert_cache'] = {'capacity': 1.0}\n"
        "e = Engine.from_pretrained(sys.argv[3], config=cfg)\n"
        "for o in e.stream('def main(', max_new_tokens=1):\n"
        "    break\n"
        "print(time.time() - t_spawn)\n")
    out = []
    for _ in range(repeats):
        p = subprocess.run([sys.executable, "-c", code, repr(time.time()), args.backend, str(args.model),
                            "1" if cache else "0"], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "runtime")})
        if p.returncode != 0:
            raise RuntimeError(f"cold start run failed: {p.stderr[-2000:]}")
        out.append(float(p.stdout.strip().splitlines()[-1]))
    return out


def heldout_tokens(model: Path, text: Optional[str], n: int) -> tuple:
    """(text file, its first n token ids): `text`, else the model's heldout.txt, else the embedded
    model's; tokenized by the model's tokenizer, else the embedded model's."""
    path = Path(text) if text else (model / "heldout.txt" if (model / "heldout.txt").exists()
                                    else default_model_dir() / "heldout.txt")
    tok = Tokenizer(model if (model / "tokenizer.json").exists() else default_model_dir())
    return path, tok.encode(path.read_text())[:n]


def med(x):
    return statistics.median(x) if x else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--text", help="text to decode (default: the model's heldout.txt, else the embedded model's)")
    ap.add_argument("--tokens", type=int, default=384, help="decode steps (teacher-forced tokens)")
    ap.add_argument("--warmup", type=int, default=32, help="steps left out of the timing (not of the counters)")
    ap.add_argument("--precision", default="bf16", help="weights' precision (default bf16: what the engine picks for a bf16 checkpoint)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cold-repeats", type=int, default=5)
    ap.add_argument("--capacities", type=float, nargs="+", default=list(CAPACITIES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--source", choices=("host", "disk"), help="every streamed run's source (default: the engine's)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    args.model = Path(args.model)
    text_path, ids = heldout_tokens(args.model, args.text, args.tokens)
    res = {"date": dt.date.today().isoformat(), "commit": args.commit, "backend": args.backend,
           "model": args.model.name, "text": text_path.name, "tokens": len(ids), "host": platform.node(),
           "cpu": platform.processor() or platform.machine(), "precision": args.precision, "warmup": args.warmup,
           "command": "python benchmarks/bench_expert_cache.py " + " ".join(sys.argv[1:])}

    # 1-2: routing and policies
    steps, n_layers, E, nb, res["backend"], res["activations"], paused = trace_routing(args, ids)
    res.update(moe_layers=n_layers, experts_per_layer=E, expert_bytes=nb)
    sims = [simulate(steps, n_layers, E, c, pol, pf) for c in args.capacities for pol in ("lru", "lfru")
            for pf in (False, True)]
    for s in sims:
        s["bytes_per_token"] = s["loads_per_token"] * nb
    res["simulated"] = sims

    # 4 (first: on a large model it is the row a device call cut short must not lose): cold start
    if args.cold_repeats:
        eager = cold_start(args, False, args.cold_repeats)
        lazy = cold_start(args, True, args.cold_repeats)
        res["cold_start"] = {"eager_s": eager, "lazy_s": lazy, "eager_median_s": med(eager),
                             "lazy_median_s": med(lazy), "lazy_vs_eager": med(lazy) / med(eager)}
        print(json.dumps({"cold_start": res["cold_start"]}), flush=True)
    # 3: real decode
    resident = runner_for(args, None)
    base = decode(resident, ids)
    t_res = med(base["times"][args.warmup:])
    res["resident"] = {"step_ms": 1e3 * t_res, "tok_s": 1 / t_res}
    t_paused = med(paused["times"][args.warmup:])
    free = paused.pop("pause_free")
    res["paused_all_resident"] = {"step_ms": 1e3 * t_paused, "vs_resident": t_paused / t_res,
                                  "overhead_us_per_pause": 1e6 * (t_paused - t_res) / paused["pauses_per_step"],
                                  **{k: v for k, v in paused.items() if k != "times"}}
    t_free = med(free["times"][args.warmup:])
    res["pause_free_all_resident"] = {"step_ms": 1e3 * t_free, "vs_resident": t_free / t_res,
                                      "pause_free_steps": free["steps"], "retries": free["retries"],
                                      "steps": len(free["times"]),
                                      "bit_identical": all(np.array_equal(a, b) for a, b in
                                                           zip(base["logits"], free["logits"]))}
    res["runs"] = runs = []
    bw = None
    for c in args.capacities:
        for label, opts in (CONFIGS[k] for k in args.configs):
            r = runner_for(args, {"capacity": c, **opts})
            if bw is None:
                parts = source_bandwidth(r)
                bw = parts["bound"]
                res["source"] = r.experts.source
                res["source_bandwidth_GBps"] = bw / 1e9
                res["source_stages_GBps"] = {k: v / 1e9 for k, v in parts.items() if k != "bound"}
            out = decode(r, ids)
            st = r.expert_stats()
            t = med(out["times"][args.warmup:])
            moved = st["expert_bytes_streamed"] / len(ids)
            bound = t_res + moved / bw
            same = all(np.array_equal(a, b) for a, b in zip(base["logits"], out["logits"]))
            runs.append({"capacity": c, "config": label, "step_ms": 1e3 * t, "tok_s": 1 / t,
                         "vs_resident": t / t_res, "transfer_bound_ms": 1e3 * bound, "vs_bound": t / bound,
                         "hit_rate": st["expert_hit_rate"], "prefetch_recall": st["expert_prefetch_recall"],
                         "prefetch_precision": st["expert_prefetch_precision"],
                         "prefetch_late": st["expert_prefetch_late"], "bytes_per_token": moved,
                         "misses_per_token": st["expert_misses"] / len(ids),
                         "stalls_per_token": (st["expert_misses"] + st["expert_prefetch_late"]) / len(ids),
                         "wait_ms_per_token": 1e3 * st["expert_wait_seconds"] / len(ids),
                         "route_ms_per_token": 1e3 * r.experts.route_seconds / len(ids),
                         "cache_bytes": st["expert_cache_bytes"], "total_expert_bytes": st["expert_total_bytes"],
                         "pause_free_steps": st["expert_pause_free_steps"],
                         "pause_free_retries": st["expert_pause_free_retries"],
                         "bit_identical": same})
            r.experts.close()
            del r
            gc.collect()
            print(json.dumps(runs[-1]), flush=True)
            write(res, Path(args.out_dir), quiet=True)     # what a run cut short has measured so far

    write(res, Path(args.out_dir))
    return 0


def write(res: dict, out: Path, quiet: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"expert_cache_{res['backend']}_{res['date'].replace('-', '')}_{res['commit']}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=float))
    f = lambda v, p=3: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    L = [f"# Expert cache on {res['backend']}: {res['model']}, {res['tokens']} tokens of {res['text']}", "",
         f"{res['date']}, commit {res['commit']}, {res['cpu']}, backend {res['backend']}, {res['precision']} weights, "
         f"{res['activations']} activations. Command: `{res['command']}`. "
         f"{res['moe_layers']} streamed MoE layers x "
         f"{res['experts_per_layer']} experts of {res['expert_bytes']} bytes; batch 1, teacher-forced decode "
         f"(every step feeds the text's next token).", "",
         "## Policies on the model's real routing (the engine's bookkeeping replayed on the recorded trace)", "",
         "| capacity | policy | prefetch | hit rate | prefetch recall | prefetch precision | loads/token | "
         "KiB moved/token |", "|---|---|---|---|---|---|---|---|"]
    for s in res["simulated"]:
        L.append(f"| {s['capacity']:.0%} | {s['policy']} | {'on' if s['prefetch'] else 'off'} | {f(s['hit_rate'])} | "
                 f"{f(s['prefetch_recall'])} | {f(s['prefetch_precision'])} | {f(s['loads_per_token'], 2)} | "
                 f"{s['bytes_per_token'] / 1024:.0f} |")
    r0 = res["resident"]
    L += ["", f"## Decode, measured (median step after {res.get('warmup', 32)} warm-up steps)", "",
          f"Resident model: {r0['step_ms']:.3f} ms/step ({r0['tok_s']:.0f} tok/s). Source `{res['source']}` moves "
          f"{res['source_bandwidth_GBps']:.2f} GB/s, its slowest stage (measured here: "
          f"{', '.join(f'{k} {v:.2f} GB/s' for k, v in res['source_stages_GBps'].items())}). Transfer bound = resident step + bytes moved per "
          f"token / that bandwidth. Stalls: loads a step waited for (misses, and prefetches not yet complete); "
          f"wait: time waiting for loads another thread or stream was doing; host: time in the pauses (reading "
          f"the routing, the policy, and on host backends the misses' reads).", "",
          "| capacity | config | tok/s | step ms | vs resident | bound ms | vs bound | hit rate | recall | "
          "precision | stalls/token | KiB/token | wait ms/token | host ms/token | identical |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        L.append(f"| {r['capacity']:.0%} | {r['config']} | {r['tok_s']:.0f} | {r['step_ms']:.3f} | "
                 f"{r['vs_resident']:.2f}x | {r['transfer_bound_ms']:.3f} | {r['vs_bound']:.2f}x | {f(r['hit_rate'])} | "
                 f"{f(r['prefetch_recall'])} | {f(r['prefetch_precision'])} | {r['stalls_per_token']:.2f} | "
                 f"{r['bytes_per_token'] / 1024:.0f} | {r['wait_ms_per_token']:.3f} | {r['route_ms_per_token']:.3f} | "
                 f"{'yes' if r['bit_identical'] else 'NO'} |")
    pr = res.get("paused_all_resident")
    if pr:
        L += ["", f"Every expert in place, pauses kept (capacity 100% without fill, the text decoded a second "
              f"time: {pr['misses']} misses): {pr['step_ms']:.3f} ms/step = {pr['vs_resident']:.2f}x the resident "
              f"step. This is what expert selection costs on the critical path: a step whose experts were all "
              f"predicted and loaded in time. Per pause ({pr['pauses_per_step']:.0f} a step): "
              f"{pr['overhead_us_per_pause']:.0f} us more than the resident step; host time in the routed pause "
              f"{pr['route_us_per_pause']:.0f} us, of it {pr['sync_us_per_pause']:.0f} us waiting for the device to "
              f"reach it; before moe_experts {pr['wait_us_per_pause']:.0f} us."]
    pf = res.get("pause_free_all_resident")
    if pf:
        L += ["", f"Every expert in place, pause-free steps (the default; the same text a third time): "
              f"{pf['step_ms']:.3f} ms/step = **{pf['vs_resident']:.2f}x the resident step** "
              f"({pf['pause_free_steps']} of {pf['steps']} steps ran without pauses, {pf['retries']} were run again; "
              f"logits {'bit-identical' if pf['bit_identical'] else 'DIFFERENT'} to the resident model's). The kernels "
              f"read each expert's slot from the table on the device (moe_experts' expert_map, ABI 1.5); the host "
              f"reads the step's routing and misses once, after the step."]
    cs = res.get("cold_start")
    if cs:
        L += ["", "## Cold start (process start to first token, fresh processes)", "",
              f"eager {cs['eager_median_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in cs['eager_s'])}); lazy "
              f"{cs['lazy_median_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in cs['lazy_s'])}): lazy = "
              f"{cs['lazy_vs_eager']:.2f} x eager."]
    (out / f"{stem}.md").write_text("\n".join(L) + "\n")
    if not quiet:
        print("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
