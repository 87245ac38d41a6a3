"""DeepSeek mixture of experts: moe_router and moe_experts (abi/README.md section 8)."""
from __future__ import annotations

import numpy as np

from deepinfer import abi

from .common import (check_arg, check_dim, check_shape, f32, failed_precondition, i32, read, read_index, unsupported,
                     write)
from .elementwise import clipped_swiglu
from .elementwise import swiglu_limit as _swiglu_limit   # the parameter of moe_experts has this name
from .linear import weight_values

SCORING_SOFTMAX = abi.const("DI_SCORING_SOFTMAX")
SCORING_SIGMOID = abi.const("DI_SCORING_SIGMOID")
SCORING_SQRTSOFTPLUS = abi.const("DI_SCORING_SQRTSOFTPLUS")
GROUP_SCORE_MAX = abi.const("DI_GROUP_SCORE_MAX")
GROUP_SCORE_SUM_TOP2 = abi.const("DI_GROUP_SCORE_SUM_TOP2")


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, largest first, ties to the lower index."""
    order = np.argsort(-values, axis=-1, kind="stable")   # stable: equal values keep index order
    return order[..., :k]


def router_scores(x: np.ndarray, scoring: int) -> np.ndarray:
    """The per-expert scores of a row of router logits (float64)."""
    if scoring == SCORING_SOFTMAX:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if scoring == SCORING_SIGMOID:
        return 1.0 / (1.0 + np.exp(-x))
    # sqrt(softplus(v)), softplus(v) = log(1 + exp(v)); v itself above 20 as torch does (threshold 20),
    # where the two differ by log1p(exp(-20)) ~ 2e-9, far below f32 resolution there
    with np.errstate(over="ignore"):
        sp = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return np.sqrt(sp)


def moe_router(logits=None, bias=None, topk_ids=None, topk_weights=None, scoring=None, n_group=None,
               topk_group=None, group_score=None, norm_topk_prob=None, routed_scaling_factor=None,
               token_ids=None, hash_table=None) -> None:
    """topk_ids = the K experts of largest score (+ bias), group-limited; or (1.3, hash routing)
    hash_table[token_ids[t]]. topk_weights = their unbiased scores, normalised and scaled."""
    op = "moe_router"
    check_arg(op, "logits", logits)
    check_arg(op, "topk_ids", topk_ids)
    check_arg(op, "topk_weights", topk_weights)
    T, E = logits.shape
    K = topk_ids.shape[1]
    check_dim(op, "topk_ids.shape[0]", topk_ids.shape[0], T, "logits.shape[0]")
    check_shape(op, "topk_weights", topk_weights, (T, K))
    if bias is not None:
        check_arg(op, "bias", bias)
        check_dim(op, "bias.shape[0]", bias.shape[0], E, "logits.shape[1]")
    hashed = token_ids is not None or hash_table is not None
    if hashed:
        if token_ids is None or hash_table is None:
            have, lack = ("token_ids", "hash_table") if token_ids is not None else ("hash_table", "token_ids")
            raise ValueError(f"{op}: hash routing needs token_ids and hash_table together ({have} without {lack})")
        check_arg(op, "token_ids", token_ids)
        check_arg(op, "hash_table", hash_table)
        check_dim(op, "token_ids.shape[0]", token_ids.shape[0], T, "logits.shape[0]")
        check_dim(op, "hash_table.shape[1]", hash_table.shape[1], K, "topk_ids.shape[1]")
    scoring, group_score = i32(scoring, op, "scoring"), i32(group_score, op, "group_score")
    n_group, topk_group = i32(n_group, op, "n_group"), i32(topk_group, op, "topk_group")
    norm = i32(norm_topk_prob, op, "norm_topk_prob") != 0
    route_scale = f32(routed_scaling_factor, op, "routed_scaling_factor")
    if scoring not in (SCORING_SOFTMAX, SCORING_SIGMOID, SCORING_SQRTSOFTPLUS):
        raise unsupported(op, f"scoring={scoring} (known: {SCORING_SOFTMAX} softmax, {SCORING_SIGMOID} sigmoid, "
                              f"{SCORING_SQRTSOFTPLUS} sqrtsoftplus)")
    if n_group < 0:
        raise ValueError(f"{op}: n_group={n_group} is negative")
    grouped = n_group > 1   # 0 (a zero-filled struct) and 1 both mean no grouping
    if grouped:
        if group_score not in (GROUP_SCORE_MAX, GROUP_SCORE_SUM_TOP2):
            raise unsupported(op, f"group_score={group_score} (known: {GROUP_SCORE_MAX} max, "
                                  f"{GROUP_SCORE_SUM_TOP2} sum of top 2)")
        if E % n_group:
            raise ValueError(f"{op}: logits.shape[1]={E} experts do not split into n_group={n_group} groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"{op}: topk_group={topk_group} outside [1, n_group={n_group}]")
        if group_score == GROUP_SCORE_SUM_TOP2 and E // n_group < 2:
            raise ValueError(f"{op}: SUM_TOP2 needs at least 2 experts per group, got {E // n_group}")
    if hashed:
        # the table chooses; the ids are the host's to check (README: INVALID_ARGUMENT on host libraries)
        tok, table = read_index(token_ids), read_index(hash_table)
        V = table.shape[0]
        bad = (tok < 0) | (tok >= V)
        if bad.any():
            t = int(np.argmax(bad))
            raise ValueError(f"{op}: token_ids[{t}]={tok[t]} outside [0, hash_table.shape[0]={V})")
        ids = table[tok]                                        # [T, K], in table order
        bad = (ids < 0) | (ids >= E)
        if bad.any():
            t, k = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{op}: hash_table[{tok[t]}, {k}]={ids[t, k]} (token_ids[{t}]) is not an expert in "
                             f"[0, {E})")
    else:
        eligible = topk_group * (E // n_group) if grouped else E
        if K > eligible:
            raise ValueError(f"{op}: topk_ids.shape[1]={K} > {eligible} experts eligible for selection")

    scores = router_scores(read(logits), scoring)
    if not hashed:
        sel = scores + read(bias)[None, :] if bias is not None else scores.copy()
        if grouped:
            groups = sel.reshape(T, n_group, E // n_group)
            if group_score == GROUP_SCORE_MAX:
                gscore = groups.max(axis=-1)
            else:
                gscore = np.sort(groups, axis=-1)[..., -2:].sum(axis=-1)
            keep = top_indices(gscore, topk_group)                  # ties: the lower group wins
            dropped = np.ones((T, n_group), bool)
            np.put_along_axis(dropped, keep, False, axis=-1)
            # DeepSeek's model.py masks with -inf (HF's remote code used 0.0; see the README)
            sel = np.where(np.repeat(dropped, E // n_group, axis=-1), -np.inf, sel)
        ids = top_indices(sel, K)
    weights = np.take_along_axis(scores, ids, axis=-1)
    if norm:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    weights = weights * route_scale
    write(topk_ids, ids)
    write(topk_weights, weights)


def resident(w) -> bool:
    """None, or a descriptor without memory (data NULL), marks an expert that is not loaded."""
    return w is not None and getattr(w, "buffer", None) is not None


def moe_experts(x=None, topk_ids=None, topk_weights=None, num_experts=None, accumulate=None,
                w_gate=None, w_up=None, w_down=None, out=None, swiglu_limit=None, expert_map=None,
                misses=None) -> None:
    """out[t] (+)= sum_k w[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]) for e = topk_ids[t, k] in [0, E)
    (1.3: gate and up clipped first when swiglu_limit > 0). 1.5: with expert_map [M], pair (t, k) uses
    descriptor expert_map[topk_ids[t, k]] (ids in [0, M)); a pair whose entry is < 0, >= E or names a
    non-resident descriptor is skipped and flagged in misses [T, K] (required with the map)."""
    op = "moe_experts"
    check_arg(op, "x", x)
    check_arg(op, "topk_ids", topk_ids)
    check_arg(op, "topk_weights", topk_weights)
    check_arg(op, "out", out)
    check_arg(op, "expert_map", expert_map)
    check_arg(op, "misses", misses)
    T, H = x.shape
    K = topk_ids.shape[1]
    check_dim(op, "topk_ids.shape[0]", topk_ids.shape[0], T, "x.shape[0]")
    check_shape(op, "topk_weights", topk_weights, (T, K))
    check_shape(op, "out", out, (T, H))
    if expert_map is not None and misses is None:
        raise ValueError(f"{op}: expert_map needs misses [T, K] int32: a pair whose expert is not resident is "
                         f"skipped, and misses is how the caller learns its output is incomplete")
    if misses is not None:
        if expert_map is None:
            raise ValueError(f"{op}: misses is written only with expert_map; pass both or neither")
        check_shape(op, "misses", misses, (T, K))
    accumulate = i32(accumulate, op, "accumulate") != 0
    limit = _swiglu_limit(op, "swiglu_limit", swiglu_limit)
    for name, lst in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if lst is None or isinstance(lst, (str, bytes)) or not hasattr(lst, "__len__"):
            raise TypeError(f"{op}: {name} must be a list of Tensors (None = not resident)")
    E = len(w_gate)
    if num_experts is not None:
        E = i32(num_experts, op, "num_experts")
    for name, lst in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_dim(op, f"len({name})", len(lst), E, "num_experts")

    ids = read_index(topk_ids)
    if expert_map is not None:
        # the cache's table: model expert id -> descriptor; a pair without a resident descriptor is
        # skipped and reported, not an error (the caller runs the step again once it is loaded)
        table = read_index(expert_map)
        M = len(table)
        inside = (ids >= 0) & (ids < M)
        ids = np.where(inside, table[np.where(inside, ids, 0)], -1)
        here = np.array([all(resident(w[e]) for w in (w_gate, w_up, w_down)) for e in range(E)], bool)
        ok = (ids >= 0) & (ids < E)
        ok[ok] = here[ids[ok]]
        write(misses, (inside & ~ok).astype(np.int32))
        ids = np.where(ok, ids, -1)
    routed = sorted({int(e) for e in ids.ravel() if 0 <= e < E})
    for e in routed:
        if not all(resident(w[e]) for w in (w_gate, w_up, w_down)):
            raise failed_precondition(op, f"expert {e} not resident")
        for name, w in (("w_gate", w_gate[e]), ("w_up", w_up[e]), ("w_down", w_down[e])):
            check_arg(op, name, w, f"{name}[{e}]")
        I = w_gate[e].shape[0]
        check_shape(op, f"w_gate[{e}]", w_gate[e], (I, H))
        check_shape(op, f"w_up[{e}]", w_up[e], (I, H))
        check_shape(op, f"w_down[{e}]", w_down[e], (H, I))

    xv, wts = read(x), read(topk_weights)
    pair = np.zeros((T, K, H))                     # each (token, k) pair's weighted expert output
    for e in routed:
        gate = weight_values(op, f"w_gate[{e}]", w_gate[e])
        up = weight_values(op, f"w_up[{e}]", w_up[e])
        down = weight_values(op, f"w_down[{e}]", w_down[e])
        tok, slot = np.nonzero(ids == e)           # every (token, k) routed to expert e
        h = clipped_swiglu(xv[tok] @ gate.T, xv[tok] @ up.T, limit)
        pair[tok, slot] = wts[tok, slot][:, None] * (h @ down.T)
    # summed in k order: the result never depends on how the experts are numbered (section 8)
    y = np.zeros((T, H))
    for k in range(K):
        y += pair[:, k]
    write(out, read(out) + y if accumulate else y)
