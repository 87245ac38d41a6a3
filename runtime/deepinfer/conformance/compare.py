"""How a library's outputs are judged against the reference's: bit for bit, within a tolerance, and
the op-specific rules where the spec allows more than one answer (router ties, indexer near-ties,
sampling and speculative verification at near-ties, recomputed in f64).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..reference.moe import router_scores
from ..reference.sampling import SPEC_SEED_STEP, controlled_row, distribution
from ..reference.sparse import entry_rows
from . import tolerances as TOL
from .cases import Case

def _as_f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize == 1 and a.dtype.name in ("int4", "uint4", "float4_e2m1fn"):
        return a.astype(np.float32).view(np.uint32)   # 4-bit values: compare the decoded values
    return a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,)) if a.ndim else a.view(np.uint8)


def compare_exact(got: np.ndarray, want: np.ndarray, what: str) -> Optional[str]:
    if got.shape != want.shape:
        return f"{what}: shape {got.shape} != {want.shape}"
    if got.size == 0:
        return None
    g, w = _bits(got), _bits(want)
    diff = np.any((g != w).reshape(got.shape + (-1,)), axis=-1) if got.ndim else bool(np.any(g != w))
    if not np.any(diff):
        return None
    idx = np.argwhere(diff) if got.ndim else [()]
    first = tuple(int(i) for i in idx[0])
    n = int(np.count_nonzero(diff))
    return (f"{what}: {n} of {got.size} elements differ (bit-exact required); first at {list(first)}: "
            f"got {got[first]!r}, want {want[first]!r}")


def compare_close(got: np.ndarray, want: np.ndarray, tol: TOL.Tol, what: str) -> tuple[Optional[str], float, float]:
    if got.shape != want.shape:
        return f"{what}: shape {got.shape} != {want.shape}", 0.0, 0.0
    if got.size == 0:
        return None, 0.0, 0.0
    if tol.exact:
        return compare_exact(got, want, what), 0.0, 0.0
    g, w = _as_f64(got), _as_f64(want)
    want_nan = np.isnan(w)
    if np.any(want_nan):
        return f"{what}: the reference produced NaN at {np.argwhere(want_nan)[0].tolist()} (reference bug?)", 0, 0
    bad_nan = ~np.isfinite(g) & np.isfinite(w)
    if np.any(bad_nan):
        first = tuple(np.argwhere(bad_nan)[0])
        return (f"{what}: {int(bad_nan.sum())} non-finite element(s) (poison NaN = never written?); first at "
                f"{list(first)}: got {g[first]}, want {w[first]}"), math.inf, math.inf
    err = np.abs(g - w)
    rms = float(np.sqrt(np.mean(w * w)))
    bound = tol.rtol * np.abs(w) + tol.atol_rel * rms + 1e-30
    denom = float(np.sum(w * w))
    nmse = float(np.sum(err * err) / denom) if denom > 0 else float(np.sum(err * err))
    max_err = float(err.max())
    over = err > bound
    if np.any(over):
        first = tuple(int(i) for i in np.argwhere(over)[0])
        return (f"{what}: {int(over.sum())} of {got.size} elements outside rtol={tol.rtol} atol_rel={tol.atol_rel} "
                f"(rms {rms:.3g}); worst err {max_err:.3g}; first at {list(first)}: got {g[first]!r}, "
                f"want {w[first]!r}"), max_err, nmse
    if nmse > tol.nmse:
        return f"{what}: nmse {nmse:.3g} > {tol.nmse}", max_err, nmse
    return None, max_err, nmse


def counted_rows(counts: np.ndarray, shape: tuple) -> np.ndarray:
    """[N, C] mask of the rows j < counts[p] of slot p (an output [N, C, ...] with counts [N])."""
    counts = np.asarray(counts, np.int64).reshape(-1)
    return np.arange(shape[1])[None, :] < counts[:, None]


def _router_select_scores(case: Case) -> np.ndarray:
    """sel = scores + bias in f64, as the spec defines it (used only to recognise ties)."""
    scores = router_scores(np.asarray(case.tensors["logits"].values, np.float64), case.scalars["scoring"])
    b = case.tensors.get("bias")
    return scores + (np.asarray(b.values, np.float64) if b is not None else 0.0)


def _cmp_router(case: Case, got: dict, want: dict) -> tuple[Optional[str], float, float]:
    gi, wi = got["topk_ids"].astype(np.int64), want["topk_ids"].astype(np.int64)
    if gi.shape != wi.shape:
        return f"topk_ids: shape {gi.shape} != {wi.shape}", 0, 0
    if gi.size == 0:
        return None, 0, 0
    if np.any((gi < 0) | (gi >= case.tensors["logits"].shape[1])):
        r = np.argwhere((gi < 0) | (gi >= case.tensors["logits"].shape[1]))[0]
        return f"topk_ids: id {gi[tuple(r)]} out of range at {r.tolist()} (poison = never written?)", 0, 0
    rows_ok = np.ones(gi.shape[0], bool)
    if "hash_table" in case.tensors:
        # hash routing (1.3): the table chooses, so the ids are exact, in table order
        bad = np.nonzero(np.any(gi != wi, axis=1))[0]
        if len(bad):
            t = int(bad[0])
            return (f"topk_ids row {t} (hash routing, token id {int(case.tensors['token_ids'].values[t])}): got "
                    f"{gi[t].tolist()}, want the table's row {wi[t].tolist()} in table order"), 0, 0
    else:
        sel = _router_select_scores(case)
        for t in np.nonzero(np.any(gi != wi, axis=1))[0]:
            # a mismatch is acceptable only between experts whose selection scores tie
            diff = gi[t] != wi[t]
            if np.all(np.abs(sel[t, gi[t][diff]] - sel[t, wi[t][diff]]) <= TOL.ROUTER_TIE_EPS * (1 + np.abs(sel[t, wi[t][diff]]))):
                rows_ok[t] = False    # tie: skip the weights of this row
                continue
            return (f"topk_ids row {t}: got {gi[t].tolist()}, want {wi[t].tolist()} (selection scores "
                    f"{np.round(sel[t, gi[t]], 6).tolist()} vs {np.round(sel[t, wi[t]], 6).tolist()})"), 0, 0
    tol = TOL.lookup("moe_router", "f32")
    return compare_close(got["topk_weights"][rows_ok], want["topk_weights"][rows_ok], tol, "topk_weights")


def _indexer_scores(case: Case, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, magnitudes) of every visible entry of row t, recomputed in f64 from the case: the score
    as the spec defines it, and scale * sum_h |w_h| * sum_i |q_hi * k_i|, the sum of the magnitudes of
    its terms, which scales what accumulating the dots and the head sum in f32 can change it by."""
    tn, sc = case.tensors, case.scalars
    ratio, BS = int(sc["ratio"]), int(sc["block_size"])
    n = int(tn["kv_len"].values[t]) // ratio
    keys = np.asarray(tn["keys"].values, np.float64)
    rows = entry_rows("indexer_topk", keys, np.asarray(tn["block_table"].values, np.int64),
                      int(tn["token_seq"].values[t]), np.arange(n), ratio, BS, "keys")
    q = np.asarray(tn["q"].values[t], np.float64)
    w = np.asarray(tn["weights"].values[t], np.float64)
    scale = float(np.float32(sc["scale"]))
    score = scale * (w @ np.maximum(q @ rows.T, 0.0))
    bound = abs(scale) * (np.abs(w) @ (np.abs(q) @ np.abs(rows).T))
    return score, bound


