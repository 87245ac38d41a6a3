"""The conformance cases of the dist family (1.4): they cover what the spec asks for (moe_dispatch with no tokens, one
to four ranks, one or several experts a rank, ids -1, past the last expert and below -1, a token with no
expert anywhere, a full slot and spare rows; moe_combine accumulating or not, routes as moe_dispatch
writes them and scattered ones, rows no token routes to holding NaN, f32 and bf16 on either side; the
collectives on every dtype they move, with and without counts), they fail a library that gets any of it
wrong (a reference with one rule broken, "a mutant", fails at least one case of the quick profile),
while a library that differs only where the spec allows (rows past the counts) passes. The collectives
run on a one-rank communicator of the backend under test; a backend without communicators is not held
to them. And the README's composition of one MoE layer over several ranks equals moe_experts."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer import abi
from deepinfer.backend import Comm
from deepinfer.conformance import cases as C
from deepinfer.conformance import tolerances as TOL
from deepinfer.conformance.harness import ReferenceCache, check_case, release_comm
from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor
from mutant_backends import Lazy

NEW_OPS = ["all_reduce", "all_gather", "all_to_all", "moe_dispatch", "moe_combine"]
COLLECTIVES = ["all_reduce", "all_gather", "all_to_all"]


def quick(op):
    return C.cases_for(op, "quick")


def vals(c, name):
    return np.asarray(c.tensors[name].values)


# ---------------------------------------------------------------------------- coverage


def test_every_1_4_op_has_cases_a_valid_case_and_a_tolerance():
    assert [op for op in abi.OP_NAMES if abi.OP_SPECS[op].since_minor == 4] == NEW_OPS
    for op in NEW_OPS:
        assert quick(op), op
        assert op in TOL.TOLERANCES_V4 and op not in TOL.TOLERANCES_V3
        C.a_valid_case(op)
    # the collectives take the harness's communicator; the two local halves of expert parallelism none
    for op in NEW_OPS:
        assert all(c.comm == (op in COLLECTIVES) for c in quick(op) + [C.a_valid_case(op)]), op


def test_moe_dispatch_cases_cover_what_the_spec_names():
    seen = set()
    for c in quick("moe_dispatch"):
        ids = vals(c, "topk_ids").astype(np.int64)
        T, K = ids.shape
        N, Cap = c.tensors["send_x"].shape[:2]
        E = N * c.scalars["experts_per_rank"]
        seen |= {("T", min(T, 2)), ("N", N), ("K", K), c.tensors["x"].dtype}
        seen.add("Er=1" if c.scalars["experts_per_rank"] == 1 else "Er>1")
        if Cap > T:
            seen.add("spare rows")
        if np.any(ids == -1):
            seen.add("-1")
        if np.any(ids >= E):
            seen.add("past the last expert")
        if np.any(ids < -1):
            seen.add("below -1")
        if T and np.any(np.all((ids < 0) | (ids >= E), axis=1)):
            seen.add("a token with no expert")
        valid = (ids >= 0) & (ids < E)
        owner = np.where(valid, ids // max(1, c.scalars["experts_per_rank"]), -1)
        if T and np.any([np.sum(np.any(owner == p, axis=1)) == Cap for p in range(N)]):
            seen.add("a full slot")
        if T and np.any([len(set(owner[t][owner[t] >= 0])) < int(valid[t].sum()) for t in range(T)]):
            seen.add("two experts of a token on one rank")
    for want in [("T", 0), ("T", 1), ("T", 2), ("N", 1), ("N", 2), ("N", 3), ("N", 4), ("K", 1), ("K", 2), ("K", 4),
                 "f32", "bf16", "Er=1", "Er>1", "spare rows", "-1", "past the last expert", "below -1",
                 "a token with no expert", "a full slot", "two experts of a token on one rank"]:
        assert want in seen, want


def test_moe_combine_cases_cover_what_the_spec_names():
    seen = set()
    for c in quick("moe_combine"):
        route = vals(c, "route").astype(np.int64)
        back = vals(c, "back").astype(np.float32)
        seen |= {("accumulate", c.scalars["accumulate"]), (c.tensors["back"].dtype, c.tensors["out"].dtype),
                 ("T=0",) if route.shape[0] == 0 else ("T>0",), ("N", route.shape[1])}
        if np.any(np.isnan(back)):
            seen.add("unrouted rows hold NaN")
        if route.size and np.any(route == -1):
            seen.add("tokens absent from a slot")
        if any(np.any(np.diff(col[col >= 0]) < 0) for col in route.T):
            seen.add("rows out of token order")
    for want in [("accumulate", 0), ("accumulate", 1), ("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16"),
                 ("bf16", "f32"), ("T=0",), ("T>0",), ("N", 1), ("N", 3), ("N", 4), "unrouted rows hold NaN",
                 "tokens absent from a slot", "rows out of token order"]:
        assert want in seen, want


def test_collective_cases_cover_every_dtype_and_the_counts():
    for op in ("all_gather", "all_to_all"):
        assert {c.tensors["x" if op == "all_gather" else "send"].dtype for c in quick(op)} == set(C.COMM_DTYPES)
    assert {c.tensors["x"].dtype for c in quick("all_reduce")} == {"f32", "bf16"}
    assert any(c.tensors["out"].alias == "x" for c in quick("all_reduce"))
    counts = set()
    for c in quick("all_to_all"):
        if "send_counts" not in c.tensors:
            counts.add("whole slots")
            continue
        n, Cap = int(vals(c, "send_counts")[0]), c.tensors["send"].shape[1]
        counts.add("0" if n == 0 else "C" if n == Cap else "between")
        assert c.counted == {"recv": "recv_counts"} and c.check[0] == "recv_counts"
    assert counts == {"whole slots", "0", "C", "between"}


# ---------------------------------------------------------------------------- the harness's communicator


class Counting(ReferenceBackend):
    """The reference, recording the communicators it makes and the ones its collectives are given."""

    def __init__(self):
        self.made, self.given = [], []

    def comm_create(self, comm_id, nranks, rank):
        c = super().comm_create(comm_id, nranks, rank)
        self.made.append((nranks, rank, c))
        return c

    def _run(self, op, kwargs):
        if "comm" in kwargs:
            self.given.append(kwargs["comm"])
        super()._run(op, kwargs)


def test_collectives_run_on_a_one_rank_communicator_of_the_backend_under_test():
    target, oracle = Counting(), Counting()
    ref = ReferenceCache(oracle)
    try:
        for op in COLLECTIVES:
            for c in quick(op)[:3]:
                o = check_case(target, c, ref)
                assert o.status == "pass", (c.name, o.message)
        # one communicator each, made once, rank 0 of 1, and only ever their own passed to them
        assert [(n, r) for n, r, _ in target.made] == [(1, 0)] and [(n, r) for n, r, _ in oracle.made] == [(1, 0)]
        for be in (target, oracle):
            assert be.given and all(isinstance(g, Comm) and g is be.made[0][2] and g.backend is be for g in be.given)
    finally:
        release_comm(target)
        release_comm(oracle)
    assert target.made[0][2].handle is None   # released: destroyed


class NoComm(ReferenceBackend):
    @property
    def supports_comm(self):
        return False


def test_a_library_without_communicators_is_not_held_to_the_collectives():
    ref = ReferenceCache(ReferenceBackend())
    for op in NEW_OPS:
        outcomes = [check_case(NoComm(), c, ref) for c in quick(op)]
        if op in COLLECTIVES:
            assert all(o.status == "unsupported" and "no communicators" in o.message for o in outcomes), op
        else:   # moe_dispatch and moe_combine take no communicator: they are checked in full
            assert all(o.status == "pass" for o in outcomes), [o.message for o in outcomes if o.status != "pass"]


# ---------------------------------------------------------------------------- mutants fail


class Mutant(ReferenceBackend):
    """The reference with one rule of one op broken: the call's arguments changed before it runs
    (`before`) or its outputs after (`after`)."""

    def __init__(self, op, before=None, after=None):
        self.mop, self.before, self.after = op, before, after

    def _run(self, op, kwargs):
        if op == self.mop and self.before:
            kwargs = self.before(dict(kwargs))
        super()._run(op, kwargs)
        if op == self.mop and self.after:
            self.after(kwargs)


def _np(kw, name):
    return kw[name].numpy()


def _global_ids(kw):
    """send_ids keep the global expert ids instead of rank p's local ones."""
    ids, Er = _np(kw, "send_ids"), int(kw["experts_per_rank"])
    for p in range(ids.shape[0]):
        ids[p][ids[p] >= 0] += p * Er


