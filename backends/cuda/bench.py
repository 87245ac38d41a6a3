"""Decode hot-path benchmarks of libdeepinfer_cuda.so on the GPU: GEMV per weight format and
mla_decode, against the device-to-device copy bandwidth and cuBLAS (torch) measured in the same run.

    PYTHONPATH=runtime python3 backends/cuda/bench.py path/to/libdeepinfer_cuda.so [--json out.json]

The library is driven through the ABI (cffi); torch provides CUDA events, a stream and the peers.
Each figure is the median of timed calls after warm-up; weights are far larger than the 60 MB L2.
"""
from __future__ import annotations

import argparse
import json
import sys

import ml_dtypes
import numpy as np
import torch

from deepinfer import abi
from deepinfer.loader import load_library
from deepinfer.tensor import Quant, Tensor

ffi = abi.ffi


def timed(fn, iters=30, warm=5) -> float:
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


def op_caller(be, op, stream, **kw):
    """A zero-argument callable that issues one op on `stream` with pre-marshalled args."""
    args, keep = be._marshal(op, kw)
    sup, ws = be.query(op, **kw)
    if ws:
        buf = be._alloc(ws)
        keep.append(buf)
        args.header.workspace = ffi.cast("void*", buf.ptr)
        args.header.workspace_size = ws
    args.header.stream = ffi.cast("void*", stream)
    fn = getattr(be._api, op)
    ctx = be._ctx

    def call():
        st = fn(ctx, args)
        if st != abi.OK:
            raise RuntimeError(f"{op}: {abi.STATUS_NAMES.get(st)}: {be._error_message(ctx)}")

    call.keep = keep
    return call


