"""moe_router's V4 scoring and hash routing and moe_experts' clipped SwiGLU (ABI 1.3) on the CPU
library against the reference, on both moe_experts paths.
"""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.tensor import Tensor
from cpu_op_harness import NP, In, both, close, expect_error
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== moe_router


@pytest.mark.parametrize("n_group,topk_group,bias", [(0, 0, True), (1, 1, False), (4, 2, True)])
def test_moe_router_sqrtsoftplus(be, ref, n_group, topk_group, bias):
    rng = np.random.default_rng(n_group)
    T, E, K = 11, 32, 6
    logits = rng.standard_normal((T, E)) * 4
    logits[0, :4] = [25.0, -30.0, 19.5, 20.5]   # both sides of softplus's threshold
    ins = {"logits": In(logits), "bias": In(rng.standard_normal(E) * 0.1) if bias else None}
    outs = {"topk_ids": ((T, K), "int32"), "topk_weights": ((T, K), "f32")}
    sc = dict(scoring=2, n_group=n_group, topk_group=topk_group, group_score=0, norm_topk_prob=1,
              routed_scaling_factor=1.5)
    got, want = both(be, ref, "moe_router", ins, outs, **sc)
    np.testing.assert_array_equal(got["topk_ids"], want["topk_ids"])
    close(got["topk_weights"], want["topk_weights"], "f32", "topk_weights", rtol=1e-6)


@pytest.mark.parametrize("scoring", [0, 1, 2])
def test_moe_router_hash(be, ref, scoring):
    """ids = hash_table[token_ids[t]] in table order (bias and groups unused); weights = their scores."""
    rng = np.random.default_rng(scoring)
    T, E, K, V = 9, 16, 4, 50
    table = np.stack([rng.permutation(E)[:K] for _ in range(V)]).astype(np.int32)
    tids = rng.integers(0, V, T).astype(np.int32)
    ins = {"logits": In(rng.standard_normal((T, E)) * 3), "bias": In(rng.standard_normal(E)),
           "token_ids": In(tids, "int32"), "hash_table": In(table, "int32")}
    outs = {"topk_ids": ((T, K), "int32"), "topk_weights": ((T, K), "f32")}
    for norm in (0, 1):
        sc = dict(scoring=scoring, n_group=1, topk_group=1, group_score=0, norm_topk_prob=norm,
                  routed_scaling_factor=2.0)
        got, want = both(be, ref, "moe_router", ins, outs, **sc)
        np.testing.assert_array_equal(got["topk_ids"], table[tids])
        np.testing.assert_array_equal(got["topk_ids"], want["topk_ids"])
        close(got["topk_weights"], want["topk_weights"], "f32", "topk_weights", rtol=1e-6)


def test_moe_router_hash_checks(be):
    rng = np.random.default_rng(0)
    T, E, K = 2, 8, 2
    base = {"logits": In(rng.standard_normal((T, E)))}
    outs = {"topk_ids": ((T, K), "int32"), "topk_weights": ((T, K), "f32")}
    sc = dict(scoring=1, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1, routed_scaling_factor=1.0)
    expect_error(be, "moe_router", {**base, "token_ids": In([0, 1], "int32")}, outs, match="hash_table", **sc)
    table = In([[0, 1], [2, 3], [4, 8]], "int32")
    expect_error(be, "moe_router", {**base, "token_ids": In([0, 3], "int32"), "hash_table": table}, outs,
                 match="token_ids[1]", **sc)
    expect_error(be, "moe_router", {**base, "token_ids": In([0, 2], "int32"), "hash_table": table}, outs,
                 match="hash_table[2, 1]", **sc)


# ====================================================================== clipped SwiGLU
def _experts(rng, E, I, H, dt):
    w = lambda n, k: Tensor.from_numpy((rng.standard_normal((n, k)) * 0.3).astype(NP[dt]))
    return [w(I, H) for _ in range(E)], [w(I, H) for _ in range(E)], [w(H, I) for _ in range(E)]


def _moe(backend, x, ids, tw, experts, limit, dt="f32"):
    T, H = x.shape
    out = backend.empty((T, H), dt, fill=np.nan)
    g, u, d = experts
    backend.moe_experts(x=Tensor.from_numpy(x.astype(NP[dt])), topk_ids=Tensor.from_numpy(ids),
                        topk_weights=Tensor.from_numpy(tw), w_gate=g, w_up=u, w_down=d, out=out,
                        num_experts=len(g), accumulate=0, swiglu_limit=limit)
    return backend.to_numpy(out).astype(np.float64)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("T", [3, 40])
def test_moe_experts_swiglu_limit(be, ref, dt, T):
    """Both paths: a few tokens (one task per expert) and many (every expert's rows batched)."""
    rng = np.random.default_rng(T)
    E, K, H, I = 6, 2, 64, 48
    experts = _experts(rng, E, I, H, dt)
    x = rng.standard_normal((T, H)) * 3
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    tw = rng.random((T, K)).astype(np.float32)
    got = _moe(be, x, ids, tw, experts, 1.5, dt)
    want = _moe(ref, x, ids, tw, experts, 1.5, dt)
    close(got, want, dt, "moe_experts swiglu_limit", rtol=2e-2 if dt == "bf16" else 1e-4)
    unclipped = _moe(ref, x, ids, tw, experts, 0.0, dt)
    assert np.abs(unclipped - want).max() > 0.1 * np.abs(want).max()   # the clip mattered


def test_moe_experts_swiglu_limit_token_independent(be):
    """A token's output is the one it gets alone, with the clip too (rows of one expert share a call)."""
    rng = np.random.default_rng(17)
    E, K, H, I, T = 8, 2, 128, 64, 5
    experts = _experts(rng, E, I, H, "bf16")
    x = rng.standard_normal((T, H)) * 3
    ids = np.array([[0, 1], [1, 2], [0, 2], [3, 1], [0, 1]], np.int32)
    tw = rng.random((T, K)).astype(np.float32)
    together = _moe(be, x, ids, tw, experts, 2.0)
    for t in range(T):
        alone = _moe(be, x[t:t + 1], ids[t:t + 1], tw[t:t + 1], experts, 2.0)[0]
        assert np.array_equal(together[t], alone), f"token {t}"
