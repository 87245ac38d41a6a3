"""GPU kernel benchmark: the `linear` op of a GPU backend library in every weight format, GEMV to
GEMM, against the hardware bounds and the peers, all measured in one run on one device.

    PYTHONPATH=runtime python3 benchmarks/bench_gpu_linear.py LIB --commit SHA \
        --out benchmarks/results/gpu_linear_<date>.json [--shapes ...] [--formats ...] [--ms 1,2,...]

Per (shape, weight format, M) it first checks the op against torch f32 on the dequantized weights
(output poisoned with NaN before the call; nmse and max error over the reference rms), then times
it. Timing: R calls captured in one CUDA graph (the ABI's graph_begin / graph_end; the peers with
torch.cuda.graph), replayed; time per call = replay time / R. Each call of the R uses the next of
several copies of the weight so that the copies together exceed the 50 MB L2: every call streams
its weight from HBM as a model's layers do. Beside each row, from the same run:
  - the weight bytes (codes + scales + zeros) over the copy bandwidth (device-to-device copy,
    bytes read + written): the memory bound of the call;
  - FLOP/s against the bf16 and fp8 matmul peaks measured here (8192^3 through cuBLAS);
  - peers: cuBLAS bf16 (torch.matmul) on the same shape for every format; torch._scaled_mm (fp8
    e4m3 x e4m3, per-tensor scales) for fp8; tinygemm int4 (aten._weight_int4pack_mm) for int4;
    torch._int_mm (int8 x int8 -> int32, M > 16 only) for int8.
Rows are written to --out after every shape, so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import numpy as np
import torch

from deepinfer import abi
from deepinfer.loader import load_library
from deepinfer.tensor import DeviceBuffer, Quant, Tensor

ffi = abi.ffi
# (N, K) of the decode linears: V2-Lite (H 2048, 16 heads, no q LoRA) and V3 (H 7168, 128 heads)
SHAPES = {
    "V2-Lite q": (3072, 2048), "V2-Lite kv_a": (576, 2048), "V2-Lite kv_b": (4096, 512),
    "V2-Lite o": (2048, 2048), "V2-Lite mlp gate_up": (21888, 2048), "V2-Lite mlp down": (2048, 10944),
    "V2-Lite shared gate_up": (5632, 2048), "V2-Lite shared down": (2048, 2816), "V2-Lite lm_head": (102400, 2048),
    "V3 q_a": (1536, 7168), "V3 q_b": (24576, 1536), "V3 kv_a": (576, 7168), "V3 kv_b": (32768, 512),
    "V3 o": (7168, 16384), "V3 mlp gate_up": (36864, 7168), "V3 mlp down": (7168, 18432),
    "V3 shared gate_up": (4096, 7168), "V3 shared down": (7168, 2048), "V3 lm_head": (129280, 7168),
}
MS = (1, 2, 4, 8, 16, 64, 512, 4096)
# label: (codes dtype, block (rows, cols; 0 = whole dim), scale dtype, zeros)
FORMATS = {
    "bf16": ("bf16", None, None, False),
    "fp8 e4m3 128x128": ("e4m3", (128, 128), torch.float32, False),
    "int8 per channel": ("int8", (1, 0), torch.float32, False),
    "int4 g128": ("int4", (1, 128), torch.bfloat16, False),
    "int4 g64": ("int4", (1, 64), torch.bfloat16, False),
    "int4 g32": ("int4", (1, 32), torch.float16, False),
    "uint4 g128 asym": ("uint4", (1, 128), torch.bfloat16, True),
    # W8A8: int8 weights per channel and int8 activations per token (f32 scales), the integer path
    "w8a8 int8": ("int8", (1, 0), torch.float32, False),
    # fp8 x fp8: e4m3 activations with (1 x 128) scales, e4m3 128 x 128 weights (DeepSeek V3's recipe)
    "fp8 x fp8 blockwise": ("e4m3", (128, 128), torch.float32, False),
}
ACT_QUANT = {"w8a8 int8", "fp8 x fp8 blockwise"}  # formats whose x is quantized (int8 per token, e4m3 1x128)
L2_BYTES = 50 << 20
GRAPH_CALLS = 20


def timed(fn, iters=10, warm=2) -> float:
    """Median seconds of fn() on the current stream."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return float(np.median(ts))


