"""End to end on one GPU: deepinfer against HF transformers and the memory bound, same weights, same
prompts, one run.

    PYTHONPATH=runtime python3 benchmarks/bench_gpu_e2e.py LIB --commit SHA --out-dir benchmarks/results \
        [--layers 8,27] [--batches 1,8,32,64] [--precisions bf16,fp8,int4,w4a8] [--ttft 128,512,2048]

The model is the published DeepSeek-V2-Lite config (tests/data/hub_configs/deepseek-v2-lite.json)
cut to --layers layers (layer 0 dense, the rest MoE), random unit-scale weights drawn by the tests'
re-draw, written in the hub layout as bf16 safetensors by transformers' save_pretrained. transformers
keeps the model it built on the GPU (its default attention and experts implementations) and is
timed on it; deepinfer loads the files through LIB (ModelRunner, bf16 activations, weights as
stored for bf16 or quantized at load for the other precisions, decode steps as CUDA graphs unless
--eager).

Rows, per layer count:
  - decode at each batch: B prompts of --prompt random tokens, prefilled, then --new greedy steps;
    step_ms is the median wall time of one step (deepinfer: forward + sample + reading the ids;
    transformers: one cached forward + argmax), tok/s = B / step.
  - time to first token at batch 1 for each --ttft prompt length: prefill + the first token, median.
  - greedy: the first --greedy tokens of one prompt from both engines (bf16 and each precision),
    the first differing position and transformers' top-1 / top-2 logit margin there (a near-tie
    explains a difference; a large margin would be a bug).
  - bound_ms: bytes one decode step must read (every weight the step touches, in the precision's
    storage, with the expected number of distinct routed experts at that batch, E (1 - (1 - k/E)^B)
    per layer, plus the KV cache of the context) over the device-to-device copy bandwidth measured
    in the same run (2 x bytes / time of a 2 GiB copy).
  - a per-op profile of one batch-1 bf16 decode step (op by op, each synchronized alone).
It writes gpu_e2e_<date>.json (GPU, commit, date, rows) and gpu_e2e_<date>.md into --out-dir, after
every section, so a run cut short still leaves what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_gpu_prefill_profile import category, make_checkpoint  # noqa: E402
from _decode_bytes import step_bytes as _step_bytes  # noqa: E402

from deepinfer.loader import load_library  # noqa: E402
from deepinfer.engine.model_runner import ModelRunner  # noqa: E402
from deepinfer.engine.runner_config import RunnerConfig  # noqa: E402
from deepinfer.model import Checkpoint  # noqa: E402

DEVICE = "cuda"   # the smoke test of this script sets "cpu"
PRECISION_ARG = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "int4", "w8a8": "w8a8", "w4a8": "w4a8"}


# ---------------------------------------------------------------------------- the bound
def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 10."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / float(np.median(ts))


def step_bytes(runner: ModelRunner, B: int, context: int) -> dict:
    """Bytes one decode step of B sequences at `context` tokens reads, by part (_decode_bytes)."""
    return _step_bytes(runner.weights, runner.cfg, B, context)


# ---------------------------------------------------------------------------- transformers
def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_decode(hf, prompts: list, steps: int) -> dict:
    """Cached greedy decode with transformers: median ms of one step, the tokens, the margins."""
    ids = torch.tensor(prompts, device=DEVICE)
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
        pkv = out.past_key_values
        logits = out.logits[:, -1, :].float()
        toks, margins, ts = [], [], []
        for i in range(steps):
            top = torch.topk(logits, 2, dim=-1)
            nxt = top.indices[:, :1]
            toks.append(nxt[:, 0].tolist())
            margins.append((top.values[:, 0] - top.values[:, 1]).tolist())
            sync()
            t0 = time.perf_counter()
            out = hf(input_ids=nxt, past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            logits = out.logits[:, -1, :].float()
            nxt2 = logits.argmax(-1)
            nxt2.cpu()
            ts.append(time.perf_counter() - t0)
    return {"step_ms": float(np.median(ts[2:] if len(ts) > 4 else ts)) * 1e3,
            "tokens": [list(x) for x in zip(*toks)], "margins": [list(x) for x in zip(*margins)]}


def hf_ttft(hf, prompt: list, repeats: int = 3) -> float:
    ids = torch.tensor([prompt], device=DEVICE)
    ts = []
    with torch.no_grad():
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1).cpu()
            ts.append(time.perf_counter() - t0)
            del out
    return float(np.median(ts[1:])) * 1e3


# ---------------------------------------------------------------------------- deepinfer
def di_decode(runner: ModelRunner, prompts: list, steps: int) -> dict:
    B = len(prompts)
    sids = [runner.new_sequence() for _ in prompts]
    try:
        toks = []
        for g in range(0, B, 8):   # prefill in groups of 8 sequences (one plan, bounded activations)
            lg = runner.forward(sids[g:g + 8], prompts[g:g + 8], [0] * len(prompts[g:g + 8]))
            toks += runner.sample(lg, temperature=[0.0] * lg.shape[0])
        out, ts = [toks], []
        pos = len(prompts[0])
        for i in range(steps):
            t0 = time.perf_counter()
            lg = runner.forward(sids, [[t] for t in toks], [pos + i] * B)
            toks = runner.sample(lg, temperature=[0.0] * B)
            ts.append(time.perf_counter() - t0)
            out.append(toks)
        return {"step_ms": float(np.median(ts[2:] if len(ts) > 4 else ts)) * 1e3,
                "tokens": [list(x) for x in zip(*out)]}
    finally:
        for s in sids:
            runner.free(s)


def di_ttft(runner: ModelRunner, prompt: list, repeats: int = 3) -> float:
    ts = []
    for i in range(repeats + 1):
        sid = runner.new_sequence()
        runner.backend.synchronize()
        t0 = time.perf_counter()
        lg = runner.forward([sid], [prompt], [0])
        runner.sample(lg, temperature=[0.0])
        ts.append(time.perf_counter() - t0)
        runner.free(sid)
    return float(np.median(ts[1:])) * 1e3


class EventProfiler:
    """GPU time of every op of the runner's steps, from CUDA events recorded around each bound call
    on the runner's stream (no host synchronization between ops). Each profiled step starts behind a
    sleep kernel on the stream, so the host has queued the whole step before the GPU reaches it and
    the events time the kernels back to back, not the host's pace. Graphs are off meanwhile."""

    def __init__(self, runner: ModelRunner):
        from bench_gpu_prefill_profile import weight_roles

        self.r, self.be = runner, runner.backend
        h = runner.stream.handle if runner.stream is not None else None
        ptr = int(ffi_cast_uintptr(h)) if h is not None else 0
        self.stream = torch.cuda.ExternalStream(ptr) if ptr else torch.cuda.current_stream()
        self.roles = weight_roles(runner)
        self.marks: list = []

    def _unbind(self) -> None:
        for p in self.r.plans.values():
            p._prepared = None
            p.graph = None

    def __enter__(self):
        be, orig = self.be, type(self.be).prepare
        self._graphs, self.r.use_graphs = self.r.use_graphs, False

        def prepare(op, **kw):
            run = orig(be, op, **kw)
            name = op
            if op == "linear":
                name = f"linear:{self.roles.get(id(kw['w']), '?')}"

            def timed():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(self.stream)
                run()
                b.record(self.stream)
                self.marks.append((name, a, b))
            return timed

        self._unbind()
        be.prepare = prepare
        return self

    def __exit__(self, *exc):
        del self.be.prepare
        self._unbind()
        self.r.use_graphs = self._graphs

    def sleep(self) -> None:
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(40_000_000)   # about 20 ms: the host queues the step meanwhile

    def collect(self, steps: int) -> dict:
        torch.cuda.synchronize()
        self.be.synchronize()
        per: dict = {}
        for name, a, b in self.marks:
            rec = per.setdefault(name, [0.0, 0])
            rec[0] += a.elapsed_time(b) * 1e3
            rec[1] += 1
        span = 0.0
        # the span of each step: first op start to last op end
        n = len(self.marks) // steps if steps else 0
        for k in range(steps):
            ms = self.marks[k * n:(k + 1) * n]
            if ms:
                span += ms[0][1].elapsed_time(ms[-1][2]) * 1e3
        self.marks = []
        ops = {k: {"us": v[0] / steps, "calls": v[1] // steps} for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])}
        cats: dict = {}
        for k, v in ops.items():
            c = category(k.split(":")[0])
            cats[c] = cats.get(c, 0.0) + v["us"]
        return {"gpu_span_us": span / steps, "ops_us": sum(v["us"] for v in ops.values()), "per_op": ops,
                "per_category_us": cats}


def ffi_cast_uintptr(h):
    from deepinfer import abi

    return abi.ffi.cast("uintptr_t", h)


class GreedyDecode:
    """len(prompts) sequences prefilled on `runner`; step() runs one greedy decode step of all of them.
    close() frees them."""

    def __init__(self, runner: ModelRunner, prompts: list):
        self.runner, self.B = runner, len(prompts)
        self.sids = [runner.new_sequence() for _ in prompts]
        self.toks = runner.sample(runner.forward(self.sids, prompts, [0] * self.B), temperature=[0.0] * self.B)
        self.pos = len(prompts[0])

    def step(self) -> None:
        r = self.runner
        lg = r.forward(self.sids, [[t] for t in self.toks], [self.pos] * self.B)
        self.toks = r.sample(lg, temperature=[0.0] * self.B)
        self.pos += 1

    def close(self) -> None:
        for s in self.sids:
            self.runner.free(s)


def di_profile(runner: ModelRunner, prompts: list, steps: int = 6) -> dict:
    """Per-op GPU us of one decode step of len(prompts) sequences (EventProfiler), and the eager
    (op-by-op) wall time of a step beside it."""
    dec = GreedyDecode(runner, prompts)
    try:
        with EventProfiler(runner) as prof:
            eager = []
            for i in range(steps):
                t0 = time.perf_counter()
                dec.step()
                if i >= 2:
                    eager.append(time.perf_counter() - t0)
            prof.marks = []
            for i in range(steps):
                prof.sleep()
                dec.step()
            out = prof.collect(steps)
        out["eager_step_ms"] = float(np.median(eager)) * 1e3
        return out
    finally:
        dec.close()


def kernel_profile(runner: ModelRunner, prompts: list, steps: int = 5) -> dict:
    """GPU us per kernel of graph-replayed decode steps (torch.profiler through CUPTI sees the
    library's kernels): every kernel name with its time and calls per step, and the kernels of one
    step in launch order (what a layer runs, kernel by kernel)."""
    from torch.profiler import ProfilerActivity, profile

    dec = GreedyDecode(runner, prompts)
    try:
        for i in range(3):   # capture
            dec.step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                dec.step()
        rows, seq = {}, []
        for e in prof.events():
            if e.device_type.name == "CUDA":
                us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                r = rows.setdefault(e.name[:90], [0.0, 0])
                r[0] += us
                r[1] += 1
                seq.append((e.time_range.start, e.name[:90], us))
        top = sorted(rows.items(), key=lambda kv: -kv[1][0])
        total = sum(v[0] for v in rows.values()) / steps
        per_step = sum(v[1] for v in rows.values()) / steps
        seq.sort()
        one = [{"kernel": k, "us": us} for _, k, us in seq[:int(round(per_step))]]
        return {"kernel_us_per_step": total, "kernels_per_step": per_step,
                "top": [{"kernel": k, "us": v[0] / steps, "calls": v[1] / steps} for k, v in top],
                "one_step": one}
    finally:
        dec.close()


def di_prefill_profile(runner: ModelRunner, prompt: list, steps: int = 3) -> dict:
    """Per-op GPU us of one prefill of `prompt` (EventProfiler)."""
    with EventProfiler(runner) as prof:
        sid = runner.new_sequence()
        runner.forward([sid], [prompt], [0])
        runner.free(sid)
        prof.marks = []
        for i in range(steps):
            sid = runner.new_sequence()
            prof.sleep()
            runner.forward([sid], [prompt], [0])
            runner.free(sid)
        return prof.collect(steps)


def first_diff(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1


# ---------------------------------------------------------------------------- report
def write(res: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_e2e_{res['date'].replace('-', '')}{res.get('tag', '')}"
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# End to end: deepinfer vs HF transformers vs the memory bound ({res['gpu']}, {res['date']}, "
             f"commit {res['commit']})", "",
             f"DeepSeek-V2-Lite shape, random bf16 weights, prompt {res['prompt']} tokens, {res['new']} greedy steps. "
             f"Copy bandwidth {res['copy_gbps']:.0f} GB/s. Command: `{res['command']}`.", "",
             "| layers | engine | precision | batch | step ms | tok/s | bound ms | % of bound | vs HF |",
             "|---|---|---|---|---|---|---|---|---|"]
    hf_step = {(r["layers"], r["batch"]): r["step_ms"] for r in res["rows"] if r["engine"] == "hf" and r["kind"] == "decode"}
    for r in res["rows"]:
        if r["kind"] != "decode":
            continue
        pct = f"{100 * r['bound_ms'] / r['step_ms']:.0f}%" if r.get("bound_ms") else ""
        h = hf_step.get((r["layers"], r["batch"]))
        vs = f"{h / r['step_ms']:.1f}x" if h and r["engine"] == "deepinfer" else ""
        lines.append(f"| {r['layers']} | {r['engine']} | {r['precision']} | {r['batch']} | {r['step_ms']:.2f} | "
                     f"{r['tok_s']:.0f} | {r.get('bound_ms', 0):.2f} | {pct} | {vs} |")
    lines += ["", "| layers | engine | precision | prompt | TTFT ms | vs HF |", "|---|---|---|---|---|---|"]
    hf_t = {(r["layers"], r["prompt"]): r["ttft_ms"] for r in res["rows"] if r["engine"] == "hf" and r["kind"] == "ttft"}
    for r in res["rows"]:
        if r["kind"] == "ttft":
            h = hf_t.get((r["layers"], r["prompt"]))
            vs = f"{r['ttft_ms'] / h:.2f}x HF's time" if h and r["engine"] == "deepinfer" else ""
            lines.append(f"| {r['layers']} | {r['engine']} | {r['precision']} | {r['prompt']} | {r['ttft_ms']:.1f} | {vs} |")
    lines += ["", "| layers | precision | greedy tokens equal to HF's | first difference | HF margin there |",
              "|---|---|---|---|---|"]
    for g in res["greedy"]:
        lines.append(f"| {g['layers']} | {g['precision']} | {g['equal_prefix']}/{g['n']} | {g['first_diff']} | "
                     f"{g['hf_margin_at_diff'] if g['hf_margin_at_diff'] is not None else ''} |")
    for what, prof in res.get("profiles", {}).items():
        eager = f", eager (op-by-op) step {prof['eager_step_ms']:.2f} ms" if "eager_step_ms" in prof else ""
        lines += ["", f"GPU time per op, bf16, {what} (CUDA events around each op, queued behind a sleep so the "
                      f"kernels run back to back): span {prof['gpu_span_us']:.0f} us, ops {prof['ops_us']:.0f} us{eager}.",
                  "", "| op (linear: by weight) | us | calls | us per call |", "|---|---|---|---|"]
        for op, v in prof["per_op"].items():
            lines.append(f"| {op} | {v['us']:.1f} | {v['calls']} | {v['us'] / max(v['calls'], 1):.1f} |")
        if "kernels" in prof:
            k = prof["kernels"]
            L = prof.get("layers") or 1
            lines += ["", f"Kernels of one graph-replayed step (torch.profiler): {k['kernel_us_per_step']:.0f} us of GPU "
                          f"time in {k['kernels_per_step']:.0f} kernels ({k['kernels_per_step'] / L:.1f} per layer over "
                          f"{L} layers).", "", "| kernel | us per step | calls | us per call |", "|---|---|---|---|"]
            for r in k["top"]:
                lines.append(f"| `{r['kernel'][:80]}` | {r['us']:.1f} | {r['calls']:.0f} | "
                             f"{r['us'] / max(r['calls'], 1):.2f} |")
            if k.get("one_step"):
                lines += ["", "The first kernels of one step in launch order (embedding, layer 0 dense, layer 1 MoE, ...):",
                          "", "| # | kernel | us |", "|---|---|---|"]
                for i, r in enumerate(k["one_step"][:60]):
                    lines.append(f"| {i} | `{r['kernel'][:80]}` | {r['us']:.2f} |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--layers", default="8")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--precisions", default="bf16,fp8,int4,w4a8")
    ap.add_argument("--quant-batches", default="1,32", help="batches measured for precisions other than bf16")
    ap.add_argument("--ttft", default="128,512,2048")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--full-layers-batches", default="1", help="batches for layer counts above the first")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (the debug path)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--separate-shared", action="store_true",
                    help="shared experts as their own MLP, not inside moe_experts (RunnerConfig.shared_experts_routed)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--ckpt-dir", default=None,
                    help="keep the random checkpoints here (DIR/L_layers) and reuse them: a second library in "
                         "the same call measures the same weights without writing them again")
    ap.add_argument("--tag", default="", help="appended to the result files' names (gpu_e2e_<date><tag>)")
    a = ap.parse_args()

    be = load_library(a.lib)
    res = {"gpu": torch.cuda.get_device_name(0), "commit": a.commit, "date": datetime.date.today().isoformat(),
           "command": " ".join(["bench_gpu_e2e.py"] + sys.argv[2:]), "prompt": a.prompt, "new": a.new,
           "copy_gbps": copy_bandwidth() / 1e9, "rows": [], "greedy": [], "profiles": {},
           "graphs": not a.eager, "tag": a.tag, "shared_experts_routed": not a.separate_shared}
    print(f"copy bandwidth {res['copy_gbps']:.0f} GB/s", flush=True)
    out_dir = Path(a.out_dir)
    batches = [int(x) for x in a.batches.split(",")]
    qbatches = [int(x) for x in a.quant_batches.split(",")]
    rng = np.random.default_rng(0)
    for li, L in enumerate(int(x) for x in a.layers.split(",")):
        keep = a.ckpt_dir is not None
        tmp = Path(a.ckpt_dir) / f"{L}_layers" if keep else Path(tempfile.mkdtemp(prefix=f"di_e2e_{L}_"))
        try:
            t0 = time.perf_counter()
            hf = None
            if keep and (tmp / "config.json").exists() and a.no_hf:
                print(f"[{L} layers] reusing the checkpoint in {tmp}", flush=True)
            else:
                tmp.mkdir(parents=True, exist_ok=True)
                hf = make_checkpoint(tmp, L, "cuda", torch.bfloat16)
                print(f"[{L} layers] checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
            V = json.loads((tmp / "config.json").read_text())["vocab_size"]
            bl = batches if li == 0 else [int(x) for x in a.full_layers_batches.split(",")]
            maxb = max(bl)
            prompts = rng.integers(0, V, (maxb, a.prompt)).tolist()
            ttft_prompts = {n: rng.integers(0, V, n).tolist() for n in (int(x) for x in a.ttft.split(","))}
            hf_greedy = None
            if not a.no_hf:
                for B in bl:
                    r = hf_decode(hf, prompts[:B], min(a.new, 24))
                    res["rows"].append({"kind": "decode", "layers": L, "engine": "hf", "precision": "bf16", "batch": B,
                                        "step_ms": r["step_ms"], "tok_s": B / r["step_ms"] * 1e3})
                    if B == 1:
                        hf_greedy = hf_decode(hf, prompts[:1], a.greedy)
                    print(f"[{L}] hf B={B} step {r['step_ms']:.2f} ms", flush=True)
                for n, p in ttft_prompts.items():
                    res["rows"].append({"kind": "ttft", "layers": L, "engine": "hf", "precision": "bf16", "prompt": n,
                                        "ttft_ms": hf_ttft(hf, p)})
                write(res, out_dir)
            del hf
            torch.cuda.empty_cache()
            for prec in a.precisions.split(",") if li == 0 else ["bf16"]:
                t0 = time.perf_counter()
                ctx = max(max(ttft_prompts), a.prompt + a.new + 8)
                runner = ModelRunner(Checkpoint(tmp), be, RunnerConfig(
                    max_batch=max(bl), max_seq_len=ctx + 16, dtype="bf16",
                    precision=PRECISION_ARG[prec], load_mtp=False, enforce_eager=a.eager,
                    shared_experts_routed=not a.separate_shared,
                    num_cache_blocks=max(bl) * (-(-(a.prompt + a.new + 16) // 16)) + 2 * (-(-ctx // 16)),
                    max_num_batched_tokens=max(ttft_prompts)))
                print(f"[{L}] deepinfer {prec} loaded in {time.perf_counter() - t0:.0f} s", flush=True)
                for B in (bl if prec == "bf16" else [b for b in bl if b in qbatches]):
                    r = di_decode(runner, prompts[:B], a.new)
                    sb = step_bytes(runner, B, a.prompt + a.new // 2)
                    bound = sb["total"] / (res["copy_gbps"] * 1e9) * 1e3
                    res["rows"].append({"kind": "decode", "layers": L, "engine": "deepinfer", "precision": prec,
                                        "batch": B, "step_ms": r["step_ms"], "tok_s": B / r["step_ms"] * 1e3,
                                        "bound_ms": bound, "bytes": sb})
                    print(f"[{L}] deepinfer {prec} B={B} step {r['step_ms']:.3f} ms (bound {bound:.3f})", flush=True)
                    if B == 1:
                        toks = r["tokens"][0][:a.greedy]
                        g = {"layers": L, "precision": prec, "n": a.greedy, "tokens": toks}
                        if hf_greedy is not None:
                            ref = hf_greedy["tokens"][0]
                            d = first_diff(toks, ref)
                            g.update(hf_tokens=ref, first_diff=d, equal_prefix=a.greedy if d < 0 else d,
                                     hf_margin_at_diff=round(hf_greedy["margins"][0][d], 4) if d >= 0 else None)
                        else:
                            g.update(first_diff=None, equal_prefix=0, hf_margin_at_diff=None)
                        res["greedy"].append(g)
                    write(res, out_dir)
                if prec in ("bf16", "int4"):
                    for n, p in ttft_prompts.items():
                        res["rows"].append({"kind": "ttft", "layers": L, "engine": "deepinfer", "precision": prec,
                                            "prompt": n, "ttft_ms": di_ttft(runner, p)})
                        print(f"[{L}] deepinfer {prec} ttft {n}: {res['rows'][-1]['ttft_ms']:.1f} ms", flush=True)
                if prec == "bf16" and not a.no_profile:
                    for B in sorted({1, max(b for b in bl if b <= 32)}):
                        pr = res["profiles"][f"{L} layers, decode B={B}"] = di_profile(runner, prompts[:B])
                        print(f"[{L}] decode B={B} profile: span {pr['gpu_span_us']:.0f} us, "
                              f"{json.dumps({k: round(v) for k, v in pr['per_category_us'].items()})}", flush=True)
                    for B in sorted({1, max(b for b in bl if b <= 32)}):
                        try:
                            res["profiles"][f"{L} layers, decode B={B}"]["layers"] = L
                            kp = res["profiles"][f"{L} layers, decode B={B}"]["kernels"] = kernel_profile(runner, prompts[:B])
                            print(f"[{L}] kernels B={B}: {kp['kernel_us_per_step']:.0f} us in {kp['kernels_per_step']:.0f} "
                                  f"kernels per step; " + "; ".join(f"{k['kernel'][:50]} {k['us']:.0f}/{k['calls']:.0f}"
                                                                     for k in kp["top"][:12]), flush=True)
                        except Exception as e:   # the profiler is a help, not the measurement
                            print(f"[{L}] kernel profile failed: {type(e).__name__}: {e}", flush=True)
                    n = max(n for n in ttft_prompts if n <= 512)
                    pr = res["profiles"][f"{L} layers, prefill {n}"] = di_prefill_profile(runner, ttft_prompts[n])
                    print(f"[{L}] prefill {n} profile: span {pr['gpu_span_us']:.0f} us, "
                          f"{json.dumps({k: round(v) for k, v in pr['per_category_us'].items()})}", flush=True)
                write(res, out_dir)
                del runner
        finally:
            if not keep:
                shutil.rmtree(tmp, ignore_errors=True)
    write(res, out_dir)
    print((out_dir / f"gpu_e2e_{res['date'].replace('-', '')}{a.tag}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