def weight(fmt: str, N: int, K: int, rng) -> tuple[Tensor, int]:
    """A host weight of one format and its byte count (codes + scales)."""
    if fmt == "bf16":
        w = rng.standard_normal((N, K), np.float32).astype(ml_dtypes.bfloat16)
        return Tensor.from_numpy(w), w.nbytes
    if fmt == "fp8":
        codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
        s = rng.uniform(0.5, 2, ((N + 127) // 128, (K + 127) // 128)).astype(np.float32)
        t = Tensor.from_numpy(codes.view(ml_dtypes.float8_e4m3fn), quant=Quant(Tensor.from_numpy(s), (128, 128)))
        return t, codes.nbytes + s.nbytes
    if fmt == "int4":
        codes = rng.integers(-7, 8, (N, K), dtype=np.int8)
        s = rng.uniform(0.01, 0.02, (N, K // 128)).astype(ml_dtypes.bfloat16)
        t = Tensor.from_numpy(codes, "int4", quant=Quant(Tensor.from_numpy(s), (1, 128)))
        return t, N * K // 2 + s.nbytes
    if fmt == "int8":
        codes = rng.integers(-127, 128, (N, K), dtype=np.int8)
        s = rng.uniform(0.01, 0.02, (N, 1)).astype(np.float32)
        return Tensor.from_numpy(codes, quant=Quant(Tensor.from_numpy(s), (1, 0))), codes.nbytes + s.nbytes
    raise ValueError(fmt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--json")
    a = ap.parse_args()
    be = load_library(a.lib)
    torch.cuda.init()
    stream = torch.cuda.current_stream().cuda_stream
    rng = np.random.default_rng(0)
    rows = []

    # ceiling: device-to-device copy, bytes read + written
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters=10)
    bw = 2 * src.numel() / t
    del src, dst
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    rows.append({"what": "copy", "GB/s": bw / 1e9})

    N, K = 18432, 7168
    wt = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
    for M in (1, 8):
        xt = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
        t = timed(lambda: xt @ wt.T)
        rows.append({"what": f"cuBLAS bf16 M={M}", "us": t * 1e6, "GB/s": wt.numel() * 2 / t / 1e9})
        print(f"cuBLAS bf16 {N}x{K} M={M}: {t * 1e6:.1f} us, {wt.numel() * 2 / t / 1e9:.0f} GB/s of weight", flush=True)
    del wt

    for fmt in ("bf16", "fp8", "int4", "int8"):
        w_host, wbytes = weight(fmt, N, K, rng)
        w = be.upload(w_host)
        del w_host
        for M in (1, 4, 8):
            x = be.upload(Tensor.from_numpy(rng.standard_normal((M, K), np.float32).astype(ml_dtypes.bfloat16)))
            out = be.empty((M, N), "bf16")
            call = op_caller(be, "linear", stream, x=x, w=w, out=out)
            t = timed(call)
            frac = wbytes / t / bw * 2
            rows.append({"what": f"linear {fmt} M={M}", "us": t * 1e6, "GB/s": wbytes / t / 1e9, "of_copy_bw": frac})
            print(f"linear {fmt:5s} {N}x{K} M={M}: {t * 1e6:8.1f} us, {wbytes / t / 1e9:6.0f} GB/s of weight "
                  f"({100 * frac:.0f}% of copy bandwidth/2)", flush=True)
        del w

    # small layers of DeepSeek-V2-Lite (kv_a, o_proj, one expert): too few rows to fill the GPU alone
    for fmt, n_, k_ in (("bf16", 576, 2048), ("bf16", 2048, 2048), ("int4", 2048, 2048), ("fp8", 1408, 2048)):
        w_host, wbytes = weight(fmt, n_, k_, rng)
        w = be.upload(w_host)
        x = be.upload(Tensor.from_numpy(rng.standard_normal((1, k_), np.float32).astype(ml_dtypes.bfloat16)))
        out = be.empty((1, n_), "f32")
        call = op_caller(be, "linear", stream, x=x, w=w, out=out)
        t = timed(call, iters=50)
        # these shapes take the split-K path; check it against the dequantized weight on the host
        if fmt == "bf16":
            wd = np.asarray(be.to_numpy(w), np.float32)
        else:
            wdt = be.empty((n_, k_), "f32")
            be.call("dequantize", x=w, out=wdt)
            wd = be.to_numpy(wdt)
        ref = np.asarray(be.to_numpy(x), np.float32) @ wd.T
        got = be.to_numpy(out)
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
        print(f"  split-K check: max |err| / max |ref| = {err:.2e}", flush=True)
        if err > 1e-4:
            print(f"  SPLIT-K MISMATCH for {fmt} {n_}x{k_}", flush=True)
        rows.append({"what": f"linear {fmt} {n_}x{k_} M=1", "us": t * 1e6, "GB/s": wbytes / t / 1e9})
        print(f"linear {fmt:5s} {n_}x{k_} M=1: {t * 1e6:8.1f} us, {wbytes / t / 1e9:6.0f} GB/s of weight", flush=True)

    # mla_decode, DeepSeek-V2-Lite shapes: H=16, Dc=512, Dr=64, Dn=128, Dv=128, block size 64
    H, Dc, Dr, Dn, Dv, BS = 16, 512, 64, 128, 128, 64
    for B, ctx_len in ((1, 4096), (32, 4096), (1, 32768)):
        MB = ctx_len // BS
        NB = B * MB
        cache = be.upload(Tensor.from_numpy(rng.standard_normal((NB, BS, Dc + Dr), np.float32).astype(ml_dtypes.bfloat16)))
        wkv = be.upload(Tensor.from_numpy((rng.standard_normal((H * (Dn + Dv), Dc), np.float32) * 0.05).astype(ml_dtypes.bfloat16)))
        q = be.upload(Tensor.from_numpy(rng.standard_normal((B, H, Dn + Dr), np.float32).astype(ml_dtypes.bfloat16)))
        bt = be.upload(Tensor.from_numpy(rng.permutation(NB).astype(np.int32).reshape(B, MB)))
        seq = be.upload(Tensor.from_numpy(np.arange(B, dtype=np.int32)))
        kvl = be.upload(Tensor.from_numpy(np.full(B, ctx_len, np.int32)))
        out = be.empty((B, H, Dv), "bf16")
        call = op_caller(be, "mla_decode", stream, q=q, wkv_b=wkv, cache=cache, block_table=bt, token_seq=seq,
                         kv_len=kvl, out=out, scale=0.1)
        t = timed(call)
        nbytes = B * ctx_len * (Dc + Dr) * 2 + H * (Dn + Dv) * Dc * 2
        rows.append({"what": f"mla_decode B={B} ctx={ctx_len}", "us": t * 1e6, "GB/s": nbytes / t / 1e9})
        print(f"mla_decode B={B:2d} ctx={ctx_len:5d}: {t * 1e6:8.1f} us, {nbytes / t / 1e9:6.0f} GB/s "
              f"({100 * nbytes / t / bw * 2:.0f}% of copy bandwidth/2)", flush=True)
        del cache
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