def view(t: torch.Tensor, shape, dtype: str, quant=None) -> Tensor:
    """A deepinfer device Tensor over torch memory (not owned)."""
    return Tensor(DeviceBuffer(t.data_ptr(), t.numel() * t.element_size(), None), shape, dtype, quant=quant)


TORCH_DT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class Weight:
    """One weight [N, K] in a format: codes, scales, zeros on the GPU, and its deepinfer descriptor."""

    def __init__(self, fmt, N, K, gen):
        qdt, block, sdt, zeros = FORMATS[fmt]
        self.fmt, self.N, self.K, self.qdt, self.block = fmt, N, K, qdt, block
        dev = "cuda"
        if qdt == "bf16":
            self.q = (torch.randn(N, K, device=dev, generator=gen) * K ** -0.5).to(torch.bfloat16)
        elif qdt == "e4m3":
            c = torch.randint(0, 256, (N, K), device=dev, dtype=torch.uint8, generator=gen)
            c[(c & 0x7F) == 0x7F] = 0x38  # no NaN codes
            self.q = c
        elif qdt == "int8":
            self.q = torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8, generator=gen)
        else:
            self.q = torch.randint(0, 256, (N, K // 2), device=dev, dtype=torch.uint8, generator=gen)
        self.s = self.z = None
        if block is not None:
            br, bc = block
            shape = (math.ceil(N / (br or N)), math.ceil(K / (bc or K)))
            mag = {"e4m3": 1 / 64, "int8": 1 / 64, "int4": 1 / 8, "uint4": 1 / 8}[qdt] * K ** -0.5
            self.s = (torch.rand(shape, device=dev, generator=gen) * mag + 0.5 * mag).to(sdt)
            if zeros:
                self.z = (torch.rand(shape, device=dev, generator=gen) * 4 + 6).to(sdt)
        self.bytes = sum(t.numel() * t.element_size() for t in (self.q, self.s, self.z) if t is not None)

    def desc(self) -> Tensor:
        quant = None
        if self.s is not None:
            zt = view(self.z, tuple(self.z.shape), TORCH_DT[self.z.dtype]) if self.z is not None else None
            quant = Quant(view(self.s, tuple(self.s.shape), TORCH_DT[self.s.dtype]), self.block, zeros=zt)
        return view(self.q, (self.N, self.K), self.qdt, quant)

    def dequant(self) -> torch.Tensor:
        c = self.q
        if self.qdt == "bf16":
            return c.float()
        if self.qdt == "e4m3":
            v = c.view(torch.float8_e4m3fn).float()
        elif self.qdt == "int8":
            v = c.float()
        else:
            lo, hi = (c & 0xF).to(torch.int16), (c >> 4).to(torch.int16)
            v = torch.stack([lo, hi], -1).reshape(c.shape[0], -1)
            if self.qdt == "int4":
                v = torch.where(v >= 8, v - 16, v)
            v = v.float()
        N, K = v.shape
        br, bc = self.block

        def expand(t):
            return t.float().repeat_interleave(br or N, 0)[:N].repeat_interleave(bc or K, 1)[:, :K]
        if self.z is not None:
            v = v - expand(self.z)
        return v * expand(self.s)


class LinearCall:
    """linear marshalled once per weight copy, sharing one workspace; graph of R calls."""

    def __init__(self, be, stream, x, descs, out, workspace):
        self.be, self.calls = be, []
        xt = x if isinstance(x, Tensor) else view(x, tuple(x.shape), "bf16")
        ot = view(out, tuple(out.shape), TORCH_DT[out.dtype])
        fn, ctx = be._api.linear, be._ctx
        for w in descs:
            kw = dict(x=xt, w=w, out=ot)
            _, ws = be.query("linear", **kw)
            args, keep = be._marshal("linear", kw)
            if ws:
                buf = workspace(ws)
                args.header.workspace = ffi.cast("void*", buf.data_ptr())
                args.header.workspace_size = ws
            args.header.stream = ffi.cast("void*", stream)
            self.calls.append((fn, ctx, args, keep))
        self.graph = None

    def __call__(self, i=0):
        fn, ctx, args, _ = self.calls[i % len(self.calls)]
        st = fn(ctx, args)
        if st != abi.OK:
            raise RuntimeError(f"linear: {abi.STATUS_NAMES.get(st)}: {self.be._error_message(ctx)}")

    def replay_fn(self, stream, R):
        api, ctx, s = self.be._api, self.be._ctx, ffi.cast("void*", stream)
        g = ffi.new("DI_Graph**")
        assert api.graph_begin(ctx, s) == abi.OK, self.be._error_message(ctx)
        st = abi.OK
        for i in range(R):
            st = self.calls[i % len(self.calls)][0](ctx, self.calls[i % len(self.calls)][2])
            if st != abi.OK:
                break
        st_end = api.graph_end(ctx, s, g)
        if st != abi.OK or st_end != abi.OK:
            raise RuntimeError(f"capturing linear: {self.be._error_message(ctx)}")
        self.graph = g
        return lambda: api.graph_launch(ctx, g[0], s)

    def close(self):
        if self.graph is not None:
            self.be._api.graph_destroy(self.be._ctx, self.graph[0])


def torch_graph_time(fns, R) -> float:
    """Seconds per call of fns[i % len(fns)]() for R calls captured in one torch CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()  # warm-up outside capture (cuBLAS workspace, autotuning)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(R):
            fns[i % len(fns)]()
    t = timed(g.replay) / R
    del g
    return t


def peers_for(fmt, ws, x, M):
    """{peer name: [callables, one per weight copy]} for this format (bf16 cuBLAS is added by main)."""
    out = {}
    N, K = ws[0].N, ws[0].K
    if fmt.startswith("fp8"):
        xq = x.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        wq = [w.q.view(torch.float8_e4m3fn) for w in ws]
        out["scaled_mm"] = [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                            for w in wq]
    elif fmt.startswith("int4"):
        g = FORMATS[fmt][1][1]
        packed, sz = [], []
        for w in ws:
            packed.append(torch.ops.aten._convert_weight_to_int4pack(w.q, 8))
            sz.append(torch.ones(K // g, N, 2, device="cuda", dtype=torch.bfloat16) * 0.01)
        out["tinygemm_int4"] = [lambda p=p, z=z: torch.ops.aten._weight_int4pack_mm(x, p, g, z) for p, z in zip(packed, sz)]
    elif (fmt.startswith("int8") or fmt.startswith("w8a8")) and M > 16:
        xq = torch.randint(-127, 128, (M, K), device="cuda", dtype=torch.int8)
        wt = [w.q.t() for w in ws]
        out["int_mm"] = [lambda w=w: torch._int_mm(xq, w) for w in wt]
    return out


def summary_md(result) -> str:
    """The run as markdown: per shape and format, time and the ratio that its target is stated in."""
    rows = result["rows"]
    lines = [f"# linear on {result['gpu']}, {result['date']}, commit {result['commit']}", "",
             f"Copy bandwidth {result['copy_GBps']:.0f} GB/s (read + write), bf16 matmul "
             f"{result['bf16_matmul_TFLOPs']:.0f} TFLOP/s, fp8 matmul {result['fp8_matmul_TFLOPs']:.0f} TFLOP/s "
             f"(cuBLAS 8192^3, same run). Time per call from a graph of {result['graph_calls']} calls over weight "
             "copies larger than L2. Cells: time in us, then for M <= 16 the share of copy bandwidth on the weight "
             "bytes, for M >= 64 TFLOP/s; x = speed-up over cuBLAS bf16 on the same shape.", ""]
    ms = sorted({r["M"] for r in rows})
    lines.append("| shape | format | " + " | ".join(f"M={m}" for m in ms) + " |")
    lines.append("|---|---|" + "---|" * len(ms))
    seen = []
    for r in rows:
        if (r["shape"], r["format"]) not in seen:
            seen.append((r["shape"], r["format"]))
    for shape, fmt in seen:
        by_m = {r["M"]: r for r in rows if r["shape"] == shape and r["format"] == fmt}
        cells = []
        for m in ms:
            r = by_m.get(m)
            if r is None:
                cells.append("")
                continue
            if "error" in r:
                cells.append("ERROR")
                continue
            eff = f"{100 * r['of_copy_bw']:.0f}%" if m <= 16 else f"{r['TFLOPs']:.0f} TF"
            x = f" {r['speedup_vs_cublas_bf16']:.2f}x" if "speedup_vs_cublas_bf16" in r else ""
            bad = "" if r["check_ok"] else " CHECK FAILED"
            cells.append(f"{r['us']:.1f}, {eff}{x}{bad}")
        lines.append(f"| {shape} | {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--small-ms-only", default="int4 g64,int4 g32,uint4 g128 asym",
                    help="formats measured at M <= 16 only (their large-M path is the same dequantize + GEMM)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    a = ap.parse_args()
    t_start = time.time()
    be = load_library(a.lib)
    torch.cuda.init()
    torch.cuda.set_stream(torch.cuda.Stream())  # a created stream: the default one cannot be captured
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "commit": a.commit, "date": datetime.date.today().isoformat(),
              "library": a.lib, "torch": torch.__version__, "graph_calls": GRAPH_CALLS, "rows": []}

    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / timed(lambda: dst.copy_(src), iters=10)
    del src, dst
    A = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / timed(lambda: A @ B, iters=20)
    A8, B8 = A.to(torch.float8_e4m3fn), B.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    peak8 = 2 * 8192 ** 3 / timed(lambda: torch._scaled_mm(A8, B8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                  iters=20)
    del A, B, A8, B8
    result.update(copy_GBps=bw / 1e9, bf16_matmul_TFLOPs=peak / 1e12, fp8_matmul_TFLOPs=peak8 / 1e12)
    print(f"{result['gpu']}: copy {bw / 1e9:.0f} GB/s (read + write), bf16 matmul {peak / 1e12:.0f} TFLOP/s, "
          f"fp8 {peak8 / 1e12:.0f} TFLOP/s", flush=True)

    ws_buf = {}

    def workspace(n):
        if ws_buf.get("t") is None or ws_buf["t"].numel() < n:
            ws_buf["t"] = None
            torch.cuda.empty_cache()
            ws_buf["t"] = torch.empty(n, dtype=torch.uint8, device="cuda")
        return ws_buf["t"]

    def save():
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        if result["rows"]:
            with open(a.out.rsplit(".", 1)[0] + ".md", "w") as f:
                f.write(summary_md(result))

    ms = [int(v) for v in a.ms.split(",")]
    small_only = set(a.small_ms_only.split(",")) if a.small_ms_only else set()
    failures = 0
    for shape in a.shapes.split(","):
        if time.time() - t_start > a.budget_s:
            print(f"budget reached: stopping before {shape}", flush=True)
            result["stopped_early_before"] = shape
            break
        N, K = SHAPES[shape]
        cublas = {}  # M -> cuBLAS bf16 seconds, for the rows of every format
        for fmt in a.formats.split(","):
            w0 = Weight(fmt, N, K, gen)
            copies = max(1, min(16, math.ceil(2 * L2_BYTES / w0.bytes)))
            ws = [w0] + [Weight(fmt, N, K, gen) for _ in range(copies - 1)]
            descs = [w.desc() for w in ws]
            ref_w = w0.dequant()
            for M in ms:
                if fmt in small_only and M > 16:
                    continue
                x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                if fmt == "w8a8 int8":  # per-token int8 activations: codes and f32 scales
                    xs = (x.float().abs().amax(1, keepdim=True).clamp_min(1e-6) / 127).contiguous()
                    xq = torch.round(x.float() / xs).clamp(-127, 127).to(torch.int8).contiguous()
                    x_arg = view(xq, (M, K), "int8", Quant(view(xs, (M, 1), "f32"), (1, 0)))
                    x_ref = xq.float() * xs
                elif fmt in ACT_QUANT:  # e4m3 activations, one f32 scale per 128 columns
                    xb = x.float().reshape(M, K // 128, 128)
                    xs = (xb.abs().amax(2).clamp_min(1e-6) / 448).contiguous()
                    xq = (xb / xs[..., None]).reshape(M, K).to(torch.float8_e4m3fn).contiguous()
                    x_arg = view(xq.view(torch.uint8), (M, K), "e4m3", Quant(view(xs, tuple(xs.shape), "f32"), (1, 128)))
                    x_ref = (xq.float().reshape(M, K // 128, 128) * xs[..., None]).reshape(M, K)
                else:
                    x_arg, x_ref = x, x.float()
                try:
                    call = LinearCall(be, stream, x_arg, descs, out, workspace)
                    out.fill_(float("nan"))
                    call(0)
                    torch.cuda.synchronize()
                except RuntimeError as e:  # a failing call is a failed row, not the end of the run
                    failures += 1
                    result["rows"].append({"shape": shape, "format": fmt, "M": M, "N": N, "K": K,
                                           "error": str(e)[:300], "check_ok": False})
                    print(f"{shape:22s} {fmt:17s} M={M:5d}: ERROR {e}", flush=True)
                    continue
                ref = x_ref @ ref_w.T
                err = out.float() - ref
                rms = ref.pow(2).mean().sqrt().item()
                nmse = (err.pow(2).sum() / ref.pow(2).sum()).item()
                mx = err.abs().max().item() / rms if rms else float("inf")
                if not math.isfinite(nmse):
                    nmse = float("inf")
                ok = nmse <= 2e-4 and mx <= 0.05
                failures += not ok
                del ref, err
                t_op = timed(call.replay_fn(stream, GRAPH_CALLS)) / GRAPH_CALLS
                call.close()
                flops = 2.0 * M * N * K
                row = {"shape": shape, "format": fmt, "M": M, "N": N, "K": K, "us": t_op * 1e6,
                       "weight_MB": w0.bytes / 1e6, "weight_copies": copies, "GBps": w0.bytes / t_op / 1e9,
                       "of_copy_bw": w0.bytes / t_op / bw, "bound_us": w0.bytes / bw * 1e6,
                       "TFLOPs": flops / t_op / 1e12, "of_bf16_peak": flops / t_op / peak,
                       "of_fp8_peak": flops / t_op / peak8, "check_nmse": nmse, "check_max_err_over_rms": mx,
                       "check_ok": ok}
                if not a.no_peers:
                    if M not in cublas:
                        wb = [w.q for w in ws] if fmt == "bf16" else \
                             [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(
                                 max(1, min(16, math.ceil(2 * L2_BYTES / (2 * N * K)))))]
                        cublas[M] = torch_graph_time([lambda w=w: x @ w.t() for w in wb], GRAPH_CALLS)
                        del wb
                    row["cublas_bf16_us"] = cublas[M] * 1e6
                    row["speedup_vs_cublas_bf16"] = cublas[M] / t_op
                    try:
                        for name, fns in peers_for(fmt, ws, x, M).items():
                            tp = torch_graph_time(fns, GRAPH_CALLS)
                            row[f"{name}_us"] = tp * 1e6
                            row[f"speedup_vs_{name}"] = tp / t_op
                    except Exception as e:  # a peer that cannot run is reported, not fatal
                        row["peer_error"] = f"{type(e).__name__}: {e}"[:200]
                result["rows"].append(row)
                peer_txt = "  ".join(f"{k[:-3]} {v:8.1f} us" for k, v in row.items()
                                     if k.endswith("_us") and k not in ("us", "bound_us"))
                print(f"{shape:22s} {fmt:17s} M={M:5d}: {row['us']:9.1f} us  {row['GBps']:6.0f} GB/s "
                      f"({100 * row['of_copy_bw']:3.0f}% copy)  {row['TFLOPs']:6.1f} TFLOP/s  {peer_txt}  "
                      f"check nmse {nmse:.1e} max {mx:.1e} {'ok' if ok else 'FAIL'}", flush=True)
                del call, out, x
            del ws, descs, ref_w, w0
            torch.cuda.empty_cache()
        save()
    save()
    print(f"wrote {a.out}; {failures} check failure(s); {time.time() - t_start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