def _expert_order(kw):
    """Each slot's rows reversed (and route with them): consistent, but not in token order."""
    counts, route = _np(kw, "send_counts"), _np(kw, "route")
    for p, n in enumerate(counts):
        for name in ("send_x", "send_ids", "send_weights"):
            a = _np(kw, name)
            a[p, :n] = a[p, :n][::-1].copy()
        has = route[:, p] >= 0
        route[has, p] = n - 1 - route[has, p]


def _weights_everywhere(kw):
    """send_weights not zeroed where the id is -1 (an expert on another rank)."""
    w, ids = _np(kw, "send_weights"), _np(kw, "send_ids")
    w[(ids == -1)] = 0.5


def _pads_zero(kw):
    """the rows past the count hold id 0 instead of -1 (rank p's expert 0 would run on them)."""
    ids, counts = _np(kw, "send_ids"), _np(kw, "send_counts")
    for p, n in enumerate(counts):
        ids[p, n:] = 0


def _clip_ids(kw):
    """ids past the last expert clipped onto it instead of skipped."""
    N = kw["send_x"].shape[0]
    E = N * int(kw["experts_per_rank"])
    ids = np.array(kw["topk_ids"].numpy())
    ids[ids >= E] = E - 1
    kw["topk_ids"] = Tensor.from_numpy(ids)
    return kw


