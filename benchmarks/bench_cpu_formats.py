"""Throughput of every weight format of the CPU backend's `linear`, GEMV (M=1) and GEMM (M=16, 64).

    PYTHONPATH=runtime python benchmarks/bench_cpu_formats.py [--lib libdeepinfer_cpu.so] [--quick]

Each case is first checked against the NumPy reference backend (same tensors; for the int8
activation paths the activations the CPU backend's own `quantize` op produced, themselves checked
against the reference's quantize); a case that disagrees is reported as MISMATCH and not timed.
Then, per shape and M, every case (formats and baselines) gets 3 warm-up calls and the cases are
timed interleaved: round after round, each case takes one sample (back-to-back calls for ~5 ms) in
a shuffled order, and the result is the median sample (at least --repeats rounds). Interleaving
spreads the load of other processes on a shared machine over all cases alike; the load average
before and after is recorded. The W8A8 / W4A8 rows time the whole path, the per-token activation
`quantize` plus the integer `linear`. Baselines: the backend's own f32 path on the same shape and
torch's CPU matmul (f32 and bf16) with the same thread count.

Writes benchmarks/results/cpu_formats_<UTC date>[_<tag>].json and .md (date, CPU model, threads, git commit,
load average).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from deepinfer import quant_formats as QF  # noqa: E402
from deepinfer import quantizer as Q  # noqa: E402
from deepinfer.loader import load_library  # noqa: E402
from deepinfer.tensor import Quant, Tensor  # noqa: E402

SHAPES = [(2048, 2048), (4096, 1024), (1024, 4096)]      # (N, K) of the weight
MS = (1, 16, 64)


def formats():
    """(label, weight scheme or plain dtype, activation kind)."""
    out = [("f32", "f32", "f32"), ("bf16", "bf16", "f32"), ("int8", QF.make_scheme("int8"), "f32")]
    for g in (32, 64, 128):
        for sym in (True, False):
            out.append((f"int4 g{g} {'sym' if sym else 'asym'}", QF.make_scheme("int4", g, sym), "f32"))
    out.append(("fp8 128x128", QF.make_scheme("fp8"), "f32"))
    out.append(("W8A8", QF.make_scheme("int8"), "int8"))
    for g in (32, 64, 128):
        out.append((f"W4A8 g{g}", QF.make_scheme("int4", g, True), "int8"))
    return out


def find_lib(explicit):
    if explicit:
        return explicit
    for pat in ("/tmp/build*/backends/cpu/libdeepinfer_cpu.so", str(ROOT / "build*/backends/cpu/libdeepinfer_cpu.so"),
                str(ROOT / "runtime/deepinfer/lib/libdeepinfer_cpu.so")):
        hits = sorted(glob.glob(pat), key=os.path.getmtime, reverse=True)
        if hits:
            return hits[0]
    sys.exit("bench_cpu_formats: libdeepinfer_cpu.so not found; build it (cmake -S . -B /tmp/build && "
             "cmake --build /tmp/build -j2) or pass --lib")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_weight(w32: np.ndarray, fmt) -> Tensor:
    if fmt == "f32":
        return Tensor.from_numpy(w32)
    if fmt == "bf16":
        return Tensor.from_numpy(w32, "bf16")
    return Q.quantize_weight(w32, fmt, clip_search=False)


def weight_bytes(t: Tensor) -> int:
    n = t.nbytes
    if t.quant is not None:
        n += t.quant.scales.nbytes + (t.quant.zeros.nbytes if t.quant.zeros is not None else 0)
    return n


def act_quant_out(m: int, k: int) -> Tensor:
    scales = Tensor.empty((m, 1), "f32", fill=np.nan)
    return Tensor(np.zeros((m, k), np.int8), (m, k), "int8", quant=Quant(scales, (1, 0)))


def time_interleaved(cases: dict, rounds: int, min_time: float, warmup: int = 3) -> dict:
    """{label: (median, best) seconds per call}. The cases take turns, one sample each per round in a
    shuffled order, so load from other processes on a shared machine lands on every case alike
    instead of on whichever ran during a busy second. A sample is `inner` back-to-back calls
    (enough for ~5 ms) divided by `inner`."""
    inner = {}
    for label, fn in cases.items():
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-7)
        inner[label] = max(1, min(1000, int(0.005 / one)))
    samples = {label: [] for label in cases}
    order = list(cases)
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    r = 0
    while r < rounds or (time.perf_counter() - start < min_time * len(cases) and r < 200):
        rng.shuffle(order)
        for label in order:
            fn, n = cases[label], inner[label]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[label].append((time.perf_counter() - t0) / n)
        r += 1
    return {label: (statistics.median(v), min(v)) for label, v in samples.items()}


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def close(y: np.ndarray, ref: np.ndarray, k: int) -> tuple[bool, float]:
    """f32 accumulation in another order: error grows with K; 1e-5 * sqrt(K) of the output scale."""
    scale = float(np.max(np.abs(ref))) or 1.0
    err = float(np.max(np.abs(y.astype(np.float64) - ref))) / scale
    return err <= 1e-5 * max(np.sqrt(k), 1.0) + 1e-6, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=11, help="samples per case (at least)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of samples per case (at least)")
    ap.add_argument("--quick", action="store_true", help="one shape, M=1 and 16 (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result file names (e.g. t1 for a --threads 1 run)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from deepinfer.reference import ReferenceBackend

    ref = ReferenceBackend()
    lib = find_lib(args.lib)
    cpu = load_library(lib, num_threads=args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    ms = MS[:2] if args.quick else MS
    rng = np.random.default_rng(0)
    rows = []
    load_before = _loadavg()
    print(f"CPU: {cpu_model()}, {args.threads} threads, backend {lib} ({cpu.info.attributes.get('device.arch', '?')}, "
          f"{cpu.info.attributes.get('cpu.features', '')})")
    for n, k in shapes:
        w32 = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        weights = {label: make_weight(w32, fmt) for label, fmt, _ in formats()}
        wt_f32 = torch.from_numpy(w32)
        wt_bf16 = wt_f32.to(torch.bfloat16)
        for m in ms:
            x32 = rng.standard_normal((m, k)).astype(np.float32)
            x = Tensor.from_numpy(x32)
            cases, case_rows = {}, {}
            for label, fmt, act in formats():
                w = weights[label]
                out = Tensor.empty((m, n), "f32", fill=np.nan)
                row = {"shape": f"{n}x{k}", "N": n, "K": k, "M": m, "format": label,
                       "weight_bytes": weight_bytes(w)}
                rows.append(row)
                try:
                    if act == "int8":
                        xq = act_quant_out(m, k)
                        cpu.quantize(x=x, out=xq)
                        xr = act_quant_out(m, k)
                        ref.quantize(x=x, out=xr)
                        if not (np.array_equal(xq.numpy(), xr.numpy())
                                and np.array_equal(xq.quant.scales.numpy(), xr.quant.scales.numpy())):
                            row["status"] = "MISMATCH (quantize op)"
                            print(f"{n}x{k} M={m:<3} {label:<16} MISMATCH in the activation quantize op")
                            continue
                        cpu.linear(x=xq, w=w, out=out)
                        want = Tensor.empty((m, n), "f32", fill=np.nan)
                        ref.linear(x=xq, w=w, out=want)

                        def fn(xq=xq, w=w, out=out):
                            cpu.quantize(x=x, out=xq)
                            cpu.linear(x=xq, w=w, out=out)
                    else:
                        cpu.linear(x=x, w=w, out=out)
                        want = Tensor.empty((m, n), "f32", fill=np.nan)
                        ref.linear(x=x, w=w, out=want)

                        def fn(w=w, out=out):
                            cpu.linear(x=x, w=w, out=out)
                except Exception as e:  # an unsupported format is a result too, not a crash
                    row["status"] = f"ERROR {type(e).__name__}: {e}"
                    print(f"{n}x{k} M={m:<3} {label:<16} {row['status']}")
                    continue
                ok, err = close(out.numpy(), want.numpy().astype(np.float64), k)
                row["max_rel_err_vs_reference"] = err
                if not ok:
                    row["status"] = "MISMATCH"
                    print(f"{n}x{k} M={m:<3} {label:<16} MISMATCH vs reference (max rel err {err:.2e})")
                    continue
                cases[label], case_rows[label] = fn, row
            xt = torch.from_numpy(x32)
            for label, fn, wb in (("torch f32", lambda: torch.matmul(xt, wt_f32.T), n * k * 4),
                                  ("torch bf16", lambda: torch.matmul(xt.to(torch.bfloat16), wt_bf16.T), n * k * 2)):
                row = {"shape": f"{n}x{k}", "N": n, "K": k, "M": m, "format": label, "weight_bytes": wb}
                rows.append(row)
                cases[label], case_rows[label] = fn, row
            times = time_interleaved(cases, args.repeats, args.min_time)
            for label, (t, best) in times.items():
                case_rows[label].update(status="ok", seconds=t, best_seconds=best, gflops=2 * m * n * k / t / 1e9,
                                        weight_gbps=case_rows[label]["weight_bytes"] / t / 1e9,
                                        best_weight_gbps=case_rows[label]["weight_bytes"] / best / 1e9)
            nan = float("nan")
            for label, r in case_rows.items():
                r["speedup_vs_own_f32"] = times["f32"][0] / r["seconds"] if "f32" in times else nan
                r["best_speedup_vs_own_f32"] = times["f32"][1] / r["best_seconds"] if "f32" in times else nan
                r["speedup_vs_torch_f32"] = times["torch f32"][0] / r["seconds"]
                print(f"{n}x{k} M={m:<3} {label:<16} {r['seconds'] * 1e3:9.3f} ms (best {r['best_seconds'] * 1e3:8.3f}) "
                      f"{r['gflops']:8.2f} GFLOP/s {r['weight_gbps']:7.2f} GB/s  x{r['speedup_vs_own_f32']:.2f} own f32 "
                      f"(best x{r['best_speedup_vs_own_f32']:.2f})  x{r['speedup_vs_torch_f32']:.2f} torch f32")
    now = _dt.datetime.now(_dt.timezone.utc)
    meta = {"date": now.isoformat(timespec="seconds"), "cpu": cpu_model(), "threads": args.threads,
            "commit": git_commit(), "library": lib, "backend_attributes": cpu.info.attributes,
            "torch": torch.__version__, "numpy": np.__version__, "repeats": args.repeats, "min_time_s": args.min_time,
            "load_average_before": load_before, "load_average_after": _loadavg(),
            "method": "3 warm-up calls, then the median of >= repeats samples per case, cases interleaved "
                      "round-robin in shuffled order (each sample ~5 ms of back-to-back calls); W8A8/W4A8 "
                      "include the activation quantize op"}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / (f"cpu_formats_{now.strftime('%Y%m%d')}" + (f"_{args.tag}" if args.tag else ""))
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(meta, rows))
    print(f"wrote {stem}.json and {stem}.md")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def markdown(meta: dict, rows: list) -> str:
    lines = [f"# CPU backend: linear throughput by weight format", "",
             f"- date: {meta['date']}", f"- CPU: {meta['cpu']}, {meta['threads']} threads",
             f"- commit: {meta['commit']}", f"- backend: {meta['library']} (arch {meta['backend_attributes'].get('device.arch', '?')})",
             f"- torch {meta['torch']}, numpy {meta['numpy']}", f"- method: {meta['method']}",
             f"- load average (1/5/15 min) before / after: {meta['load_average_before']} / {meta['load_average_after']}",
             "",
             "Each cell: median ms (speedup over the backend's own f32 path, same shape) / best sample ms "
             "(speedup of best over best). On a loaded machine the best sample is the closer estimate of "
             "the kernel itself; the median is what a process sharing the machine sees.", ""]
    shapes = sorted({(r["N"], r["K"]) for r in rows}, key=lambda s: (-s[0] * s[1], s))
    ms = sorted({r["M"] for r in rows})
    labels = list(dict.fromkeys(r["format"] for r in rows))
    for n, k in shapes:
        lines += [f"## W [{n} x {k}] (N x K)", "", "| format | weight MB | " + " | ".join(f"M={m}" for m in ms)
                  + " | M=1 weight GB/s (median / best) |", "|---|---:|" + "---:|" * len(ms) + "---:|"]
        for label in labels:
            cells, mb, gbps = [], "", ""
            for m in ms:
                r = next((x for x in rows if (x["N"], x["K"], x["M"], x["format"]) == (n, k, m, label)), None)
                if r is None:
                    cells.append("")
                    continue
                mb = f"{r['weight_bytes'] / 1e6:.2f}"
                if r.get("status") != "ok":
                    cells.append(r.get("status", "?").split(":")[0])
                    continue
                cells.append(f"{r['seconds'] * 1e3:.3f} (x{r['speedup_vs_own_f32']:.2f}) / "
                             f"{r['best_seconds'] * 1e3:.3f} (x{r['best_speedup_vs_own_f32']:.2f})")
                if m == 1:
                    gbps = f"{r['weight_gbps']:.1f} / {r['best_weight_gbps']:.1f}"
            lines.append(f"| {label} | {mb} | " + " | ".join(cells) + f" | {gbps} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
