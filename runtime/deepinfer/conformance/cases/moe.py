"""Cases of the MoE ops: moe_router (every DeepSeek routing, V4's hash routing) and moe_experts (weight
formats, absent experts, V4's clipped SwiGLU, 1.5's expert-cache map), and the moe_experts call that
must fail (error_cases)."""
from __future__ import annotations

import math

import numpy as np

from .common import FLOATS, WEIGHT_FORMATS, Case, OpCases, TSpec, _pick, _shape_str, _tol, ints, out, plain


# ====================================================================== builders


ROUTER_CONFIGS = {
    # DeepSeek-V2-Lite: softmax, no groups, no normalisation
    "v2lite": dict(E=16, K=4, scoring=0, n_group=1, topk_group=1, group_score=0, norm_topk_prob=0,
                   routed_scaling_factor=1.0, bias=False),
    # DeepSeek-V2: softmax, group-limited by the group max
    "v2": dict(E=16, K=3, scoring=0, n_group=4, topk_group=2, group_score=0, norm_topk_prob=0,
               routed_scaling_factor=16.0, bias=False),
    # DeepSeek-V3: sigmoid, correction bias, top-2-sum group score, normalised, scaled
    "v3": dict(E=32, K=4, scoring=1, n_group=4, topk_group=2, group_score=1, norm_topk_prob=1,
               routed_scaling_factor=2.5, bias=True),
    # DeepSeek-V4 (1.3): sqrt(softplus) scores, correction bias, no groups, normalised, scaled
    "v4": dict(E=32, K=6, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
               routed_scaling_factor=1.5, bias=True),
    # the same with logits past softplus's threshold of 20 (softplus(v) = v there)
    "v4-large-logits": dict(E=16, K=4, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                            routed_scaling_factor=1.5, bias=True, logit_scale=15.0),
    # V4's first layers (1.3): hash routing, the experts of each token id from a table (the bias is given,
    # as the model has one, and must not be used)
    "v4-hash": dict(E=32, K=6, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                    routed_scaling_factor=1.5, bias=True, vocab=50),
    # hash routing with softmax scores and no normalisation
    "hash-softmax": dict(E=16, K=3, scoring=0, n_group=1, topk_group=1, group_score=0, norm_topk_prob=0,
                         routed_scaling_factor=1.0, bias=False, vocab=7),
}


def moe_router(seed, T, config="v3") -> Case:
    rng = np.random.default_rng(seed)
    c = dict(ROUTER_CONFIGS[config])
    E, K, has_bias = c.pop("E"), c.pop("K"), c.pop("bias")
    vocab, logit_scale = c.pop("vocab", 0), c.pop("logit_scale", 2.0)
    t = {"logits": plain(rng, (T, E), "f32", scale=logit_scale)}
    if has_bias:
        t["bias"] = plain(rng, (E,), "f32", scale=0.3)
    t["topk_ids"] = out((T, K), "int32")
    t["topk_weights"] = out((T, K), "f32")
    if vocab:   # every token id of the vocabulary maps to K distinct experts, in no particular order
        t["token_ids"] = ints(rng.integers(0, vocab, T))
        t["hash_table"] = ints(np.stack([rng.permutation(E)[:K] for _ in range(vocab)]))
    return Case("moe_router", f"moe_router {config} T={T} E={E} K={K}", config, t, c,
                check=["topk_ids", "topk_weights"], tol_key="f32", compare="router", seed=seed)


