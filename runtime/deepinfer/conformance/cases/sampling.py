"""Cases of sample (with 1.2's probs) and spec_verify (drafts with and without draft logits)."""
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


def large_spec_verify(s):
    yield spec_verify(s(), 16, 32000, "mixed", "logits")


# ====================================================================== the ops of this family (collected by cases/__init__.py)


OPS = {
    "sample": OpCases(gen_sample, lambda: sample(1, 2, 8, "greedy"), large_sample,
                      full=lambda: sample(1, 3, 8, "mixed", probs=True)),
    "spec_verify": OpCases(gen_spec_verify, lambda: spec_verify(1, 2, 8, "greedy", "greedy"), large_spec_verify),
}
