"""sample and spec_verify (abi/README.md section 8): greedy or seeded top-k / top-p sampling, one token
per row (after 1.7's controls: logit bias, repetition / frequency / presence penalties, a token mask),
and speculative sampling's accept-or-replace of draft tokens.

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


def _read_sample_controls(op: str, B: int, V: int, history, prompt_lens, penalties, bias_ids, bias, token_mask):
    """ABI 1.7's controls of sample, checked: (history [B, L], prompt_lens [B], penalties [B, 3], bias_ids
    [B, N], bias [B, N], mask words [B, W]) as arrays, None for an absent group."""
    for name, t in (("history", history), ("prompt_lens", prompt_lens), ("penalties", penalties),
                    ("bias_ids", bias_ids), ("bias", bias), ("token_mask", token_mask)):
        check_arg(op, name, t)
        if t is not None:
            check_dim(op, f"{name}.shape[0]", t.shape[0], B, "logits.shape[0]")
    group = (history, prompt_lens, penalties)
    if any(t is not None for t in group) and not all(t is not None for t in group):
        raise ValueError(f"{op}: history, prompt_lens and penalties go together (all present or all absent)")
    if (bias_ids is None) != (bias is None):
        raise ValueError(f"{op}: bias_ids and bias go together (both present or both absent)")
    hist = pl = pen = bids = bv = words = None
    if history is not None:
        hist, pl, pen = read_index(history), read_index(prompt_lens), read(penalties, np.float32)
        check_dim(op, "penalties.shape[1]", penalties.shape[1], 3, "3 (repetition, frequency, presence)")
        L = hist.shape[1]
        if np.any((pl < 0) | (pl > L)):
            b = int(np.argmax((pl < 0) | (pl > L)))
            raise ValueError(f"{op}: prompt_lens[{b}]={int(pl[b])} is outside [0, L={L}]")
        if not np.all(np.isfinite(pen)) or np.any(pen[:, 0] <= 0):
            b = int(np.argmax(~np.all(np.isfinite(pen), axis=1) | (pen[:, 0] <= 0)))
            raise ValueError(f"{op}: penalties[{b}]={pen[b].tolist()}: each must be finite and the repetition "
                             f"penalty (column 0) > 0")
    if bias_ids is not None:
        check_dim(op, "bias.shape[1]", bias.shape[1], bias_ids.shape[1], "bias_ids.shape[1]")
        bids, bv = read_index(bias_ids), read(bias, np.float32)
        if np.any(np.isnan(bv) | np.isposinf(bv)):
            raise ValueError(f"{op}: bias holds NaN or +inf (finite values or -inf only)")
    if token_mask is not None:
        check_dim(op, "token_mask.shape[1]", token_mask.shape[1], (V + 31) // 32, "ceil(V / 32)")
        words = np.array(token_mask.numpy(), dtype=np.int32, copy=True).view(np.uint32)
    return hist, pl, pen, bids, bv, words


def controlled_row(x: np.ndarray, b: int, hist, pl, pen, bids, bv, words) -> np.ndarray:
    """Row b's logits (f32) after 1.7's controls, in this order and in f32 arithmetic (README section 8):
    logit bias added; then every token of the row's history (prompt and output) divided by the repetition
    penalty where positive, multiplied where not; then count * frequency and then presence subtracted
    from every token the output holds (count times); then every token the mask bans set to -inf."""
    x = x.astype(np.float32, copy=True)
    V = len(x)
    one = np.float32
    if bids is not None:
        for t, v in zip(bids[b], bv[b]):
            if 0 <= t < V:
                x[t] = one(x[t] + v)
    if hist is not None:
        h = hist[b]
        out_ids = h[pl[b]:]
        out_ids = out_ids[(out_ids >= 0) & (out_ids < V)]
        seen = np.unique(h[(h >= 0) & (h < V)])
        rep, freq, pres = (one(v) for v in pen[b])
        if rep != 1:
            x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep).astype(np.float32)
        ids, counts = np.unique(out_ids, return_counts=True)
        x[ids] = (x[ids] - counts.astype(np.float32) * freq).astype(np.float32)
        x[ids] = (x[ids] - pres).astype(np.float32)
    if words is not None:
        allowed = (words[b][np.arange(V) >> 5] >> (np.arange(V) & 31).astype(np.uint32)) & 1
        x[allowed == 0] = -np.inf
    return x


def sample(logits=None, temperature=None, top_k=None, top_p=None, seeds=None, out=None, probs=None, history=None,
           prompt_lens=None, penalties=None, bias_ids=None, bias=None, token_mask=None) -> None:
    op = "sample"
    check_arg(op, "logits", logits)
    B, V = logits.shape
    temp, ks, ps, seed_values = _read_controls(op, B, V, temperature, top_k, top_p, seeds,
                                               [("out", out), ("probs", probs)])
    controls = _read_sample_controls(op, B, V, history, prompt_lens, penalties, bias_ids, bias, token_mask)
    x = read(logits)
    _check_logits(op, "logits", x)
    controlled = any(c is not None for c in controls)
    x32 = read(logits, np.float32) if controlled else None
    rows = []
    for b in range(B):
        row = x[b]
        if controlled:
            row = controlled_row(x32[b], b, *controls).astype(np.float64)
            if not np.any(row > -np.inf):
                rows.append((-1, 0.0))     # the controls banned every token: no draw
                continue
        rows.append(draw_row(row, float(temp[b]), int(ks[b]), float(ps[b]), seed_values[b]))
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
