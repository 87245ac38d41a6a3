"""The conformance cases of the sparse family (1.3: kv_compress, indexer_topk, sparse_attention): they
cover what the spec asks for (ratios 1, 4 and 128, blocks smaller and larger than the ratio, overlap 0
and 1, window 0 and more, indices with -1 and out-of-range entries, sinks or none), and they fail a
library that gets any of it wrong: a reference with one rule broken ("a mutant") must fail at least
one case of the quick profile, while a library that differs only where the spec allows (indexer_topk's
order, a swap of tied scores) passes."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, _cmp_indexer, check_case
from deepinfer.reference import ReferenceBackend
from mutant_backends import assert_mutant_fails, assert_unwritten_element_fails, Mutant, _drop, _map, _set, quick


# ---------------------------------------------------------------------------- coverage


def test_kv_compress_cases_cover_ratios_blocks_overlap_and_window_zero():
    seen = set()
    for c in quick("kv_compress"):
        r, ov, BS = c.scalars["ratio"], c.scalars["overlap"], c.tensors["staged"].shape[1]
        pos = np.asarray(c.tensors["positions"].values)
        seen.add((r, ov, "BS<r" if BS < r else "BS>r" if BS > r else "BS=r"))
        if ov and np.any(pos == r - 1):
            seen.add((r, "window 0 closes"))
        if np.any((pos + 1) % r != 0):
            seen.add((r, ov, "rows that close nothing"))
        table = np.asarray(c.tensors["block_table"].values)
        if table.shape[0] > 1 and np.any(table < 0):
            seen.add("several sequences, scattered table with unused columns")
    for want in [(4, 1, "BS<r"), (4, 1, "BS>r"), (4, 0, "BS<r"), (4, 0, "BS>r"), (128, 0, "BS<r"), (128, 0, "BS>r"),
                 (1, 0, "BS>r"), (1, 1, "BS>r"), (4, "window 0 closes"), (1, "window 0 closes"),
                 (4, 1, "rows that close nothing"), "several sequences, scattered table with unused columns"]:
        assert want in seen, want


def test_sparse_attention_cases_cover_every_combination_the_spec_names():
    seen = set()
    for c in quick("sparse_attention"):
        t, s = c.tensors, c.scalars
        comp = "comp_cache" in t
        BS = t["kv_cache"].shape[1]
        seen.add(("comp" if comp else "window only", "indices" if "indices" in t else "all",
                  "sinks" if "sinks" in t else "no sinks", "window>0" if s["window"] else "window 0"))
        if comp:
            seen.add((s["ratio"], "BS<r" if BS < s["ratio"] else "BS>r" if BS > s["ratio"] else "BS=r"))
        if "indices" in t:
            idx, vis = np.asarray(t["indices"].values), np.asarray(t["kv_len"].values) // s["ratio"]
            if np.any(idx == -1) and np.any(idx >= vis[:, None]):
                seen.add("indices with -1 and invisible entries")
        if t["block_table"].shape[0] > 1 and np.any(np.asarray(t["block_table"].values) < 0):
            seen.add("scattered tables with released or unused blocks")
        if np.any(np.asarray(t["kv_len"].values) == 0):
            seen.add("an empty row")
    for want in [("window only", "all", "no sinks", "window 0"), ("window only", "all", "sinks", "window>0"),
                 ("comp", "all", "sinks", "window>0"), ("comp", "indices", "sinks", "window>0"),
                 ("comp", "indices", "no sinks", "window 0"), ("comp", "all", "no sinks", "window>0"),
                 (128, "BS<r"), (128, "BS>r"), (4, "BS<r"), (4, "BS>r"), (1, "BS>r"),
                 "indices with -1 and invisible entries", "scattered tables with released or unused blocks",
                 "an empty row"]:
        assert want in seen, want


# ---------------------------------------------------------------------------- mutants fail


def _swap_series(kw):
    """overlap 1 with the two series (Ca: first halves, Cb: second halves) exchanged."""
    if not kw["overlap"]:
        return kw

    def swap(s):
        W = s.shape[-1] // 2
        D = W // 2
        return np.concatenate([s[..., D:W], s[..., :D], s[..., W + D:], s[..., W:W + D]], axis=-1)
    return _map("staged", swap)(kw)


MUTANTS = {
    "kv_compress ignores position_bias": ("kv_compress", _map("position_bias", np.zeros_like)),
    "kv_compress swaps the two series of overlap 1": ("kv_compress", _swap_series),
    "indexer_topk without relu": ("indexer_topk", _map("weights", lambda w: -w)),
    "indexer_topk with a wrong ratio": ("indexer_topk", lambda kw: _set(ratio=kw["ratio"] * 2,
                                                                      block_size=kw["block_size"] * 2)(kw)),
    "sparse_attention ignores sinks": ("sparse_attention", _drop("sinks")),
    "sparse_attention ignores the window": ("sparse_attention", _set(window=0)),
    "sparse_attention ignores indices": ("sparse_attention", _drop("indices")),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, change = MUTANTS[what]
    assert_mutant_fails(what, op, Mutant(op, change))


@pytest.mark.parametrize("op", ["kv_compress", "indexer_topk", "sparse_attention"])
def test_an_element_left_unwritten_fails(op):
    assert_unwritten_element_fails(op)


# ---------------------------------------------------------------------------- what the spec allows passes


class Shuffled(ReferenceBackend):
    """indexer_topk with each row's selected entries in ascending id order (not descending score)."""

    def _run(self, op, kwargs):
        super()._run(op, kwargs)
        if op == "indexer_topk":
            a = kwargs["out"].numpy()
            for row in a:
                k = int(np.count_nonzero(row >= 0))
                row[:k] = np.sort(row[:k])


