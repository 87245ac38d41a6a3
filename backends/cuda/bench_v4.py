"""Timings of the ABI 1.3 ops of libdeepinfer_cuda.so at DeepSeek V4 (Flash) shapes: hidden 4096 with
4 hyper-connection streams, 64 heads of 512 (MQA) with a window of 128, the CSA compressor (ratio 4,
overlapping) and its indexer (64 heads of 128, top 512 of the entries), HCA (ratio 128), and V3.2's
sparse mla_decode (128 heads, top 2048). Decode-sized (T = 1, 32) and prefill-sized (T = 4096) calls.

    PYTHONPATH=runtime python3 backends/cuda/bench_v4.py path/to/libdeepinfer_cuda.so [--json out.json]

Each figure is the median of timed calls after warm-up (bench.py's timer). "GB/s" counts the bytes
an op must read at least once (caches, weights, activations), so it is a floor-based rate, not a
measured traffic; compare it with the copy bandwidth that bench.py reports (about 4 TB/s on an H200).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import op_caller, timed  # noqa: E402

from deepinfer.loader import load_library  # noqa: E402
from deepinfer.tensor import Tensor  # noqa: E402

BF16 = ml_dtypes.bfloat16


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

    held = []   # every upload stays alive until the end: a marshalled call holds only raw pointers

    def up(x):
        t = be.upload(Tensor.from_numpy(np.ascontiguousarray(x)))
        held.append(t)
        return t

    def empty(shape, dtype):
        t = be.empty(shape, dtype)
        held.append(t)
        return t

    def randn(shape, dtype=BF16, scale=1.0):
        return (rng.standard_normal(shape, np.float32) * scale).astype(dtype)

    def big(shape):
        """A paged cache: 64 random blocks repeated (generating gigabytes of random numbers on the
        host would take longer than the whole benchmark; the timings do not depend on the values)."""
        return np.resize(randn((min(64, shape[0]),) + tuple(shape[1:])), shape)

    def report(what, t, nbytes=None):
        row = {"what": what, "us": t * 1e6}
        extra = ""
        if nbytes:
            row["GB/s"] = nbytes / t / 1e9
            extra = f", {row['GB/s']:6.0f} GB/s of its minimum reads"
        rows.append(row)
        print(f"{what:58s} {t * 1e6:9.1f} us{extra}", flush=True)

    # ---- hc_pre / hc_post: N = 4 streams of H = 4096, fn [24, 16384] f32
    N, H = 4, 4096
    fn = up(randn((24, N * H), np.float32, 1 / 128))
    base, scale = up(randn((24,), np.float32, 0.5)), up(np.array([1.0, 1.0, 1.0], np.float32))
    for T in (1, 32, 4096):
        x = up(randn((T, N, H)))
        out, post, comb = empty((T, H), "bf16"), empty((T, N), "f32"), empty((T, N, N), "f32")
        call = op_caller(be, "hc_pre", stream, x=x, fn=fn, base=base, scale=scale, out=out, post=post, comb=comb,
                         eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
        report(f"hc_pre N=4 H=4096 T={T}", timed(call), T * N * H * 2 + 24 * N * H * 4)
        y, o3 = up(randn((T, H))), empty((T, N, H), "bf16")
        call = op_caller(be, "hc_post", stream, x=x, y=y, post=post, comb=comb, out=o3)
        report(f"hc_post N=4 H=4096 T={T}", timed(call), T * (2 * N + 1) * H * 2)
        del x, out, post, comb, y, o3

    # ---- kv_compress: CSA (ratio 4, overlap, W = 1024 -> D = 512) and HCA (ratio 128, W = 512)
    BS = 64
    for ratio, overlap, W in ((4, 1, 1024), (128, 0, 512)):
        for T in (32, 4096):
            ctx = 8192
            MB = ctx // BS
            S = max(1, T // ctx) if T >= ctx else (32 if T == 32 else 1)
            NB = S * MB
            held.clear()   # the previous configuration's tensors (the calls that used them are done)
            staged = up(big((NB, BS, 2 * W)))
            pb = up(randn((ratio, W), np.float32, 0.5))
            bt = up(rng.permutation(NB).astype(np.int32).reshape(S, MB))
            if T == 32:   # decode: each of 32 sequences closes a window this step
                seq = np.arange(32, dtype=np.int32)
                pos = np.full(32, ctx - 1, np.int32)
            else:         # prefill of one sequence: every position, 1 in ratio closes a window
                seq = np.zeros(T, np.int32)
                pos = np.arange(T, dtype=np.int32)
            D = W // 2 if overlap else W
            out = empty((T, D), "bf16")
            call = op_caller(be, "kv_compress", stream, staged=staged, position_bias=pb, block_table=bt,
                             token_seq=up(seq), positions=up(pos), out=out, ratio=ratio, overlap=overlap)
            closing = int(np.sum((pos + 1) % ratio == 0))
            slots = (2 if overlap else 1) * ratio
            report(f"kv_compress ratio={ratio} overlap={overlap} D={D} T={T}", timed(call),
                   closing * slots * 2 * D * 2 + T * D * 2)
            del staged, out

    # ---- indexer_topk: 64 heads of 128, ratio 4, blocks of 64 (16 entries), top 512, 64K context
    NI, Di, K, ratio, BS = 64, 128, 512, 4, 64
    for T, ctx in ((1, 65536), (32, 65536), (32, 8192)):
        MB = ctx // BS
        S = T
        NB = S * MB
        held.clear()
        keys = up(big((NB, BS // ratio, Di)))
        bt = up(rng.permutation(NB).astype(np.int32).reshape(S, MB))
        q, w = up(randn((T, NI, Di))), up(randn((T, NI), np.float32))
        out = empty((T, K), "int32")
        call = op_caller(be, "indexer_topk", stream, q=q, weights=w, keys=keys, block_table=bt,
                         token_seq=up(np.arange(T, dtype=np.int32)), kv_len=up(np.full(T, ctx, np.int32)), out=out,
                         scale=Di ** -0.5, ratio=ratio, block_size=BS)
        n = ctx // ratio
        report(f"indexer_topk NI=64 Di=128 K=512 T={T} ctx={ctx} ({n} entries)", timed(call), T * n * Di * 2)
        del keys

    # ---- sparse_attention: 64 heads of 512, window 128, + CSA top 512 (ratio 4) or all HCA entries (ratio 128)
    NH, D, BS, win = 64, 512, 64, 128
    for T, ctx, ratio, idx_k in ((1, 65536, 4, 512), (32, 16384, 4, 512), (32, 16384, 128, 0), (32, 8192, 0, 0)):
        MB = ctx // BS
        S = T
        NB = S * MB
        held.clear()
        kv = up(big((NB, BS, D)))
        bt = up(rng.permutation(NB).astype(np.int32).reshape(S, MB))
        kw = dict(q=up(randn((T, NH, D))), kv_cache=kv, block_table=bt, token_seq=up(np.arange(T, dtype=np.int32)),
                  kv_len=up(np.full(T, ctx, np.int32)), sinks=up(randn((NH,), np.float32)),
                  out=empty((T, NH, D), "bf16"), scale=D ** -0.5, window=win, ratio=max(ratio, 1))
        n = win
        if ratio:
            kw["comp_cache"] = up(big((NB, max(1, BS // ratio), D)))
            if idx_k:
                kw["indices"] = up(np.stack([rng.choice(ctx // ratio, idx_k, replace=False) for _ in range(T)]).astype(np.int32))
                n += idx_k
            else:
                n += ctx // ratio
        call = op_caller(be, "sparse_attention", stream, **kw)
        what = f"sparse_attention NH=64 D=512 T={T} window 128" + \
            (f" + {'top ' + str(idx_k) if idx_k else 'all'} of ratio {ratio}" if ratio else "")
        report(what, timed(call), T * n * D * 2)
        del kv, kw

    # ---- layernorm (V3.2's indexer keys): [4096, 128]
    x = up(randn((4096, 128)))
    call = op_caller(be, "layernorm", stream, x=x, weight=up(randn((128,), np.float32)),
                     bias=up(randn((128,), np.float32)), out=empty((4096, 128), "bf16"), eps=1e-6)
    report("layernorm T=4096 H=128", timed(call), 4096 * 128 * 4)

    # ---- mla_decode with indices (V3.2: 128 heads, top 2048 of a 32K context) against the dense call
    H, Dc, Dr, Dn, Dv, BS = 128, 512, 64, 128, 128, 64
    for B, ctx in ((1, 32768), (32, 32768)):
        MB = ctx // BS
        NB = B * MB
        held.clear()
        cache = up(big((NB, BS, Dc + Dr)))
        kw = dict(q=up(randn((B, H, Dn + Dr))), wkv_b=up(randn((H * (Dn + Dv), Dc), BF16, 0.05)), cache=cache,
                  block_table=up(rng.permutation(NB).astype(np.int32).reshape(B, MB)),
                  token_seq=up(np.arange(B, dtype=np.int32)), kv_len=up(np.full(B, ctx, np.int32)),
                  out=empty((B, H, Dv), "bf16"), scale=0.1)
        report(f"mla_decode H=128 B={B} ctx={ctx} dense", timed(op_caller(be, "mla_decode", stream, **kw)),
               B * ctx * (Dc + Dr) * 2)
        kw["indices"] = up(np.stack([rng.choice(ctx, 2048, replace=False) for _ in range(B)]).astype(np.int32))
        report(f"mla_decode H=128 B={B} ctx={ctx} top 2048", timed(op_caller(be, "mla_decode", stream, **kw)),
               B * 2048 * (Dc + Dr) * 2)
        del cache, kw
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
