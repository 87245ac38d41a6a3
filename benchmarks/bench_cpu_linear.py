"""The CPU backend's linear at decode and prefill shapes, every weight path, timed through graph replays.

    PYTHONPATH=runtime python benchmarks/bench_cpu_linear.py [LIB] [--threads N] [--shapes v2lite|nano]
        [--json out.json]

Rows: bf16 weights with f32 x (the as-stored path), int8 / int4 weights with f32 x (weight-only) and
with int8 x (W8A8 / W4A8: VNNI rows, AMX tiles at M >= 16 where the CPU has them). Each call is
captured many times in one graph and replayed, so the timing is the kernel's, not Python's. The
result of every path is checked against NumPy on the same dequantized weights first. Reports GB/s of
weight bytes (the decode figure of merit) and GFLOP/s (prefill). DEEPINFER_CPU_ISA caps the kernels
(compare avx512vnni with amx). Not a test: numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

SHAPES = {  # (M, N, K): decode GEMVs and prefill GEMMs of the model's linears
    "v2lite": [(1, 10944, 2048), (1, 2048, 1408), (1, 3072, 2048), (16, 10944, 2048), (128, 1408, 2048),
               (128, 3072, 2048)],
    "nano": [(1, 4096, 256), (1, 384, 128), (128, 4096, 256), (128, 384, 128)],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lib", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--shapes", default="v2lite", choices=sorted(SHAPES))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import ml_dtypes

    import deepinfer
    from deepinfer.tensor import Quant, Tensor

    be = deepinfer.loader.load_library(a.lib, num_threads=a.threads) if a.lib else \
        deepinfer.get_backend("cpu", num_threads=a.threads)
    s = be.create_stream()
    be.set_stream(s)
    arch = be.attributes().get("device.arch")
    rng = np.random.default_rng(0)
    rows = []
    print(f"{be.attributes().get('device.name')}  arch={arch}  threads={a.threads}  "
          f"DEEPINFER_CPU_ISA={os.environ.get('DEEPINFER_CPU_ISA', '')}")
    for M, N, K in SHAPES[a.shapes]:
        wf = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        xf = rng.standard_normal((M, K)).astype(np.float32)
        x = be.upload(Tensor.from_numpy(xf))
        xs = be.empty((M, 1), "f32")
        xq = Tensor(be.empty((M, K), "int8").buffer, (M, K), "int8", None, 0, Quant(xs, (1, 0)))
        be.call("quantize", x=x, out=xq, scale_pow2=0)
        wdev = be.upload(Tensor.from_numpy(wf))
        variants = [("bf16", "f32 x", be.upload(Tensor.from_numpy(wf.astype(ml_dtypes.bfloat16))), x, 2.0)]
        for wdt, g, nbytes in (("int8", 0, 1.0), ("int4", 128, 0.5)):
            sc = be.empty((N, 1 if g == 0 else K // g), "f32")
            wq = Tensor(be.empty((N, K // 2 if wdt == "int4" else K), "uint8").buffer, (N, K), wdt, None, 0,
                        Quant(sc, (1, g)))
            be.call("quantize", x=wdev, out=wq, scale_pow2=0)
            variants.append((wdt, "f32 x", wq, x, nbytes))
            variants.append((wdt, "int8 x", wq, xq, nbytes))
        out = be.empty((M, N), "f32")
        for wname, xname, w, xx, bpe in variants:
            be.linear(x=xx, w=w, out=out)
            got = be.to_numpy(out)
            wd = be.to_numpy(w).astype(np.float32) if w.quant is None else _dequant(be, w, N, K)
            xd = be.to_numpy(x) if xname == "f32 x" else be.to_numpy(xx).astype(np.float32) * be.to_numpy(xs)
            ref = xd @ wd.T
            err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
            reps = max(2, min(400, int(3e8 // (M * N * K))))
            g = be.capture([be.prepare("linear", x=xx, w=w, out=out)] * reps)
            g.launch()
            best = 1e9
            for _ in range(5):
                t0 = time.perf_counter()
                g.launch()
                best = min(best, (time.perf_counter() - t0) / reps)
            g.close()
            r = {"M": M, "N": N, "K": K, "weights": wname, "x": xname, "us": best * 1e6,
                 "weight_GBps": N * K * bpe / best / 1e9, "GFLOPs": 2 * M * N * K / best / 1e9, "max_rel_err": err}
            rows.append(r)
            print(f"M={M:4d} N={N:6d} K={K:6d} {wname:5s} {xname:7s} {r['us']:10.1f} us {r['weight_GBps']:7.1f} GB/s "
                  f"{r['GFLOPs']:8.1f} GFLOP/s  rel.err {err:.1e}")
    if a.json:
        Path(a.json).write_text(json.dumps({"arch": arch, "threads": a.threads, "rows": rows}, indent=1))


def _dequant(be, w, N, K):
    out = be.empty((N, K), "f32")
    be.dequantize(x=w, out=out)
    return be.to_numpy(out)


if __name__ == "__main__":
    main()
