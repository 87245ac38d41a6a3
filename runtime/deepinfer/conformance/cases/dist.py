"""Cases of the collectives and expert parallelism (1.4): all_reduce, all_gather, all_to_all,
moe_dispatch and moe_combine.

The suite runs in one process, so the collectives run on a one-rank communicator of the backend under
test (the reference its own): a sum over one rank, a gather of one, an exchange with oneself. That
checks arguments, dtypes, shapes, counts and strides; sums over several ranks and agreement between
ranks are level L4's business (multi_rank.py under mpirun, `deepinfer conformance LIB --ranks N`).
moe_dispatch and moe_combine are local ops and are checked in full: the number of ranks is only a
dimension of their tensors.
"""
from __future__ import annotations

import numpy as np

from .common import FLOATS, Case, OpCases, TSpec, _random_codes, _shape_str, ints, out, plain, randn


# ====================================================================== builders


# DI_DTS_COMM: what all_gather and all_to_all move (fp8 activations, ids and counts too)
COMM_DTYPES = ("f32", "bf16", "f16", "int32", "int8", "uint8", "e4m3")


def comm_values(rng, shape, dtype: str) -> np.ndarray:
    """Random elements over much of a dtype's range (the collectives move bytes; no NaN)."""
    shape = tuple(shape)
    if dtype == "int32":
        return rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    if dtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if dtype == "uint8":
        return rng.integers(0, 256, shape).astype(np.uint8)
    if dtype == "e4m3":
        return _random_codes(rng, shape, "e4m3")
    return randn(rng, shape, dtype, 4.0)


def all_reduce(seed, shape, dtype, alias=False) -> Case:
    rng = np.random.default_rng(seed)
    t = {"x": plain(rng, shape, dtype, scale=3.0), "out": out(shape, dtype, alias="x" if alias else None)}
    return Case("all_reduce", f"all_reduce {dtype} shape={list(shape)}{' in-place' if alias else ''}", dtype, t,
                tol_key=dtype, comm=True, seed=seed)


def all_gather(seed, shape, dtype) -> Case:
    rng = np.random.default_rng(seed)
    t = {"x": TSpec(dtype, tuple(shape), comm_values(rng, shape, dtype)), "out": out((1,) + tuple(shape), dtype)}
    return Case("all_gather", f"all_gather {dtype} shape={list(shape)}", dtype, t, tol_key="exact",
                compare="exact", comm=True, seed=seed)


def all_to_all(seed, C, inner, dtype, counts=None) -> Case:
    """send [1, C, *inner]: slot 0 goes to this rank itself. counts: None (whole slots), n (the first n
    rows travel) or "random" (n drawn in [0, C])."""
    rng = np.random.default_rng(seed)
    shape = (1, C) + tuple(inner)
    t = {"send": TSpec(dtype, shape, comm_values(rng, shape, dtype)), "recv": out(shape, dtype)}
    check, counted, label = ["recv"], {}, "whole slots"
    if counts is not None:
        n = int(rng.integers(0, C + 1)) if counts == "random" else int(counts)
        t["send_counts"] = ints([n])
        t["recv_counts"] = out((1,), "int32")
        check, counted, label = ["recv_counts", "recv"], {"recv": "recv_counts"}, f"send_counts=[{n}]"
    return Case("all_to_all", f"all_to_all {dtype} send={list(shape)} {label}",
                dtype + (" counts" if counts is not None else ""), t, check=check, tol_key="exact",
                compare="exact", comm=True, counted=counted, seed=seed)


def _expert_ids(rng, T: int, K: int, E: int) -> np.ndarray:
    """[T, K] global expert ids, distinct in a row where E allows (a router's top-k), about one in six
    replaced by an id every consumer skips (-1, E, past E, below -1); with three rows or more the last
    holds only such ids (a token with no expert anywhere)."""
    ids = np.stack([rng.choice(E, K, replace=E < K) for _ in range(T)]) if T else np.zeros((0, K), np.int64)
    junk = np.array([-1, -1, E, E + 7, -3, 2**31 - 1])
    bad = rng.random((T, K)) < 1 / 6
    ids[bad] = rng.choice(junk, int(bad.sum()))
    if T > 2:
        ids[-1] = rng.choice(junk, K)
    return ids.astype(np.int32)


