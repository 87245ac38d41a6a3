"""mla_decode with indices (ABI 1.3, V3.2's sparse MLA) on the CPU library against the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from cpu_op_harness import _paged, In, both, close, run
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== mla_decode with indices


def _mla_inputs(rng, dt, T, S, H, Dn, Dr, Dv, Dc, BS, MB, K):
    NB = S * MB + 1
    kv_len = rng.integers(1, MB * BS + 1, T)
    kv_len[0] = 0
    idx = rng.integers(-2, MB * BS + 2, (T, K))
    idx[:, 2] = idx[:, 1]   # listed twice: counts once
    idx[1, :] = -1          # nothing valid: a zero row
    return {"q": In(rng.standard_normal((T, H, Dn + Dr)), dt),
            "wkv_b": In(rng.standard_normal((H * (Dn + Dv), Dc)) / np.sqrt(Dc), dt),
            "cache": In(rng.standard_normal((NB, BS, Dc + Dr)), dt),
            "block_table": In(_paged(rng, S, MB, NB), "int32"), "token_seq": In(np.sort(rng.integers(0, S, T)), "int32"),
            "kv_len": In(kv_len, "int32"), "indices": In(idx, "int32")}


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("K", [5, 70])
def test_mla_decode_indices(be, ref, dt, K):
    rng = np.random.default_rng(K)
    T, S, H, Dn, Dr, Dv, Dc, BS, MB = 9, 2, 3, 10, 4, 7, 40, 8, 12
    ins = _mla_inputs(rng, dt, T, S, H, Dn, Dr, Dv, Dc, BS, MB, K)
    got, want = both(be, ref, "mla_decode", ins, {"out": ((T, H, Dv), dt)}, scale=(Dn + Dr) ** -0.5)
    close(got["out"], want["out"], dt, "mla_decode", rtol=2e-2 if dt == "bf16" else 1e-4)
    assert (got["out"][[0, 1]] == 0).all()


def test_mla_decode_indices_reads_listed_positions_only(be, ref):
    """Every cache row no token lists is NaN: the result stays finite (and the reference's)."""
    rng = np.random.default_rng(12)
    T, S, H, Dn, Dr, Dv, Dc, BS, MB, K = 5, 1, 2, 8, 4, 6, 24, 4, 8, 6
    ins = _mla_inputs(rng, "f32", T, S, H, Dn, Dr, Dv, Dc, BS, MB, K)
    table, kv_len, idx = ins["block_table"].values, ins["kv_len"].values, ins["indices"].values
    cache = np.full(ins["cache"].values.shape, np.nan)
    for t in range(T):
        for p in idx[t]:
            if 0 <= p < kv_len[t]:
                cache[table[0, p // BS], p % BS] = ins["cache"].values[table[0, p // BS], p % BS]
    ins["cache"] = In(cache)
    ins["token_seq"] = In(np.zeros(T), "int32")
    got, want = both(be, ref, "mla_decode", ins, {"out": ((T, H, Dv), "f32")}, scale=0.3)
    close(got["out"], want["out"], "f32", "mla_decode", rtol=1e-4)


def test_mla_decode_all_positions_listed_is_dense(be):
    """indices naming every position below kv_len (shuffled, with repeats) is the dense op."""
    rng = np.random.default_rng(11)
    T, S, H, Dn, Dr, Dv, Dc, BS, MB = 4, 2, 2, 8, 4, 6, 32, 8, 6
    ins = _mla_inputs(rng, "f32", T, S, H, Dn, Dr, Dv, Dc, BS, MB, 3)
    kv_len = ins["kv_len"].values
    K = 2 * MB * BS
    idx = np.full((T, K), -1)
    for t in range(T):
        p = np.concatenate([rng.permutation(kv_len[t]), rng.integers(0, max(kv_len[t], 1), 3)])[:K]
        idx[t, :len(p)] = p
    dense = run(be, "mla_decode", {k: v for k, v in ins.items() if k != "indices"}, {"out": ((T, H, Dv), "f32")},
                scale=0.3)
    sparse = run(be, "mla_decode", {**ins, "indices": In(idx, "int32")}, {"out": ((T, H, Dv), "f32")}, scale=0.3)
    close(sparse["out"], dense["out"], "f32", "sparse vs dense", rtol=1e-5)