def _cmp_indexer(case: Case, got: np.ndarray, want: np.ndarray) -> Optional[str]:
    """Row by row: the got ids are distinct visible entries, as many as the reference's, then -1; the set
    may differ from the reference's only by swapping entries whose scores differ by at most
    INDEXER_TIE_EPS times their terms' magnitudes (which of two near-equal scores is larger is f32 noise). The order of
    the selected ids is the spec's (descending score) but not compared: every consumer (sparse_attention,
    mla_decode) treats them as a set."""
    got, want = got.astype(np.int64), want.astype(np.int64)
    if got.shape != want.shape:
        return f"out: shape {got.shape} != {want.shape}"
    ratio = int(case.scalars["ratio"])
    for t in range(got.shape[0]):
        g, w = got[t], want[t]
        k = int(np.count_nonzero(w >= 0))          # the reference fills min(K, visible) then -1
        visible = int(case.tensors["kv_len"].values[t]) // ratio
        if np.any(g[k:] != -1):
            return f"row {t}: {k} of {visible} entries are selectable, so out[{t}, {k}:] must be -1; got {g.tolist()}"
        sel = g[:k]
        if np.any((sel < 0) | (sel >= visible)):
            return (f"row {t}: {sel.tolist()} holds an entry outside [0, {visible}) (poison = never written? "
                    f"or a -1 before the last selectable entry)")
        if len(set(sel.tolist())) != k:
            return f"row {t}: an entry is selected twice: {sel.tolist()}"
        extra, missing = sorted(set(sel.tolist()) - set(w[:k].tolist())), sorted(set(w[:k].tolist()) - set(sel.tolist()))
        if not extra:
            continue
        score, bound = _indexer_scores(case, t)
        worst = min(extra, key=lambda e: score[e])
        best = max(missing, key=lambda e: score[e])
        if score[worst] < score[best] - TOL.INDEXER_TIE_EPS * (bound[worst] + bound[best]):
            return (f"row {t}: selected entry {worst} (score {score[worst]:.9g}) over entry {best} (score "
                    f"{score[best]:.9g}) that scores higher; not a tie within INDEXER_TIE_EPS={TOL.INDEXER_TIE_EPS}")
    return None


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _uniform(seed: int) -> float:
    return (_splitmix64(seed) >> 11) * 2.0 ** -53