def test_indexer_topk_is_compared_as_sets():
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(Shuffled(), c, ref) for c in quick("indexer_topk")]
    assert all(o.status == "pass" for o in outcomes), [o.message for o in outcomes if o.status != "pass"]


def _indexer_case():
    return C.indexer_topk(5, 4, [40], 2, 8, 3, 4, 8, "f32")


def test_indexer_compare_allows_swaps_only_between_ties():
    from deepinfer.conformance.harness import _indexer_scores

    case = _indexer_case()
    want = np.full((4, 3), -1, np.int64)
    rows = []
    for t in range(4):
        score, _ = _indexer_scores(case, t)
        order = np.argsort(-score, kind="stable")
        want[t, :min(3, len(order))] = order[:3]
        rows.append((score, order))
    assert _cmp_indexer(case, want.copy(), want) is None
    t = next(t for t in range(4) if len(rows[t][1]) > 3)
    score, order = rows[t]
    got = want.copy()
    got[t, 2] = order[3]                        # the 4th best instead of the 3rd: not a tie
    assert "not a tie" in _cmp_indexer(case, got, want)
    # make the two scores tie exactly (equal keys): the swap is then allowed
    keys = case.tensors["keys"].values
    table = case.tensors["block_table"].values
    ratio, BS = case.scalars["ratio"], case.scalars["block_size"]

    def slot(e):   # where entry e's key lives (README: the block of its window's last token)
        pe = (e + 1) * ratio - 1
        return table[0, pe // BS], (pe % BS) // ratio
    keys[slot(order[3])] = keys[slot(order[2])]
    assert _cmp_indexer(case, got, want) is None
    # structural errors fail whatever the scores
    bad = want.copy()
    bad[t, 1] = bad[t, 0]
    assert "twice" in _cmp_indexer(case, bad, want)
    bad = want.copy()
    bad[t, 0] = 0x7F7F7F7F
    assert "outside" in _cmp_indexer(case, bad, want)
    short = next(t for t in range(4) if np.any(want[t] == -1))
    bad = want.copy()
    bad[short, -1] = 0
    assert "must be -1" in _cmp_indexer(case, bad, want)
