"""On the CPU library a row's result does not depend on how many rows share the call (up to 8, the
decode kernels' limit): linear and moe_experts give each x row, bit for bit, what the same row gets
alone. Speculative decoding verifies a few draft tokens of one sequence in one step; with this, the
step's logits are those of one-token steps and greedy speculative decoding reproduces plain greedy
decoding exactly."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import deepinfer
from deepinfer.tensor import Quant, Tensor

MAX_ROWS = 8   # linear.c FUSED_MAX_M: more rows take the dequantized-tile GEMM


@pytest.fixture(scope="module")
def be(cpu_backend):
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    yield b
    b.close()


def _weight(be, rng, fmt, n, k):
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    if fmt in ("f32", "bf16"):
        return be.upload(Tensor.from_numpy(w.astype(ml_dtypes.bfloat16 if fmt == "bf16" else np.float32)))
    if fmt == "uint4":   # asymmetric group-32 (zero points), made by hand: quantize makes symmetric codes
        nb = (n, (k + 31) // 32)
        sc = be.upload(Tensor.from_numpy((rng.random(nb) * 0.02 + 0.01).astype(np.float32)))
        zeros = be.upload(Tensor.from_numpy(rng.integers(0, 16, nb).astype(np.float32)))
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        return be.upload(Tensor.from_numpy(codes, "uint4", Quant(sc, (1, 32), zeros)))
    dt, block = {"int8": ("int8", (1, 0)), "int4": ("int4", (1, 32)), "e2m1": ("e2m1", (1, 32)),
                 "e4m3": ("e4m3", (128, 128))}[fmt]
    br, bc = block
    nb = ((n + br - 1) // br if br else 1, (k + bc - 1) // bc if bc else 1)
    sc = be.empty(nb, "f32")
    q = be.empty((n, (k + 1) // 2), "uint8") if dt in ("int4", "e2m1") else be.empty((n, k), dt)
    t = Tensor(q.buffer, (n, k), dt, None, 0, Quant(sc, block))
    be.call("quantize", x=be.upload(Tensor.from_numpy(w)), out=t, scale_pow2=0)
    return t


@pytest.mark.parametrize("fmt", ["bf16", "f32", "int8", "int4", "uint4", "e2m1", "e4m3"])
@pytest.mark.parametrize("n,k", [(64, 256), (37, 200), (40, 240), (9, 100), (3, 64)])
def test_linear_row_independent_of_rows(be, fmt, n, k):
    rng = np.random.default_rng(n * 1000 + k)
    w = _weight(be, rng, fmt, n, k)
    x = rng.standard_normal((MAX_ROWS, k)).astype(np.float32)
    alone = []
    for i in range(MAX_ROWS):
        out = be.empty((1, n), "f32")
        be.call("linear", x=be.upload(Tensor.from_numpy(x[i:i + 1])), w=w, out=out)
        alone.append(be.to_numpy(out)[0].copy())
    alone = np.stack(alone)
    for m in range(2, MAX_ROWS + 1):
        out = be.empty((m, n), "f32")
        be.call("linear", x=be.upload(Tensor.from_numpy(x[:m])), w=w, out=out)
        got = be.to_numpy(out)
        assert np.array_equal(got.view(np.uint32), alone[:m].view(np.uint32)), \
            f"{fmt} [{n}, {k}], {m} rows: max |diff| {np.abs(got - alone[:m]).max():.3g}"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(64, 256), (37, 192)])
def test_int8_activations_row_independent_of_rows(be, fmt, n, k):
    """W8A8 / W4A8: per-token int8 x on the integer dot-product rows."""
    rng = np.random.default_rng(n + k)
    w = _weight(be, rng, fmt, n, k)
    x = rng.standard_normal((MAX_ROWS, k)).astype(np.float32)

    def run(rows):
        xq = Tensor(be.empty((len(rows), k), "int8").buffer, (len(rows), k), "int8", None, 0,
                    Quant(be.empty((len(rows), 1), "f32"), (1, 0)))
        be.call("quantize", x=be.upload(Tensor.from_numpy(x[rows])), out=xq, scale_pow2=0)
        out = be.empty((len(rows), n), "f32")
        be.call("linear", x=xq, w=w, out=out)
        return be.to_numpy(out).copy()

    alone = np.concatenate([run([i]) for i in range(MAX_ROWS)])
    for m in range(2, MAX_ROWS + 1):
        got = run(list(range(m)))
        assert np.array_equal(got.view(np.uint32), alone[:m].view(np.uint32)), \
            f"x int8, w {fmt} [{n}, {k}], {m} rows: max |diff| {np.abs(got - alone[:m]).max():.3g}"


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_moe_token_independent_of_tokens(be, fmt):
    """The tokens of a step that share an expert run it together; each token's output is the one it
    gets alone."""
    rng = np.random.default_rng(7)
    E, K, H, I, T = 8, 2, 128, 64, 5
    gate = [_weight(be, rng, fmt, I, H) for _ in range(E)]
    up = [_weight(be, rng, fmt, I, H) for _ in range(E)]
    down = [_weight(be, rng, fmt, H, I) for _ in range(E)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.array([[0, 1], [1, 2], [0, 2], [3, 1], [0, 1]], np.int32)
    tw = rng.random((T, K)).astype(np.float32)

    def run(rows):
        out = be.empty((len(rows), H), "f32")
        be.moe_experts(x=be.upload(Tensor.from_numpy(x[rows])), topk_ids=be.upload(Tensor.from_numpy(ids[rows])),
                       topk_weights=be.upload(Tensor.from_numpy(tw[rows])), w_gate=gate, w_up=up, w_down=down,
                       out=out, num_experts=E, accumulate=0)
        return be.to_numpy(out).copy()

    together = run(list(range(T)))
    for t in range(T):
        alone = run([t])[0]
        assert np.array_equal(together[t].view(np.uint32), alone.view(np.uint32)), \
            f"token {t}: max |diff| {np.abs(together[t] - alone).max():.3g}"


@pytest.mark.parametrize("wdt,cdt", [("bf16", "f32"), ("f32", "f32"), ("bf16", "bf16")])
def test_mla_decode_token_independent_of_tokens(be, wdt, cdt):
    """The draft tokens of a sequence go through mla_decode together (its absorbed projections read
    once for all); each token's output is the one it gets alone. Dn = 10, Dv = 7, Dc = 50: rows in
    fours and tails."""
    rng = np.random.default_rng(3)
    H, Dn, Dr, Dv, Dc, BS, P, T = 3, 10, 4, 7, 50, 16, 37, 5
    wkv = (rng.standard_normal((H * (Dn + Dv), Dc)) * 0.2).astype(np.float32)
    cache = rng.standard_normal((6, BS, Dc + Dr)).astype(np.float32)
    np_dt = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
    wkv_t = be.upload(Tensor.from_numpy(wkv.astype(np_dt[wdt])))
    cache_t = be.upload(Tensor.from_numpy(cache.astype(np_dt[cdt])))
    table = be.upload(Tensor.from_numpy(np.array([[4, 0, 5, 2, 1, 3]], np.int32)))
    q = rng.standard_normal((T, H, Dn + Dr)).astype(np.float32)

    def run(rows):
        out = be.empty((len(rows), H, Dv), "f32")
        be.mla_decode(q=be.upload(Tensor.from_numpy(q[rows])), wkv_b=wkv_t, cache=cache_t, block_table=table,
                      token_seq=be.upload(Tensor.from_numpy(np.zeros(len(rows), np.int32))),
                      kv_len=be.upload(Tensor.from_numpy(np.array([P + 1 + r for r in rows], np.int32))),
                      out=out, scale=0.3)
        return be.to_numpy(out).copy()

    together = run(list(range(T)))
    for t in range(T):
        alone = run([t])[0]
        assert np.array_equal(together[t].view(np.uint32), alone.view(np.uint32)), \
            f"token {t}: max |diff| {np.abs(together[t] - alone).max():.3g}"