def _softmax64(logits_row, temp: float) -> np.ndarray:
    z = np.asarray(logits_row, np.float64) / temp
    p = np.exp(z - z.max())
    return p / p.sum()


def _sample_row_tie(logits_row, temp: float, k: int, top_p: float, seed: int, got: int, want: int) -> Optional[str]:
    """None if `sample` drawing `got` instead of `want` (temperature > 0) is explained by a near-tie the
    spec cannot resolve in f32 (recomputed in f64); else why not."""
    p = _softmax64(logits_row, temp)
    V = len(p)
    eps = TOL.SAMPLE_BOUNDARY_EPS
    near_equal_p = abs(p[got] - p[want]) <= eps * max(p[want], 1e-30) + eps * 1e-3
    order = sorted(range(V), key=lambda i: (-p[i], i))
    k = k or V
    kept = order[:k]
    c = np.cumsum(p[kept])
    n = int(np.searchsorted(c, top_p - 1e-12)) + 1
    kept = kept[: max(1, min(n, len(kept)))]
    pk = p[kept]
    total = pk.sum()
    bounds = np.concatenate([[0.0], np.cumsum(pk)])
    near_boundary = np.min(np.abs(bounds - _uniform(seed) * total)) <= eps * total
    near_cutoff = abs(p[got] - pk[-1]) <= eps * pk[-1]
    if near_equal_p or near_boundary or near_cutoff:
        return None
    return (f"temperature {temp}, top_k {k if k != V else 0}, top_p {top_p}: got token {got} (p={p[got]:.6g}), "
            f"want {want} (p={p[want]:.6g}); not a tie")


def _sample_rows(case: Case) -> np.ndarray:
    """The logits each row of a sample case draws from: the logits, or (ABI 1.7's controls) the
    reference's adjusted rows."""
    t = case.tensors
    x = np.asarray(t["logits"].values, np.float32)
    if not any(n in t for n in ("history", "bias_ids", "token_mask")):
        return x
    val = lambda n, dt: None if n not in t else np.asarray(t[n].values, dt)   # noqa: E731
    words = None if "token_mask" not in t else np.asarray(t["token_mask"].values, np.int32).view(np.uint32)
    controls = (val("history", np.int64), val("prompt_lens", np.int64), val("penalties", np.float32),
                val("bias_ids", np.int64), val("bias", np.float32), words)
    return np.stack([controlled_row(x[b], b, *controls) for b in range(len(x))]) if len(x) else x