def moe_dispatch(seed, T, K, N, Er, H, dtype, extra=0, spread="random") -> Case:
    """T tokens, each with top-K experts of N ranks x Er experts, packed into slots of C = T + extra rows.
    spread "one-rank": every expert on rank 0 (slot 0 holds every token with one, C = T fills it)."""
    rng = np.random.default_rng(seed)
    C = T + extra
    if spread == "one-rank":
        ids = _expert_ids(rng, T, K, Er)
        ids[ids >= Er] = -1             # junk ids past E = Er would belong to rank 1
    else:
        ids = _expert_ids(rng, T, K, N * Er)
    t = {"x": plain(rng, (T, H), dtype),
         "topk_ids": ints(ids),
         "topk_weights": TSpec("f32", (T, K), rng.uniform(0.05, 1.0, (T, K)).astype(np.float32)),
         "send_x": out((N, C, H), dtype),
         "send_ids": out((N, C, K), "int32"),
         "send_weights": out((N, C, K), "f32"),
         "send_counts": out((N,), "int32"),
         "route": out((T, N), "int32")}
    name = f"moe_dispatch {dtype} {_shape_str(T=T, K=K, N=N, experts_per_rank=Er, H=H, C=C)}" + \
        (" one-rank" if spread == "one-rank" else "")
    return Case("moe_dispatch", name, dtype, t, {"experts_per_rank": Er},
                check=["send_counts", "route", "send_ids", "send_weights", "send_x"], tol_key="exact",
                compare="exact", counted={"send_x": "send_counts"}, seed=seed)


def moe_combine(seed, T, N, C, H, dtype, out_dtype=None, accumulate=0, route="dispatch") -> Case:
    """route "dispatch": what moe_dispatch writes (the tokens of slot p on its rows 0, 1, ... in token
    order; C >= T); "scattered": any distinct rows of each slot, in any order. The rows of back that no
    token routes to hold NaN (an all_to_all leaves them unspecified): a library must not read them."""
    rng = np.random.default_rng(seed)
    out_dtype = out_dtype or dtype
    r = np.full((T, N), -1, np.int64)
    for p in range(N):
        if route == "dispatch":
            tok = np.nonzero(rng.random(T) < 0.6)[0]
            r[tok, p] = np.arange(len(tok))
        else:
            k = int(rng.integers(0, min(T, C) + 1))
            r[rng.choice(T, k, replace=False), p] = rng.choice(C, k, replace=False)
    back = randn(rng, (N, C, H), dtype)
    used = np.zeros((N, C), bool)
    for p in range(N):
        used[p, r[r[:, p] >= 0, p]] = True
    back[~used] = np.nan
    t = {"back": TSpec(dtype, (N, C, H), back), "route": ints(r)}
    if accumulate:
        t["out"] = plain(rng, (T, H), out_dtype)
        t["out"].out = True
    else:
        t["out"] = out((T, H), out_dtype)
    name = f"moe_combine back={dtype} out={out_dtype} {_shape_str(T=T, N=N, C=C, H=H)} route={route}" + \
        (" accumulate" if accumulate else "")
    return Case("moe_combine", name, f"back={dtype} out={out_dtype}", t, {"accumulate": accumulate},
                tol_key=out_dtype, seed=seed)


# ====================================================================== generators


def gen_all_reduce(p, s):
    for dt in FLOATS:
        yield all_reduce(s(), (0, 8), dt)
        yield all_reduce(s(), (7,), dt)
        yield all_reduce(s(), (5, 33), dt)
        yield all_reduce(s(), (4, 9), dt, alias=True)          # out may alias x
        yield all_reduce(s(), (2, 1, 3, 1, 2, 5), dt)          # six dims
        for _ in range(p.random_draws):
            r = s.rng
            yield all_reduce(s(), tuple(int(d) for d in r.integers(1, 40, int(r.integers(1, 4)))), dt,
                             alias=bool(r.integers(0, 2)))


def gen_all_gather(p, s):
    for dt in COMM_DTYPES:
        yield all_gather(s(), (3, 17), dt)
    for dt in FLOATS:
        yield all_gather(s(), (0, 8), dt)
        yield all_gather(s(), (9,), dt)
        yield all_gather(s(), (2, 1, 3, 2, 2), dt)             # five dims (out has six)
        for _ in range(p.random_draws):
            r = s.rng
            yield all_gather(s(), tuple(int(d) for d in r.integers(1, 40, int(r.integers(1, 4)))), dt)


