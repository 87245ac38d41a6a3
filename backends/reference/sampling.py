"""sample (abi/README.md section 8): greedy or seeded top-k / top-p sampling, one token per row."""
from __future__ import annotations

import numpy as np

from .common import check_arg, check_dim, read, read_index, write
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea and Flood), all arithmetic mod 2^64."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int) -> float:
    """A float64 in [0, 1) from the top 53 bits of splitmix64(seed)."""
    return (splitmix64(seed) >> 11) * 2.0 ** -53


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    if not temperature > 0:
        return int(np.argmax(logits))    # the first maximum: the lowest index on ties
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
    running = np.cumsum(kept)
    target = uniform(seed) * running[-1]
    return int(order[np.flatnonzero(running > target)[0]])


def sample(logits=None, temperature=None, top_k=None, top_p=None, seeds=None, out=None) -> None:
    op = "sample"
    check_arg(op, "logits", logits)
    B, V = logits.shape
    for name, t, dt in (("temperature", temperature, "f32"), ("top_k", top_k, "int32"), ("top_p", top_p, "f32"),
                        ("seeds", seeds, "uint64"), ("out", out, "int32")):
        check_arg(op, name, t)
        check_dim(op, f"{name}.shape[0]", t.shape[0], B, "logits.shape[0]")
    if V == 0 and B > 0:
        raise ValueError(f"{op}: logits.shape[1]=0: nothing to sample from")
    ks = read_index(top_k)
    if np.any(ks < 0):
        raise ValueError(f"{op}: top_k[{int(np.argmax(ks < 0))}]={int(ks[ks < 0][0])} is negative (0 = off)")
    x, temp, ps = read(logits), read(temperature), read(top_p)
    seed_values = [int(s) for s in seeds.numpy()]     # Python ints: exact 64-bit arithmetic
    if np.any(np.isnan(x) | np.isposinf(x)):
        raise ValueError(f"{op}: logits hold NaN or +inf")
    if V and np.any(np.all(np.isneginf(x), axis=-1)):
        raise ValueError(f"{op}: a row of logits is all -inf")
    tokens = [sample_row(x[b], float(temp[b]), int(ks[b]), float(ps[b]), seed_values[b]) for b in range(B)]
    write(out, np.array(tokens, dtype=np.int64))