def _cmp_sample(case: Case, got: np.ndarray, want: np.ndarray) -> Optional[str]:
    got, want = got.astype(np.int64), want.astype(np.int64)
    if got.shape != want.shape:
        return f"out: shape {got.shape} != {want.shape}"
    V = case.tensors["logits"].shape[1]
    rows = None
    for b in np.nonzero(got != want)[0]:
        if want[b] == -1:
            return f"row {b}: got token {got[b]}, want -1 (the controls ban every token)"
        if not 0 <= got[b] < V:
            return f"row {b}: token {got[b]} out of [0, {V}) (poison = never written?)"
        temp = float(case.tensors["temperature"].values[b])
        if temp <= 0:
            return f"row {b} (greedy): got {got[b]}, want {want[b]} (argmax, lowest index on ties)"
        rows = _sample_rows(case) if rows is None else rows
        if rows[b][got[b]] == -np.inf:
            return f"row {b}: got token {got[b]}, which the controls ban"
        # recompute the spec in f64 and accept the difference only at a near-tie
        why = _sample_row_tie(rows[b], temp, int(case.tensors["top_k"].values[b]),
                              float(case.tensors["top_p"].values[b]), int(case.tensors["seeds"].values[b]),
                              int(got[b]), int(want[b]))
        if why:
            return f"row {b} ({why})"
    return None


def _near(a: float, b: float, eps: float) -> bool:
    return abs(a - b) <= eps * max(abs(a), abs(b)) + eps * 1e-3


def _kept_set_unstable(logits_row, temp: float, k: int, top_p: float, eps: float) -> bool:
    """Whether sample's kept set of a row is within eps of changing in f32: a near-tie across the
    top_k cut, or a prefix sum of the sorted probabilities within eps of top_p."""
    s = np.sort(_softmax64(logits_row, temp))[::-1]
    kk = k if 0 < k < len(s) else len(s)
    if kk < len(s) and _near(s[kk - 1], s[kk], eps):
        return True
    c = np.cumsum(s[:kk])[:-1]
    return bool(np.any(np.abs(c - top_p) <= eps))


def _verify_row_ambiguous(case: Case, t: int, d: int, temp: float, k: int, top_p: float, seed: int) -> bool:
    """Whether a sampled row with a draft is within SAMPLE_BOUNDARY_EPS (recomputed in f64) of one of
    spec_verify's decisions: the kept sets of p and q, the acceptance test u * q(d) < p(d), which
    tokens have p > q, and the residual draw's boundaries."""
    eps = TOL.SAMPLE_BOUNDARY_EPS
    x = np.asarray(case.tensors["logits"].values[t], np.float64)
    dl = case.tensors.get("draft_logits")
    if _kept_set_unstable(x, temp, k, top_p, eps):
        return True
    p = distribution(x, temp, k, top_p)
    if dl is not None:
        dx = np.asarray(dl.values[t], np.float64)
        if _kept_set_unstable(dx, temp, k, top_p, eps):
            return True
        q = distribution(dx, temp, k, top_p)
    else:
        q = np.zeros_like(p)
        q[d] = 1.0
    if _near(_uniform(seed) * q[d], p[d], eps):
        return True
    both = (p > 0) & (q > 0)
    if np.any(np.abs(p[both] - q[both]) <= eps * np.maximum(p[both], q[both])):
        return True
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    if total <= eps:
        return True
    target = _uniform((seed + SPEC_SEED_STEP) % 2**64) * total
    return bool(np.min(np.abs(np.concatenate([[0.0], np.cumsum(r)]) - target)) <= eps * total)


