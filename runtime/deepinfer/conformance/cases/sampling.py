"""Cases of sample (with 1.2's probs and 1.7's controls) and spec_verify (drafts with and without draft logits)."""
from __future__ import annotations

import numpy as np

from ...reference.sampling import distribution   # the spec's q, to draw drafts that get accepted
from .common import Case, OpCases, TSpec, ints, out


# ====================================================================== builders


def sample(seed, B, V, mode="mixed", ties=False, probs=False) -> Case:
    """mode: greedy (every temperature 0) | mixed (greedy and sampled rows, various top-k/top-p).
    probs: also pass the 1.2 output `probs` (its own format, so a 1.1 library reports it unsupported)."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    if ties and V > 3:
        for b in range(B):
            m = logits[b].max() + 1.0
            logits[b, rng.choice(V, 3, replace=False)] = m
    if mode == "greedy":
        temp = np.zeros(B, np.float32)
    else:
        temp = rng.choice(np.array([0.0, 0.6, 1.0, 1.5], np.float32), B)
    top_k = rng.choice(np.array([0, 0, 1, 5, 50], np.int32), B)
    top_p = rng.choice(np.array([1.0, 0.95, 0.5], np.float32), B)
    seeds = rng.integers(0, 2**64, B, dtype=np.uint64)
    t = {"logits": TSpec("f32", (B, V), logits), "temperature": TSpec("f32", (B,), temp),
         "top_k": ints(top_k), "top_p": TSpec("f32", (B,), top_p.astype(np.float32)),
         "seeds": TSpec("uint64", (B,), seeds), "out": out((B,), "int32")}
    if probs:
        t["probs"] = out((B,), "f32")
    return Case("sample", f"sample {mode}{' ties' if ties else ''}{' probs' if probs else ''} B={B} V={V}",
                f"{mode}+probs" if probs else mode, t, check=["out", "probs"] if probs else ["out"],
                tol_key="exact", compare="sample", seed=seed)


def sample_controls(seed, B, V, mode="mixed", groups=("penalties", "bias", "mask"), probs=False, L=24) -> Case:
    """sample with ABI 1.7's controls (`groups` of them): histories with repeats, -1 padding and ids >= V
    (padding too), prompt lengths from 0 to L, penalties neutral in some rows, logit bias of ids outside
    [0, V) (unused slots), strong values and -inf, masks dense, sparse, all-allowed and (one row) all
    banned, so that out = -1 there. Logits are spread (x4) so a penalty moves a row's ranking."""
    c = sample(seed, B, V, mode, probs=probs)
    rng = np.random.default_rng(seed + 7919)
    t = c.tensors
    t["logits"] = TSpec("f32", (B, V), (rng.standard_normal((B, V)) * 4).astype(np.float32))
    if "penalties" in groups:
        hist = rng.integers(0, max(1, min(V, 12)), (B, L)).astype(np.int32)   # few ids: many repeats
        hist[rng.random((B, L)) < 0.1] = -1
        hist[rng.random((B, L)) < 0.05] = V + 3
        pl = rng.integers(0, L + 1, B).astype(np.int32)
        pen = np.stack([rng.choice(np.array([1.0, 1.3, 0.7, 2.0], np.float32), B),
                        rng.choice(np.array([0.0, 0.5, -0.5, 2.0], np.float32), B),
                        rng.choice(np.array([0.0, 1.0, -1.0, 0.25], np.float32), B)], axis=1).astype(np.float32)
        t["history"], t["prompt_lens"], t["penalties"] = ints(hist), ints(pl), TSpec("f32", (B, 3), pen)
    if "bias" in groups:
        N = 5
        ids = np.array([rng.choice(V + 8, N, replace=False) for _ in range(B)], np.int32).reshape(B, N) - 4
        bias = rng.choice(np.array([-100.0, -2.0, 0.5, 3.0, 100.0, -np.inf], np.float32), (B, N))
        t["bias_ids"], t["bias"] = ints(ids), TSpec("f32", (B, N), bias.astype(np.float32))
    if "mask" in groups:
        W = (V + 31) // 32
        density = rng.choice(np.array([1.0, 0.5, 0.05]), (B, 1))
        bits = rng.random((B, W * 32)) < density
        bits[:, V:] = rng.random((B, W * 32 - V)) < 0.5           # bits past V mean nothing
        if B > 2:
            bits[B // 2, :V] = False                               # every token banned: out = -1
        for b in range(B):
            if b != B // 2 and not bits[b, :V].any():
                bits[b, rng.integers(0, V)] = True
        words = np.packbits(bits.reshape(B, W, 32)[:, :, ::-1], axis=-1, bitorder="big").view(">u4").reshape(B, W)
        t["token_mask"] = ints(words.astype(np.uint32).reshape(B, W).view(np.int32))
    name = f"sample controls={'+'.join(groups)} {mode}{' probs' if probs else ''} B={B} V={V}"
    return Case("sample", name, "controls", t, check=c.check, tol_key="exact", compare="sample", seed=seed)


def spec_verify(seed, T, V, mode="mixed", draft="logits", ties=False) -> Case:
    """mode: greedy (every temperature 0) | mixed (greedy and sampled rows, various top-k/top-p).
    draft: logits (draft_logits given: the target's logits plus noise, drafts drawn from that q) |
    greedy (no draft_logits: q is one-hot at the draft). Rows mix bonus rows (draft -1), drafts drawn
    from q, the target's own argmax and arbitrary ids (a draft id >= V is L0's business: abi_checks)."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    if ties and V > 3:
        for r in range(T):
            logits[r, rng.choice(V, 3, replace=False)] = logits[r].max() + 1.0
    noise = rng.choice(np.array([0.0, 0.3, 1.0, 3.0]), (T, 1))   # how far the draft model is from the target
    dlogits = (logits + noise * rng.standard_normal((T, V))).astype(np.float32)
    temp = np.zeros(T, np.float32) if mode == "greedy" else rng.choice(np.array([0.0, 0.6, 1.0, 1.5], np.float32), T)
    top_k = rng.choice(np.array([0, 0, 1, 5, 50], np.int32), T)
    top_p = rng.choice(np.array([1.0, 0.95, 0.5], np.float32), T)
    ids = np.empty(T, np.int32)
    for r in range(T):
        kind = rng.choice(["bonus", "drawn", "argmax", "any"], p=[0.15, 0.5, 0.2, 0.15])
        src = dlogits[r] if draft == "logits" else logits[r]
        if kind == "bonus":
            ids[r] = -1
        elif kind == "argmax":
            ids[r] = int(np.argmax(src))
        elif kind == "drawn" and temp[r] > 0:
            q = distribution(src.astype(np.float64), float(temp[r]), int(top_k[r]), float(top_p[r]))
            ids[r] = int(rng.choice(V, p=q / q.sum()))
        else:
            ids[r] = int(rng.integers(0, V))
    seeds = rng.integers(0, 2**64, T, dtype=np.uint64)
    t = {"logits": TSpec("f32", (T, V), logits)}
    if draft == "logits":
        t["draft_logits"] = TSpec("f32", (T, V), dlogits)
    t.update({"draft_ids": ints(ids), "temperature": TSpec("f32", (T,), temp), "top_k": ints(top_k),
              "top_p": TSpec("f32", (T,), top_p.astype(np.float32)), "seeds": TSpec("uint64", (T,), seeds),
              "out": out((T,), "int32"), "accepted": out((T,), "int32")})
    name = f"spec_verify {mode} draft={draft}{' ties' if ties else ''} T={T} V={V}"
    return Case("spec_verify", name, f"{mode}/{draft}", t, check=["out", "accepted"], tol_key="exact",
                compare="spec_verify", seed=seed)


# ====================================================================== generators


def gen_sample(p, s):
    yield sample(s(), 4, 7, "greedy", ties=True)
    yield sample(s(), 0, 10, "mixed")
    yield sample(s(), 12, 100, "mixed")
    yield sample(s(), 8, 1000, "mixed", ties=True)
    yield sample(s(), 3, 1, "mixed")
    for _ in range(p.random_draws):
        yield sample(s(), int(s.rng.integers(1, 16)), int(s.rng.integers(1, 3000)), "mixed",
                     ties=bool(s.rng.integers(0, 2)))
    # the 1.2 output probs
    yield sample(s(), 4, 7, "greedy", ties=True, probs=True)
    yield sample(s(), 12, 100, "mixed", probs=True)
    yield sample(s(), 8, 1000, "mixed", ties=True, probs=True)
    for _ in range(p.random_draws):
        yield sample(s(), int(s.rng.integers(1, 16)), int(s.rng.integers(1, 3000)), "mixed", probs=True)
    # 1.7's controls: each group alone and all together, greedy and sampled, with probs
    c = s.fork(7)
    for groups in (("penalties",), ("bias",), ("mask",), ("penalties", "bias", "mask")):
        yield sample_controls(c(), 6, 40, "greedy", groups)
        yield sample_controls(c(), 9, 300, "mixed", groups, probs=True)
    yield sample_controls(c(), 5, 33, "mixed", probs=True, L=1)
    yield sample_controls(c(), 0, 10, "mixed")
    for _ in range(p.random_draws):
        yield sample_controls(c(), int(c.rng.integers(1, 16)), int(c.rng.integers(1, 3000)), "mixed",
                              probs=bool(c.rng.integers(0, 2)), L=int(c.rng.integers(1, 64)))


def gen_spec_verify(p, s):
    yield spec_verify(s(), 4, 7, "greedy", "greedy", ties=True)
    yield spec_verify(s(), 6, 9, "greedy", "logits", ties=True)
    yield spec_verify(s(), 0, 10, "mixed", "logits")
    yield spec_verify(s(), 3, 1, "mixed", "logits")
    for draft in ("logits", "greedy"):
        yield spec_verify(s(), 24, 16, "mixed", draft)
        yield spec_verify(s(), 16, 100, "mixed", draft)
        yield spec_verify(s(), 8, 1000, "mixed", draft, ties=True)
        for _ in range(p.random_draws):
            yield spec_verify(s(), int(s.rng.integers(1, 24)), int(s.rng.integers(1, 3000)), "mixed", draft,
                              ties=bool(s.rng.integers(0, 2)))


# ====================================================================== large cases


def large_sample(s):
    yield sample(s(), 16, 32000, "mixed")
    yield sample_controls(s(), 16, 32000, "mixed", probs=True, L=512)


def large_spec_verify(s):
    yield spec_verify(s(), 16, 32000, "mixed", "logits")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "sample": OpCases(gen_sample, lambda: sample(1, 2, 8, "greedy"), large_sample,
                      full=lambda: sample_controls(1, 3, 8, "mixed", probs=True)),
    "spec_verify": OpCases(gen_spec_verify, lambda: spec_verify(1, 2, 8, "greedy", "greedy"), large_spec_verify),
}