def _drop_last_rank(kw):
    route = np.array(kw["route"].numpy())
    route[:, -1] = -1
    kw["route"] = Tensor.from_numpy(route)
    return kw


def _counts_off_by_one(kw):
    if kw.get("recv_counts") is not None:
        _np(kw, "recv_counts")[...] += 1


def _short_copy(kw):
    """all_to_all moves one row fewer than the count (the last row of each slot stays as it was)."""
    if kw.get("send_counts") is None:
        return
    n = int(_np(kw, "send_counts")[0])
    if n:
        _np(kw, "recv")[0, n - 1] = 0


MUTANTS = {
    "moe_dispatch keeps global expert ids": ("moe_dispatch", None, _global_ids),
    "moe_dispatch orders a slot's rows backwards": ("moe_dispatch", None, _expert_order),
    "moe_dispatch keeps the weights of other ranks' experts": ("moe_dispatch", None, _weights_everywhere),
    "moe_dispatch pads with id 0": ("moe_dispatch", None, _pads_zero),
    "moe_dispatch clips ids past the last expert": ("moe_dispatch", _clip_ids, None),
    "moe_combine ignores accumulate": ("moe_combine", lambda kw: dict(kw, accumulate=0), None),
    "moe_combine drops the last rank": ("moe_combine", _drop_last_rank, None),
    "all_to_all miscounts": ("all_to_all", None, _counts_off_by_one),
    "all_to_all moves a row too few": ("all_to_all", None, _short_copy),
    "all_reduce doubles": ("all_reduce", None, lambda kw: kw["out"].numpy().__imul__(2)),
    "all_gather zeroes": ("all_gather", None, lambda kw: kw["out"].numpy().__imul__(0)),
}


@pytest.mark.parametrize("what", sorted(MUTANTS))
def test_a_library_breaking_one_rule_fails(what):
    op, before, after = MUTANTS[what]
    ref = ReferenceCache(ReferenceBackend())
    outcomes = [check_case(Mutant(op, before, after), c, ref) for c in quick(op)]
    assert not [o for o in outcomes if o.status == "error"], [o.message for o in outcomes if o.status == "error"]
    assert any(o.status == "fail" for o in outcomes), f"{what}: every case passed"


@pytest.mark.parametrize("op, out", [("all_reduce", "out"), ("all_gather", "out"), ("all_to_all", "recv"),
                                     ("all_to_all", "recv_counts"), ("moe_dispatch", "send_x"),
                                     ("moe_dispatch", "send_ids"), ("moe_dispatch", "send_weights"),
                                     ("moe_dispatch", "send_counts"), ("moe_dispatch", "route"),
                                     ("moe_combine", "out")])
def test_an_element_left_unwritten_fails(op, out):
    ref = ReferenceCache(ReferenceBackend())
    cases = [c for c in quick(op) if out in c.tensors and c.tensors[out].values is None and not c.tensors[out].alias
             and np.prod(c.tensors[out].shape)]
    # the first element is specified only when slot 0 has a row
    if out == "send_x":
        cases = [c for c in cases if ref.results(c)["send_counts"][0] > 0]
    if out == "recv":
        cases = [c for c in cases if "send_counts" not in c.tensors or vals(c, "send_counts")[0] > 0]
    outcomes = [check_case(Lazy(op, out), c, ref) for c in cases]
    assert outcomes and all(o.status == "fail" for o in outcomes), [(o.case, o.status) for o in outcomes]


# ---------------------------------------------------------------------------- what the spec allows passes


class Spare(ReferenceBackend):
    """The reference, writing arbitrary values into the rows past the counts (which the spec leaves
    unspecified): all_to_all moves whole slots, moe_dispatch fills send_x's spare rows."""

    def _run(self, op, kwargs):
        super()._run(op, kwargs)
        if op == "all_to_all" and kwargs.get("send_counts") is not None:
            kwargs["recv"].numpy()[...] = kwargs["send"].numpy()
        if op == "moe_dispatch":
            sx, counts = kwargs["send_x"].numpy(), kwargs["send_counts"].numpy()
            for p, n in enumerate(counts):
                sx[p, n:] = 7


def test_rows_past_the_counts_are_not_compared():
    ref = ReferenceCache(ReferenceBackend())
    for op in ("all_to_all", "moe_dispatch"):
        outcomes = [check_case(Spare(), c, ref) for c in quick(op)]
        assert all(o.status == "pass" for o in outcomes), [o.message for o in outcomes if o.status != "pass"]


