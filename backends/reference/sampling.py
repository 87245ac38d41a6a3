"""sample and spec_verify (abi/README.md section 8): greedy or seeded top-k / top-p sampling, one token
per row, and speculative sampling's accept-or-replace of draft tokens.

Both ops draw from the distribution `kept_distribution` defines (softmax at a temperature, then the
top_k / top_p kept set), so they can never disagree about it. Probabilities are float64.
"""
from __future__ import annotations

import numpy as np

from .common import check_arg, check_dim, read, read_index, write
MASK64 = (1 << 64) - 1
# the seed offset of spec_verify's second draw (the golden-ratio increment of splitmix64)
SPEC_SEED_STEP = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea and Flood), all arithmetic mod 2^64."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int) -> float:
    """A float64 in [0, 1) from the top 53 bits of splitmix64(seed)."""
    return (splitmix64(seed) >> 11) * 2.0 ** -53


def kept_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """(order, kept): the tokens `sample` may draw for a row with temperature > 0, in its draw order
    (softmax probability descending, ties to the lower index), and their softmax probabilities
    (not yet renormalized; the kept set's distribution is kept / kept.sum())."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")   # descending, ties: lower index first
    kept = p[order]
    if 0 < top_k < len(kept):
        kept = kept[:top_k]
    reaches = np.flatnonzero(np.cumsum(kept) >= top_p)
    if len(reaches):
        kept = kept[: reaches[0] + 1]       # the shortest prefix whose sum reaches top_p (>= 1 token)
    return order[: len(kept)], kept


def distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The full [V] distribution `sample` draws from: the kept set renormalized, zero elsewhere."""
    order, kept = kept_distribution(logits, temperature, top_k, top_p)
    p = np.zeros(len(logits))
    p[order] = kept / kept.sum()
    return p


def greedy_row(logits: np.ndarray) -> tuple[int, float]:
    """(argmax with the lowest index on ties, its softmax probability at temperature 1)."""
    tok = int(np.argmax(logits))
    return tok, float(1.0 / np.exp(logits - logits[tok]).sum())


def draw_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> tuple[int, float]:
    """`sample` for one row: (token, its probability under the distribution it was drawn from)."""
    if not temperature > 0:
        return greedy_row(logits)
    order, kept = kept_distribution(logits, temperature, top_k, top_p)
    running = np.cumsum(kept)
    i = int(np.flatnonzero(running > uniform(seed) * running[-1])[0])
    return int(order[i]), float(kept[i] / running[-1])


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    return draw_row(logits, temperature, top_k, top_p, seed)[0]


def verify_row(logits: np.ndarray, draft_logits, draft: int, temperature: float, top_k: int, top_p: float,
               seed: int) -> tuple[int, int]:
    """spec_verify for one row: (token, accepted). draft_logits None: the draft distribution q is
    one-hot at `draft` (greedy drafting)."""
    if not temperature > 0:
        tok = greedy_row(logits)[0]
        return tok, int(draft >= 0 and tok == draft)
    if draft < 0:   # the bonus position: a plain draw
        return sample_row(logits, temperature, top_k, top_p, seed), 0
    p = distribution(logits, temperature, top_k, top_p)
    if draft_logits is None:
        q = np.zeros(len(logits))
        q[draft] = 1.0
    else:
        q = distribution(draft_logits, temperature, top_k, top_p)
    if uniform(seed) * q[draft] < p[draft]:
        return draft, 1
    seed2 = (seed + SPEC_SEED_STEP) & MASK64
    r = np.maximum(p - q, 0.0)
    running = np.cumsum(r)
    if not running[-1] > 0:
        return sample_row(logits, temperature, top_k, top_p, seed2), 0
    return int(np.flatnonzero(running > uniform(seed2) * running[-1])[0]), 0


def _check_logits(op: str, name: str, x: np.ndarray) -> None:
    if np.any(np.isnan(x) | np.isposinf(x)):
        raise ValueError(f"{op}: {name} hold NaN or +inf")
    if x.shape[-1] and np.any(np.all(np.isneginf(x), axis=-1)):
        raise ValueError(f"{op}: a row of {name} is all -inf")


def _read_controls(op: str, B: int, V: int, temperature, top_k, top_p, seeds, outs):
    """The per-row sampling controls of sample / spec_verify, checked; outs: [(name, tensor)] to check too."""
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds), *outs):
        check_arg(op, name, t)
        if t is not None:
            check_dim(op, f"{name}.shape[0]", t.shape[0], B, "logits.shape[0]")
    if V == 0 and B > 0:
        raise ValueError(f"{op}: logits.shape[1]=0: nothing to sample from")
    ks = read_index(top_k)
    if np.any(ks < 0):
        raise ValueError(f"{op}: top_k[{int(np.argmax(ks < 0))}]={int(ks[ks < 0][0])} is negative (0 = off)")
    seed_values = [int(s) for s in seeds.numpy()]     # Python ints: exact 64-bit arithmetic
    return read(temperature), ks, read(top_p), seed_values


def sample(logits=None, temperature=None, top_k=None, top_p=None, seeds=None, out=None, probs=None) -> None:
    op = "sample"
    check_arg(op, "logits", logits)
    B, V = logits.shape
    temp, ks, ps, seed_values = _read_controls(op, B, V, temperature, top_k, top_p, seeds,
                                               [("out", out), ("probs", probs)])
    x = read(logits)
    _check_logits(op, "logits", x)
    rows = [draw_row(x[b], float(temp[b]), int(ks[b]), float(ps[b]), seed_values[b]) for b in range(B)]
    write(out, np.array([r[0] for r in rows], dtype=np.int64))
    if probs is not None:
        write(probs, np.array([r[1] for r in rows], dtype=np.float64))


def spec_verify(logits=None, draft_logits=None, draft_ids=None, temperature=None, top_k=None, top_p=None,
                seeds=None, out=None, accepted=None) -> None:
    op = "spec_verify"
    check_arg(op, "logits", logits)
    T, V = logits.shape
    check_arg(op, "draft_logits", draft_logits)
    if draft_logits is not None and tuple(draft_logits.shape) != (T, V):
        raise ValueError(f"{op}: draft_logits.shape={list(draft_logits.shape)}, expected {[T, V]} (logits' shape)")
    check_arg(op, "draft_ids", draft_ids)
    check_dim(op, "draft_ids.shape[0]", draft_ids.shape[0], T, "logits.shape[0]")
    temp, ks, ps, seed_values = _read_controls(op, T, V, temperature, top_k, top_p, seeds,
                                               [("out", out), ("accepted", accepted)])
    ds = read_index(draft_ids)
    if np.any(ds >= V):
        t = int(np.argmax(ds >= V))
        raise ValueError(f"{op}: draft_ids[{t}]={int(ds[t])} >= V={V}")
    x = read(logits)
    _check_logits(op, "logits", x)
    dx = None
    if draft_logits is not None:
        dx = read(draft_logits)
        judged = (temp > 0) & (ds >= 0)     # the rows that read draft_logits
        _check_logits(op, "draft_logits (of a sampled row with a draft)", dx[judged])
    rows = [verify_row(x[t], None if dx is None else dx[t], int(ds[t]), float(temp[t]), int(ks[t]), float(ps[t]),
                       seed_values[t]) for t in range(T)]
    write(out, np.array([r[0] for r in rows], dtype=np.int64))
    write(accepted, np.array([r[1] for r in rows], dtype=np.int64))