def _cmp_spec_verify(case: Case, got: dict, want: dict) -> Optional[str]:
    go, wo = got["out"].astype(np.int64), want["out"].astype(np.int64)
    ga, wa = got["accepted"].astype(np.int64), want["accepted"].astype(np.int64)
    if go.shape != wo.shape or ga.shape != wa.shape:
        return f"out/accepted: shapes {go.shape}/{ga.shape} != {wo.shape}/{wa.shape}"
    V = case.tensors["logits"].shape[1]
    ds = case.tensors["draft_ids"].values.astype(np.int64)
    for t in np.nonzero((go != wo) | (ga != wa))[0]:
        d = int(ds[t])
        if not 0 <= go[t] < V:
            return f"row {t}: token {go[t]} out of [0, {V}) (poison = never written?)"
        if ga[t] not in (0, 1):
            return f"row {t}: accepted={ga[t]}, not 0 or 1 (poison = never written?)"
        if ga[t] == 1 and go[t] != d:
            return f"row {t}: accepted=1 but out={go[t]} is not the draft {d}"
        temp = float(case.tensors["temperature"].values[t])
        k, top_p = int(case.tensors["top_k"].values[t]), float(case.tensors["top_p"].values[t])
        seed = int(case.tensors["seeds"].values[t])
        what = f"row {t} (draft {d}, temperature {temp}, top_k {k}, top_p {top_p})"
        if temp <= 0:
            return (f"{what}, greedy: got out={go[t]} accepted={ga[t]}, want out={wo[t]} accepted={wa[t]} (argmax, "
                    f"lowest index on ties; accepted when it is the draft)")
        if d < 0:   # the bonus row: exactly sample's draw
            if ga[t]:
                return f"{what}, a row without a draft: accepted must be 0"
            why = _sample_row_tie(case.tensors["logits"].values[t], temp, k, top_p, seed, int(go[t]), int(wo[t]))
            if why:
                return f"{what}, a row without a draft: {why}"
            continue
        if not _verify_row_ambiguous(case, t, d, temp, k, top_p, seed):
            return (f"{what}: got out={go[t]} accepted={ga[t]}, want out={wo[t]} accepted={wa[t]}; no decision of "
                    f"the spec is within {TOL.SAMPLE_BOUNDARY_EPS} of its threshold")
    return None


def compare_outputs(case: Case, got: dict, want: dict, tolerances=None) -> tuple[list[str], float, float]:
    """(problems, max_err, nmse) of the library's outputs `got` against the reference's `want`, each
    a dict output name -> array, judged as case.compare says."""
    max_err, nmse = 0.0, 0.0
    problems = []
    if case.compare == "router":
        msg, max_err, nmse = _cmp_router(case, got, want)
        if msg:
            problems.append(msg)
    elif case.compare == "sample":
        msg = _cmp_sample(case, got["out"], want["out"])
        if msg:
            problems.append(msg)
        elif "probs" in case.check:   # 1.2: the drawn token's probability, where the tokens agree
            same = got["out"] == want["out"]
            table = tolerances or TOL.CURRENT
            msg, max_err, nmse = compare_close(got["probs"][same], want["probs"][same],
                                               TOL.lookup("sample", "probs", table), "probs")
            if msg:
                problems.append(msg)
    elif case.compare == "spec_verify":
        msg = _cmp_spec_verify(case, got, want)
        if msg:
            problems.append(msg)
    elif case.compare == "indexer":
        msg = _cmp_indexer(case, got["out"], want["out"])
        if msg:
            problems.append(msg)
    else:
        table = tolerances or TOL.CURRENT
        for n in case.check:
            tol = TOL.EXACT if case.compare == "exact" else TOL.lookup(case.op, case.tol_keys.get(n, case.tol_key),
                                                                        table)
            g, w, what = got[n], want[n], n
            if n in case.counted:   # 1.4: only the rows below the counts are specified
                rows = counted_rows(want[case.counted[n]], w.shape)
                g, w, what = g[rows], w[rows], f"{n} (rows below {case.counted[n]})"
            msg, me, nm = compare_close(g, w, tol, what)
            max_err, nmse = max(max_err, me), max(nmse, nm)
            if msg:
                problems.append(msg)
    return problems, max_err, nmse
