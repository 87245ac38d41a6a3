"""Cases of linear: float, weight-quantized and activation-quantized GEMMs and GEMVs over every weight format."""
from __future__ import annotations

import math

import numpy as np

from .common import ACT_FORMATS, FLOATS, WEIGHT_FORMATS, Case, OpCases, _pick, _shape_str, _tol, out, plain


# ====================================================================== builders


def linear(seed, M, K, N, xfmt="f32", wfmt="f32", bias=False, out_dtype=None, view=False) -> Case:
    """xfmt: f32 | bf16 | an ACT_FORMATS label; wfmt: f32 | bf16 | a WEIGHT_FORMATS label."""
    rng = np.random.default_rng(seed)
    quantized = False
    if xfmt in ACT_FORMATS:
        x = ACT_FORMATS[xfmt].random(rng, (M, K))
        quantized = True
        out_dtype = out_dtype or "bf16"
    else:
        x = plain(rng, (M, K), xfmt, pad=(2, 5) if view else (0, 0))
        out_dtype = out_dtype or xfmt
    if wfmt in WEIGHT_FORMATS:
        w = WEIGHT_FORMATS[wfmt].random(rng, (N, K))
        quantized = True
    else:
        w = plain(rng, (N, K), wfmt, scale=1 / math.sqrt(max(K, 1)))
    t = {"x": x, "w": w}
    if bias:
        t["bias"] = plain(rng, (N,), out_dtype)
    t["out"] = out((M, N), out_dtype)
    name = f"linear x={xfmt} w={wfmt} out={out_dtype} {_shape_str(M=M, K=K, N=N)}{' bias' if bias else ''}" \
           f"{' view' if view else ''}"
    return Case("linear", name, f"x={xfmt} w={wfmt}", t, tol_key=_tol(out_dtype, quantized), seed=seed)


# ====================================================================== generators


def gen_linear(p, s):
    for dt in FLOATS:
        yield linear(s(), 0, 16, 8, dt, dt)
        yield linear(s(), 1, 1, 1, dt, dt)
        yield linear(s(), 3, 37, 19, dt, dt, bias=True, view=True)
        for _ in range(p.random_draws):
            r = s.rng
            yield linear(s(), int(r.integers(1, 9)), int(r.integers(1, 150)), int(r.integers(1, 40)), dt, dt,
                         bias=bool(r.integers(0, 2)), view=bool(r.integers(0, 2)))
    # every weight format with float activations; K never a multiple of the group, N a partial fp8 block
    for wf in _pick(p, WEIGHT_FORMATS):
        f = WEIGHT_FORMATS[wf]
        g = f.block[1] or 64
        K = g * 2 + g // 2 + 3 if f.block[0] != 128 else 200
        N = 130 if f.block[0] == 128 else 7
        for dt in FLOATS:
            yield linear(s(), 3, K, N, dt, wf, bias=dt == "f32")
        yield linear(s(), 1, K, N + 2, "f32", wf)   # decode: rows in fours (GEMV kernels) and a tail
        yield linear(s(), 0, K, N, "bf16", wf)
        for _ in range(p.random_draws):
            r = s.rng
            yield linear(s(), int(r.integers(1, 6)), int(r.integers(1, 3 * g)), int(r.integers(1, 20)), "bf16", wf)
    # the shapes GPU libraries run on tensor cores (bf16 activations, K a multiple of 128, N of 16):
    # decode widths 1 / 8 / 16, a batch above 16, split K (few rows, long K), and sizes past the
    # point where a library switches to a GEMM (M = 300 with a quantized weight: dequantize + GEMM)
    for wf in ("bf16", "e4m3/128x128/f32", "int8/channel/f32", "int4/g128/sym/f16", "int4/g64/sym/bf16",
               "int4/g32/sym/f32", "uint4/g32/asym/f32"):
        for M in (1, 8, 13, 40):
            yield linear(s(), M, 256, 48, "bf16", wf, bias=M == 13, out_dtype="f32" if M == 8 else None)
        yield linear(s(), 2, 4096, 32, "bf16", wf)
    # decode GEMV with f32 activations and output (the tight tolerance): rows in fours, K tails
    for wf in ("bf16", "f32"):
        yield linear(s(), 1, 300, 37, "f32", wf)
        yield linear(s(), 1, 2048, 8, "f32", wf)
    yield linear(s(), 5, 192, 32, "bf16", "int4/g128/sym/f16")  # K = 1.5 groups: 64-column k-steps
    yield linear(s(), 300, 256, 272, "bf16", "e4m3/128x128/f32")
    yield linear(s(), 260, 384, 144, "bf16", "int4/g128/sym/f16", bias=True)
    yield linear(s(), 64, 200, 264, "bf16", "bf16", bias=True, out_dtype="f32")
    yield linear(s(), 300, 136, 40, "bf16", "bf16")
    yield linear(s(), 128, 2048, 64, "f32", "f32", bias=True)  # the MoE router's shape: few tiles, long K
    # activation-quantized paths (integer GEMM, fp8 GEMM)
    yield linear(s(), 4, 100, 9, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 40, 256, 48, "int8/token/f32", "int8/channel/f32", bias=True)  # integer tensor cores
    yield linear(s(), 1, 256, 48, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 300, 272, 136, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 4, 100, 9, "int8/token/f32", "int4/g32/sym/f32")
    # K and blocks on 64-column chunks: the integer-dot (VNNI / dp4a) kernels, 1 to 17 rows of x,
    # an odd number of chunks, groups of 64 and 128, per-channel rows
    yield linear(s(), 1, 256, 40, "int8/token/f32", "int4/g64/sym/bf16")
    yield linear(s(), 9, 384, 70, "int8/token/f32", "int4/g128/sym/f16")
    yield linear(s(), 17, 320, 33, "int8/token/f32", "int4/g64/sym/bf16", bias=True)
    yield linear(s(), 2, 320, 24, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 8, 1024, 20, "int8/token/f32", "int8/channel/f32")
    # 32 rows and more: integer matrix units (AMX tiles), partial row blocks and column strips
    yield linear(s(), 33, 384, 45, "int8/token/f32", "int4/g64/sym/bf16")
    yield linear(s(), 70, 256, 40, "int8/token/f32", "int4/g128/sym/f16", bias=True)
    yield linear(s(), 64, 192, 33, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 3, 200, 130, "e4m3/1x128/f32", "e4m3/128x128/f32")
    yield linear(s(), 0, 200, 130, "e4m3/1x128/f32", "e4m3/128x128/f32")
    for M in (1, 40, 300):  # whole 128 x 128 blocks: the fp8 tensor-core GEMM of a GPU library
        yield linear(s(), M, 384, 256, "e4m3/1x128/f32", "e4m3/128x128/f32", bias=M == 40)


# ====================================================================== large cases


def large_linear(s):
    yield linear(s(), 33, 1000, 300, "f32", "f32", bias=True)
    yield linear(s(), 17, 1000, 257, "bf16", "int4/g128/sym/f16")
    yield linear(s(), 9, 1000, 300, "bf16", "e4m3/128x128/f32")
    yield linear(s(), 20, 1000, 130, "int8/token/f32", "int8/channel/f32")
    yield linear(s(), 20, 1000, 512, "int8/token/f32", "int4/g128/sym/f16")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "linear": OpCases(gen_linear, lambda: linear(1, 2, 16, 4, "f32", "f32"), large_linear),
}