def gen_all_to_all(p, s):
    for dt in COMM_DTYPES:
        yield all_to_all(s(), 5, (16,), dt)
        yield all_to_all(s(), 6, (7,), dt, counts="random")
    for dt in FLOATS:
        yield all_to_all(s(), 4, (8,), dt, counts=0)
        yield all_to_all(s(), 4, (8,), dt, counts=4)
        yield all_to_all(s(), 0, (8,), dt, counts=0)           # empty slots
        yield all_to_all(s(), 9, (), dt, counts="random")      # send [1, C]: a row is one element
        yield all_to_all(s(), 5, (2, 3, 4), dt, counts="random")   # six dims
        for _ in range(p.random_draws):
            r = s.rng
            yield all_to_all(s(), int(r.integers(0, 30)), (int(r.integers(1, 70)),), dt,
                             counts="random" if r.integers(0, 2) else None)


def gen_moe_dispatch(p, s):
    for dt in FLOATS:
        yield moe_dispatch(s(), 0, 2, 2, 2, 8, dt)                 # no tokens
        yield moe_dispatch(s(), 0, 2, 2, 2, 8, dt, extra=3)
        yield moe_dispatch(s(), 1, 1, 1, 1, 5, dt)
        yield moe_dispatch(s(), 7, 2, 4, 2, 16, dt)
        yield moe_dispatch(s(), 9, 4, 3, 3, 24, dt, extra=3)
        yield moe_dispatch(s(), 6, 3, 1, 8, 8, dt)                 # one rank: every expert is local
        yield moe_dispatch(s(), 8, 4, 4, 1, 8, dt)                 # an expert per rank
        yield moe_dispatch(s(), 5, 4, 2, 4, 16, dt, spread="one-rank")   # slot 0 full (C = T)
        for _ in range(2 + p.random_draws):
            r = s.rng
            yield moe_dispatch(s(), int(r.integers(0, 20)), int(r.integers(1, 5)), int(r.integers(1, 5)),
                               int(r.integers(1, 5)), int(r.integers(1, 40)), dt, extra=int(r.integers(0, 4)))


def gen_moe_combine(p, s):
    for dt in FLOATS:
        other = "f32" if dt == "bf16" else "bf16"
        yield moe_combine(s(), 0, 2, 0, 8, dt)
        yield moe_combine(s(), 0, 2, 3, 8, dt, accumulate=1)
        yield moe_combine(s(), 1, 1, 1, 5, dt)
        yield moe_combine(s(), 7, 4, 7, 16, dt)
        yield moe_combine(s(), 9, 3, 12, 24, dt, route="scattered")
        yield moe_combine(s(), 6, 2, 8, 33, dt, accumulate=1)
        yield moe_combine(s(), 5, 3, 5, 16, dt, out_dtype=other)
        yield moe_combine(s(), 5, 3, 6, 16, dt, out_dtype=other, accumulate=1, route="scattered")
        for _ in range(2 + p.random_draws):
            r = s.rng
            T = int(r.integers(0, 20))
            yield moe_combine(s(), T, int(r.integers(1, 5)), T + int(r.integers(0, 4)), int(r.integers(1, 40)), dt,
                              accumulate=int(r.integers(0, 2)), route=["dispatch", "scattered"][int(r.integers(0, 2))])


# ====================================================================== large cases


def large_all_reduce(s):
    yield all_reduce(s(), (64, 4099), "bf16")
    yield all_reduce(s(), (64, 4099), "f32", alias=True)


def large_all_gather(s):
    yield all_gather(s(), (64, 1031), "bf16")


def large_all_to_all(s):
    yield all_to_all(s(), 300, (1031,), "bf16", counts="random")
    yield all_to_all(s(), 300, (128,), "e4m3", counts=300)


def large_moe_dispatch(s):
    yield moe_dispatch(s(), 256, 8, 4, 64, 1031, "bf16", extra=16)   # V3-sized top-8 over 4 ranks


def large_moe_combine(s):
    yield moe_combine(s(), 256, 4, 272, 1031, "bf16", accumulate=1)


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    # the collectives on a one-rank communicator; all_to_all with its counts
    "all_reduce": OpCases(gen_all_reduce, lambda: all_reduce(1, (2, 8), "f32"), large_all_reduce),
    "all_gather": OpCases(gen_all_gather, lambda: all_gather(1, (2, 8), "f32"), large_all_gather),
    "all_to_all": OpCases(gen_all_to_all, lambda: all_to_all(1, 3, (8,), "f32", counts=2), large_all_to_all),
    "moe_dispatch": OpCases(gen_moe_dispatch, lambda: moe_dispatch(1, 3, 2, 2, 2, 8, "f32"), large_moe_dispatch),
    "moe_combine": OpCases(gen_moe_combine, lambda: moe_combine(1, 3, 2, 3, 8, "f32"), large_moe_combine),
}