# ---------------------------------------------------------------------------- README section 9's MoE layer


def _moe_weights(rng, E, H, I):
    return [[Tensor.from_numpy((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)) for _ in range(E)]
            for s in ((I, H), (I, H), (H, I))]


@pytest.mark.parametrize("N, Er", [(1, 4), (3, 2), (4, 1)])
def test_the_readme_composition_of_one_moe_layer_equals_moe_experts(N, Er):
    """Section 9's expert-parallel MoE layer, the all_to_alls simulated between N ranks in this process
    (each rank its own tokens, T_r of them; C = the largest): moe_dispatch, all_to_all of x with counts
    and of ids and weights whole (rows past the counts hold NaN: unspecified), moe_experts over the
    received rows with the rank's Er experts, all_to_all back with send_counts = the dispatch's
    recv_counts, moe_combine. Each rank's output equals moe_experts over its tokens with all N * Er
    experts in one place."""
    rng = np.random.default_rng(N * 10 + Er)
    ref = ReferenceBackend()
    E, K, H, I = N * Er, min(3, N * Er), 16, 8
    w_gate, w_up, w_down = _moe_weights(rng, E, H, I)
    Ts = [int(t) for t in rng.integers(0, 9, N)]
    Ts[0] = 9
    Cap = max(Ts)
    xs = [rng.standard_normal((T, H)).astype(np.float32) for T in Ts]
    ids = [C._expert_ids(rng, T, K, E) for T in Ts]
    wts = [rng.uniform(0.1, 1.0, (T, K)).astype(np.float32) for T in Ts]

    def t(a):
        return Tensor.from_numpy(np.ascontiguousarray(a))

    # each rank: moe_dispatch of its own tokens
    sent = []
    for r in range(N):
        o = {"send_x": np.full((N, Cap, H), np.nan, np.float32), "send_ids": np.zeros((N, Cap, K), np.int32),
             "send_weights": np.zeros((N, Cap, K), np.float32), "send_counts": np.zeros(N, np.int32),
             "route": np.zeros((Ts[r], N), np.int32)}
        ot = {k: t(v) for k, v in o.items()}
        ref.moe_dispatch(x=t(xs[r]), topk_ids=t(ids[r]), topk_weights=t(wts[r]), experts_per_rank=Er, **ot)
        sent.append({k: v.numpy() for k, v in ot.items()})
    # all_to_all: slot q of rank p arrives in slot p of rank q (x: the first send_counts[p][q] rows only)
    outs = []
    backs = [np.full((N, Cap, H), np.nan, np.float32) for _ in range(N)]
    for q in range(N):
        recv_x = np.full((N, Cap, H), np.nan, np.float32)
        recv_ids = np.stack([sent[p]["send_ids"][q] for p in range(N)])
        recv_w = np.stack([sent[p]["send_weights"][q] for p in range(N)])
        recv_counts = np.array([sent[p]["send_counts"][q] for p in range(N)], np.int32)
        for p in range(N):
            recv_x[p, :recv_counts[p]] = sent[p]["send_x"][q, :recv_counts[p]]
        # the received rows through rank q's own experts (local ids; -1 rows, the pads, give nothing)
        y = np.full((N * Cap, H), np.nan, np.float32)
        ref.moe_experts(x=t(recv_x.reshape(N * Cap, H)), topk_ids=t(recv_ids.reshape(N * Cap, K)),
                        topk_weights=t(recv_w.reshape(N * Cap, K)), w_gate=w_gate[q * Er:(q + 1) * Er],
                        w_up=w_up[q * Er:(q + 1) * Er], w_down=w_down[q * Er:(q + 1) * Er], out=(yt := t(y)),
                        num_experts=Er, accumulate=0)
        y = yt.numpy().reshape(N, Cap, H)
        # all_to_all back with send_counts = recv_counts: slot p of rank q returns to slot q of rank p
        for p in range(N):
            backs[p][q, :recv_counts[p]] = y[p, :recv_counts[p]]
    for r in range(N):
        out = t(np.full((Ts[r], H), np.nan, np.float32))
        ref.moe_combine(back=t(backs[r]), route=t(sent[r]["route"]), out=out, accumulate=0)
        outs.append(out.numpy())
    for r in range(N):
        want = t(np.full((Ts[r], H), np.nan, np.float32))
        ref.moe_experts(x=t(xs[r]), topk_ids=t(ids[r]), topk_weights=t(wts[r]), w_gate=w_gate, w_up=w_up,
                        w_down=w_down, out=want, num_experts=E, accumulate=0)
        np.testing.assert_allclose(outs[r], want.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"rank {r}")
