"""hc_pre and hc_post (ABI 1.3, V4's hyper-connections) on the CPU library against the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.errors import BackendCallError
from deepinfer.tensor import Tensor
from cpu_op_harness import In, both, close, expect_error
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== hc_pre, hc_post


def _hc_inputs(rng, T, N, H, block, xdt, view=False):
    M = (2 + N) * N if block else N
    return {"x": In(rng.standard_normal((T, N, H)), xdt, (1, 3) if view else (0, 0)),
            "fn": In(rng.standard_normal((M, N * H)) * 0.05),
            "base": In(rng.standard_normal(M) * 0.5),
            "scale": In(rng.uniform(0.5, 2.0, 3 if block else 1))}


@pytest.mark.parametrize("xdt,odt", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("T,N,H,iters", [(1, 4, 64, 20), (5, 4, 200, 1), (9, 2, 96, 3), (3, 1, 32, 2)])
def test_hc_pre_block(be, ref, xdt, odt, T, N, H, iters):
    rng = np.random.default_rng(T * 31 + N * 7 + H)
    ins = _hc_inputs(rng, T, N, H, True, xdt, view=T == 5)
    outs = {"out": ((T, H), odt), "post": ((T, N), "f32"), "comb": ((T, N, N), "f32")}
    got, want = both(be, ref, "hc_pre", ins, outs, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters)
    close(got["out"], want["out"], odt, "out", rtol=2e-2 if odt == "bf16" else 1e-4)
    close(got["post"], want["post"], "f32", "post", rtol=1e-4)
    close(got["comb"], want["comb"], "f32", "comb", rtol=1e-4)
    if iters >= 20:   # Sinkhorn converges to a doubly stochastic matrix
        np.testing.assert_allclose(got["comb"].sum(axis=-1), 1.0, atol=1e-3)
        np.testing.assert_allclose(got["comb"].sum(axis=-2), 1.0, atol=1e-3)


@pytest.mark.parametrize("T", [1, 6])
def test_hc_pre_head(be, ref, T):
    """M = N (the model's head): pre only, scale [1], no post or comb."""
    rng = np.random.default_rng(T)
    N, H = 4, 80
    ins = _hc_inputs(rng, T, N, H, False, "bf16")
    got, want = both(be, ref, "hc_pre", ins, {"out": ((T, H), "bf16")}, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=0)
    close(got["out"], want["out"], "bf16", "out")


def test_hc_pre_checks(be):
    rng = np.random.default_rng(0)
    ins = _hc_inputs(rng, 2, 4, 16, True, "f32")
    outs = {"out": ((2, 16), "f32"), "post": ((2, 4), "f32")}
    expect_error(be, "hc_pre", ins, outs, match="comb", eps=1e-6, hc_eps=1e-6, sinkhorn_iters=1)
    outs["comb"] = ((2, 4, 4), "f32")
    expect_error(be, "hc_pre", ins, outs, match="sinkhorn_iters", eps=1e-6, hc_eps=1e-6, sinkhorn_iters=0)
    ins["fn"] = In(rng.standard_normal((10, 64)))
    ins["base"] = In(rng.standard_normal(10))
    expect_error(be, "hc_pre", ins, outs, match="fn.shape[0]", eps=1e-6, hc_eps=1e-6, sinkhorn_iters=1)


@pytest.mark.parametrize("xdt,ydt,odt", [("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("bf16", "f32", "f32")])
@pytest.mark.parametrize("T,N,H", [(1, 4, 64), (7, 4, 130), (3, 2, 8)])
def test_hc_post(be, ref, xdt, ydt, odt, T, N, H):
    rng = np.random.default_rng(T * 100 + H)
    ins = {"x": In(rng.standard_normal((T, N, H)), xdt, (0, 2) if T == 7 else (0, 0)),
           "y": In(rng.standard_normal((T, H)), ydt),
           "post": In(rng.uniform(0, 2, (T, N))), "comb": In(rng.uniform(0, 1, (T, N, N)))}
    got, want = both(be, ref, "hc_post", ins, {"out": ((T, N, H), odt)})
    close(got["out"], want["out"], odt, "hc_post")
    # comb is applied transposed: input stream j feeds output stream k with comb[t, j, k]
    x, y, p, c = (ins[n].rounded() for n in ("x", "y", "post", "comb"))
    mine = p[:, :, None] * y[:, None, :] + np.einsum("tjk,tjh->tkh", c, x)
    close(got["out"], mine, odt, "hc_post vs the README formula")


def test_hc_post_rejects_out_overlapping_x(be):
    T, N, H = 2, 2, 8
    x = Tensor.from_numpy(np.ones((T, N, H), np.float32))
    kw = {"y": Tensor.from_numpy(np.ones((T, H), np.float32)), "post": Tensor.from_numpy(np.ones((T, N), np.float32)),
          "comb": Tensor.from_numpy(np.ones((T, N, N), np.float32))}
    with pytest.raises(BackendCallError) as e:
        be.call("hc_post", x=x, out=x, **kw)
    assert e.value.status_name == "INVALID_ARGUMENT" and "overlaps" in e.value.message