def moe_experts(seed, T, E, K, H, I, dtype, wfmt=None, routing="random", accumulate=0,
                absent=(), expect="OK", limit=0.0, mapped=None) -> Case:
    """routing: random | one (every token to expert 0) | skip (ids -1 and E mixed in);
    absent: experts whose weights are not resident (data NULL); limit > 0: V4's clipped SwiGLU (1.3).
    mapped (1.5): an expert cache's table, expert_map [M] with M = E + mapped model experts, and its
    misses output; see _expert_map for what routing means then."""
    rng = np.random.default_rng(seed)
    wfmt = wfmt or dtype
    quantized = wfmt in WEIGHT_FORMATS

    def weight(shape):
        if quantized:
            return WEIGHT_FORMATS[wfmt].random(rng, shape)
        return plain(rng, shape, wfmt, scale=1 / math.sqrt(shape[1]))

    resident = [e for e in range(E) if e not in absent]
    table = None
    if mapped is not None:
        table, ids = _expert_map(rng, T, E, K, E + mapped, absent, routing)
    elif routing == "one":
        ids = np.zeros((T, K), np.int64)
        ids[:, 1:] = -1
    else:
        # experts with no token at all are wanted: draw from half the resident experts
        pool = resident[: max(1, len(resident) // 2)] if routing != "all" else resident
        ids = np.stack([rng.choice(pool, K, replace=len(pool) < K) for _ in range(T)]) if T else np.zeros((0, K))
        if routing == "skip" and T:
            ids[rng.integers(0, T), rng.integers(0, K)] = -1
            ids[rng.integers(0, T), rng.integers(0, K)] = E
    if expect == "FAILED_PRECONDITION" and T:
        ids[0, 0] = absent[0]
    t = {"x": plain(rng, (T, H), dtype),
         "topk_ids": ints(ids.astype(np.int32)),
         "topk_weights": TSpec("f32", (T, K), rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)),
         "w_gate": [None if e in absent else weight((I, H)) for e in range(E)],
         "w_up": [None if e in absent else weight((I, H)) for e in range(E)],
         "w_down": [None if e in absent else weight((H, I)) for e in range(E)]}
    if accumulate:
        t["out"] = plain(rng, (T, H), dtype)
        t["out"].out = True
    else:
        t["out"] = out((T, H), dtype)
    check, tol_keys = ["out"], {}
    if table is not None:
        t["expert_map"] = ints(table)
        t["misses"] = out((T, K), "int32")
        check, tol_keys = ["out", "misses"], {"misses": "exact"}   # misses: integers, exactly the reference's
    name = f"moe_experts {dtype} w={wfmt} {_shape_str(T=T, E=E, K=K, H=H, I=I)} routing={routing}" \
           f"{' accumulate' if accumulate else ''}{' absent=' + str(list(absent)) if absent else ''}" \
           f"{f' swiglu_limit={limit:g}' if limit else ''}" \
           f"{f' expert_map M={E + mapped}' if table is not None else ''}"
    scal = {"num_experts": E, "accumulate": accumulate}
    if limit:   # only when set: a 1.2 library runs every other case
        scal["swiglu_limit"] = limit
    return Case("moe_experts", name, f"x={dtype} w={wfmt}" + (" limit" if limit else "") +
                (" map" if table is not None else ""), t, scal, check=check, tol_key=_tol(dtype, quantized),
                tol_keys=tol_keys, expect=expect, seed=seed)


def _expert_map(rng, T, E, K, M, absent, routing) -> tuple[np.ndarray, np.ndarray]:
    """(expert_map [M], topk_ids [T, K]) of an expert cache (1.5): model experts 0..M-1, E descriptors.

    The map permutes: each descriptor (resident or not) is named by one model expert, chosen at random
    (never the identity when E > 1, so a library that ignores the map is caught), and the M - E other
    entries are -1, E, 2^30, -5, -1, ... (not resident). routing "all": ids only of model experts whose
    descriptor is resident, so no pair misses. "random": ids of half of those (descriptors with no pair
    are wanted, and the others get many pairs each), then one pair (in a random place, as far as there
    are pairs) forced to an entry of each kind that misses: -1, >= E, a non-resident descriptor. "cold":
    ids drawn from all M model experts (most pairs miss), then the same. "skip": as random, and ids
    outside [0, M) (-1 and M), skipped but not flagged. "one": every token's k = 0 to the model expert
    of descriptor 0, the other k to -1."""
    table = np.full(M, -1, np.int64)
    owners = rng.permutation(M)[:E]                 # owners[d]: the model expert of descriptor d
    if E > 1 and np.all(owners == np.arange(E)):
        owners = np.roll(owners, 1)
    table[owners] = np.arange(E)
    spare = [i for i in range(M) if i not in set(owners.tolist())]
    for j, i in enumerate(spare):      # not resident: -1, E itself, far past E (never read), below -1
        table[i] = (-1, E, 1 << 30, -5)[j % 4]
    here = [int(owners[d]) for d in range(E) if d not in absent]
    if routing == "one":
        ids = np.full((T, K), -1, np.int64)
        ids[:, :1] = owners[0]
        return table.astype(np.int32), ids
    pool = list(range(M)) if routing == "cold" else here if routing == "all" else here[: max(1, len(here) // 2)]
    ids = rng.choice(pool, (T, K)) if pool and T * K else np.full((T, K), -1, np.int64)
    if routing != "all":
        kinds = [[i for i in spare if table[i] < 0], [i for i in spare if table[i] >= E],
                 [int(owners[d]) for d in absent]]
        forced = [int(rng.choice(k)) for k in kinds if k]
        if routing == "skip":
            forced += [-1, M]
        places = rng.permutation(T * K)[:len(forced)]
        ids.reshape(-1)[places] = forced[:len(places)]
    return table.astype(np.int32), ids


# ====================================================================== generators


def gen_moe_router(p, s):
    for cfg in ROUTER_CONFIGS:
        yield moe_router(s(), 0, cfg)
        yield moe_router(s(), 9, cfg)
        for _ in range(p.random_draws):
            yield moe_router(s(), int(s.rng.integers(1, 40)), cfg)


def gen_moe_experts(p, s):
    for dt in FLOATS:
        yield moe_experts(s(), 0, 4, 2, 16, 8, dt)
        yield moe_experts(s(), 6, 5, 2, 24, 40, dt, routing="skip")
        yield moe_experts(s(), 5, 4, 2, 16, 24, dt, routing="one", accumulate=1)
        yield moe_experts(s(), 4, 6, 2, 16, 8, dt, absent=(5,))
    for wf in _pick(p, ["int4/g32/sym/f32", "e4m3/128x128/f32", "uint4/g32/asym/f32", "int8/channel/f32",
                        "e2m1/g32/e8m0"]):
        yield moe_experts(s(), 4, 4, 2, 40, 24, "bf16", wf)
    # On the tensor-core grid of the GPU backends (rows a multiple of 16, K of 128), each weight
    # format they take: decode-sized (T=3, a token or two per expert) and prefill-sized (T=150 over
    # 4 of 8 experts, about 75 tokens each: more than one 64-token work item per expert).
    for wf in ["bf16"] + _pick(p, ["int4/g32/sym/f32", "int4/g64/sym/bf16", "int4/g128/sym/f16",
                                   "uint4/g32/asym/f32", "uint4/g128/asym/f16+u8", "int8/channel/f32",
                                   "e4m3/128x128/f32"]):
        yield moe_experts(s(), 3, 8, 2, 256, 128, "bf16", wf)
        yield moe_experts(s(), 150, 8, 2, 256, 128, "bf16", wf)
    yield moe_experts(s(), 40, 8, 3, 256, 160, "bf16", routing="skip", accumulate=1, absent=(7,))
    yield moe_experts(s(), 3, 8, 0, 256, 128, "bf16", accumulate=1)   # top-k of 0: out keeps its values
    # 1.3: V4's clipped SwiGLU (limits at which many of the unit-sized activations clip, and V4's 10)
    for dt in FLOATS:
        yield moe_experts(s(), 6, 5, 2, 24, 40, dt, routing="skip", limit=0.5)
    yield moe_experts(s(), 4, 4, 2, 40, 24, "bf16", "int4/g32/sym/f32", limit=0.7, accumulate=1)
    yield moe_experts(s(), 150, 8, 2, 256, 128, "bf16", "e4m3/128x128/f32", limit=0.7)
    yield moe_experts(s(), 5, 4, 2, 16, 24, "f32", limit=10.0)
    for _ in range(p.random_draws):
        r = s.rng
        yield moe_experts(s(), int(r.integers(1, 10)), int(r.integers(1, 8)), int(r.integers(1, 3)),
                          int(r.integers(1, 40)), int(r.integers(1, 40)), FLOATS[int(r.integers(0, 2))],
                          routing=["random", "skip", "all"][int(r.integers(0, 3))], accumulate=int(r.integers(0, 2)))
    # 1.5: an expert cache's table, on seeds of their own (every earlier case keeps its seed). A
    # permuting map over more model experts than descriptors, with entries -1, -5, E, 2^30 and descriptors
    # not resident (misses), ids -1 and M (skipped, not flagged); a pure permutation with every pair resident
    # (misses all 0: what a complete step of the cache computes); every kind of weight the GPU libraries
    # take on their tensor-core grid, decode- and prefill-sized; a limit, accumulate, no tokens.
    s5 = s.fork(5)
    for dt in FLOATS:
        yield moe_experts(s5(), 6, 5, 2, 24, 40, dt, routing="skip", absent=(1,), mapped=3)
        yield moe_experts(s5(), 5, 4, 2, 16, 24, dt, routing="cold", accumulate=1, absent=(0, 3), mapped=4)
        yield moe_experts(s5(), 4, 6, 2, 16, 8, dt, routing="all", mapped=0)
        yield moe_experts(s5(), 3, 4, 3, 16, 8, dt, routing="one", absent=(0,), mapped=2)
    yield moe_experts(s5(), 0, 4, 2, 16, 8, "bf16", mapped=3)
    yield moe_experts(s5(), 6, 5, 2, 24, 40, "f32", routing="skip", absent=(4,), limit=0.5, mapped=3)
    for wf in ["bf16"] + _pick(p, ["int4/g32/sym/f32", "e4m3/128x128/f32"]):
        yield moe_experts(s5(), 3, 8, 2, 256, 128, "bf16", wf, routing="skip", absent=(5,), mapped=8)
        yield moe_experts(s5(), 150, 8, 2, 256, 128, "bf16", wf, absent=(2, 7), mapped=8)
    yield moe_experts(s5(), 150, 8, 2, 256, 128, "bf16", routing="cold", absent=(6,), mapped=8)
    yield moe_experts(s5(), 40, 8, 3, 256, 160, "bf16", routing="all", accumulate=1, mapped=0)
    for _ in range(p.random_draws):
        r = s5.rng
        E = int(r.integers(1, 8))
        yield moe_experts(s5(), int(r.integers(1, 10)), E, int(r.integers(1, 3)), int(r.integers(1, 40)),
                          int(r.integers(1, 40)), FLOATS[int(r.integers(0, 2))],
                          routing=["random", "skip", "all", "cold"][int(r.integers(0, 4))],
                          accumulate=int(r.integers(0, 2)),
                          absent=tuple(int(e) for e in np.nonzero(r.random(E) < 0.3)[0]), mapped=int(r.integers(0, 6)))
    # One token on the tensor-core grid: a batch-1 decode step, which the GPU libraries run without an
    # alignment or a combine kernel (each block reads its pair's expert from topk_ids, the last block of
    # each row tile sums the pairs). On seeds of their own (every earlier case keeps its seed): every
    # weight format; V2-Lite's 64 + 2 experts and K = 8 (experts past the first 32-bit word, a hole); ids
    # -1 and E; an expert chosen twice; H a partial 32-row tile; accumulate; a limit.
    s6 = s.fork(6)
    for wf in ["bf16"] + _pick(p, ["int4/g32/sym/f32", "int4/g64/sym/bf16", "int4/g128/sym/f16",
                                   "uint4/g32/asym/f32", "int8/channel/f32", "e4m3/128x128/f32"]):
        yield moe_experts(s6(), 1, 8, 6, 256, 128, "bf16", wf, routing="all")
    yield moe_experts(s6(), 1, 66, 8, 256, 128, "bf16", routing="all", absent=(40,))
    yield moe_experts(s6(), 1, 8, 3, 272, 128, "bf16", routing="skip", accumulate=1)
    yield moe_experts(s6(), 1, 8, 6, 256, 128, "bf16", routing="random")   # 6 picks of 4 experts: repeats
    yield moe_experts(s6(), 1, 8, 2, 256, 160, "bf16", "int4/g32/sym/f32", routing="all", accumulate=1, limit=0.7)


def gen_moe_experts_errors(p, s):
    yield moe_experts(s(), 3, 4, 2, 16, 8, "f32", absent=(2,), expect="FAILED_PRECONDITION")


# ====================================================================== large cases


def large_moe_router(s):
    yield moe_router(s(), 512, "v3")


def large_moe_experts(s):
    yield moe_experts(s(), 64, 8, 2, 128, 96, "bf16", "int4/g32/sym/f32", routing="all")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "moe_router": OpCases(gen_moe_router, lambda: moe_router(1, 2, "v2lite"), large_moe_router,
                          full=lambda: moe_router(1, 3, "hash-softmax")),   # 1.3's appended fields
    # and 1.5's: a permuting map of every descriptor, resident (a 1.4 caller's call is valid too)
    "moe_experts": OpCases(gen_moe_experts, lambda: moe_experts(1, 2, 2, 1, 8, 4, "f32", routing="all"),
                           large_moe_experts,
                           full=lambda: moe_experts(1, 2, 2, 1, 8, 4, "f32", routing="all", limit=0.3, mapped=0)),
}
