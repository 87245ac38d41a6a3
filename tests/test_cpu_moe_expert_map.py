"""The CPU library's moe_experts with an expert cache's table (ABI 1.5: expert_map and misses).

An expert cache loads experts into descriptor slots of its own and hands moe_experts the table from
model expert id to slot (expert_map [M] int32). What these tests hold the library to:
  * the table changes where a pair's weights come from, never how the pair is computed: a call
    through a map that puts experts into other slots gives the bits of the call without a map that
    has the same weights per pair (both moe_experts paths: a few tokens and many);
  * a pair whose expert is not resident (entry -1, entry >= num_experts, a slot without data) is
    skipped and flagged in misses, and the output is the one without that pair; an id outside
    [0, M) is skipped and not flagged; every misses element is written;
  * the argument rules (both tensors or neither, shapes, int32 only) are errors with a message,
    and a caller of an older minor, whose struct ends before the two fields, gets 1.4's behaviour;
  * a captured graph reads the table when it is launched.
Every test makes fresh random inputs; the reference backend is the oracle where rounding differs.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import deepinfer
from deepinfer import abi
from deepinfer.errors import BackendCallError
from deepinfer.tensor import Tensor

NP = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
E, K, H, I = 8, 2, 64, 48       # model experts, experts per token, hidden, intermediate


@pytest.fixture(scope="module")
def be(cpu_backend):
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    if b.abi_minor < 5:
        pytest.skip(f"the CPU library is ABI 1.{b.abi_minor}; expert_map is 1.5")
    yield b
    b.close()


@pytest.fixture(scope="module")
def ref():
    return deepinfer.get_backend("reference")


def _weights(rng, n, dt):
    """n experts' (gate, up, down) as lists of tensors."""
    w = lambda r, c: Tensor.from_numpy((rng.standard_normal((r, c)) * 0.3).astype(NP[dt]))
    return [w(I, H) for _ in range(n)], [w(I, H) for _ in range(n)], [w(H, I) for _ in range(n)]


def _slots(experts, table, S):
    """S descriptor slots with expert e's weights in slot table[e] (when in [0, S)); None elsewhere."""
    out = []
    for ws in experts:
        s = [None] * S
        for e, slot in enumerate(table):
            if 0 <= slot < S:
                s[slot] = ws[e]
        out.append(s)
    return out


def _misses_buffer(T, fill=7, pad=(1, 2)):
    """misses [T, K] as a column view of a wider int32 buffer (rows strided), poisoned with `fill`;
    returns (the view, the whole buffer) so a test can see the padding is untouched."""
    wide = np.full((T, K + sum(pad)), -5, np.int32)
    wide[:, pad[0]:pad[0] + K] = fill
    t = Tensor.from_numpy(wide)
    return t.narrow(-1, pad[0], K), t


def _call(backend, x, ids, tw, experts, dt, table=None, misses=None, out0=None, accumulate=0, limit=0.0):
    """moe_experts on `backend`; returns out as f64 (and misses, when given, as int64)."""
    T = x.shape[0]
    if out0 is None:
        out = backend.empty((T, H), dt, fill=np.nan)
    else:
        out = Tensor.from_numpy(out0.astype(NP[dt]))
    g, u, d = experts
    kw = dict(x=Tensor.from_numpy(x.astype(NP[dt])), topk_ids=Tensor.from_numpy(ids.astype(np.int32)),
              topk_weights=Tensor.from_numpy(tw.astype(np.float32)), w_gate=g, w_up=u, w_down=d, out=out,
              num_experts=len(g), accumulate=accumulate, swiglu_limit=limit)
    if table is not None:
        kw["expert_map"] = Tensor.from_numpy(np.asarray(table, np.int32))
    if misses is not None:
        kw["misses"] = misses
    backend.moe_experts(**kw)
    got = backend.to_numpy(out).astype(np.float64)
    return got if misses is None else (got, backend.to_numpy(misses).astype(np.int64))


def _routing(rng, T, n_experts, extra=()):
    """[T, K] distinct expert ids per token, then the (t, k) pairs of `extra` set to given ids."""
    ids = np.stack([rng.permutation(n_experts)[:K] for _ in range(T)]).astype(np.int32)
    for (t, k), v in extra:
        if t < T:
            ids[t, k] = v
    return ids, rng.random((T, K)).astype(np.float32)


def _close(got, want, dt, what):
    rtol = 2e-2 if dt == "bf16" else 1e-4
    rms = float(np.sqrt(np.mean(want * want))) if want.size else 0.0
    assert not np.isnan(got).any(), f"{what}: NaN (an element left unwritten?)"
    bad = np.abs(got - want) > rtol * np.abs(want) + rtol * max(rms, 1e-30)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} elements off"


# ====================================================================== a map that renames experts


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_permuting_map_is_bit_identical(be, ref, dt, T):
    """Experts in other slots (and slots without data that nothing routes to) compute the same bits
    as the unmapped call; ids outside [0, M) are skipped by both and not flagged."""
    rng = np.random.default_rng(100 * T + (dt == "bf16"))
    experts = _weights(rng, E, dt)
    S = E + 4                                   # 4 slots hold nothing (data NULL)
    table = rng.permutation(S)[:E].astype(np.int32)
    slots = _slots(experts, table, S)
    assert sum(s is None for s in slots[0]) == 4
    ids, tw = _routing(rng, T, E, extra=[((0, 1), -1), ((3, 0), E + 3), ((T - 1, 0), -100)])
    x = rng.standard_normal((T, H)) * 2
    misses, _ = _misses_buffer(T)
    got, miss = _call(be, x, ids, tw, slots, dt, table=table, misses=misses)
    plain = _call(be, x, ids, tw, experts, dt)
    assert np.array_equal(got, plain), f"max |diff| {np.abs(got - plain).max():.3g}"
    assert not miss.any()
    want, want_miss = _call(ref, x, ids, tw, slots, dt, table=table, misses=_misses_buffer(T)[0])
    assert np.array_equal(miss, want_miss)
    _close(got, want, dt, "mapped moe_experts vs the reference")


def test_identity_map_is_the_unmapped_call(be):
    """A map onto the same numbering, with the clipped SwiGLU (1.3) on too."""
    rng = np.random.default_rng(7)
    T = 9
    experts = _weights(rng, E, "f32")
    ids, tw = _routing(rng, T, E)
    x = rng.standard_normal((T, H)) * 3
    got, miss = _call(be, x, ids, tw, experts, "f32", table=np.arange(E), misses=_misses_buffer(T)[0], limit=1.5)
    assert np.array_equal(got, _call(be, x, ids, tw, experts, "f32", limit=1.5)) and not miss.any()


# ====================================================================== misses


def _missing_setup(rng, T, dt):
    """A table with every kind of miss: entry -1, entry >= num_experts, a slot without data; the
    other experts resident in shuffled slots. Returns (experts, slots, table, M)."""
    experts = _weights(rng, E, dt)
    S = E + 2
    table = rng.permutation(S)[:E].astype(np.int32)
    slots = _slots(experts, table, S)
    table[1] = -1                  # not resident: no slot
    table[4] = S + 5               # an entry past the slots
    table[6] = -7
    empty = [s for s in range(S) if s not in set(table.tolist())]
    table[2] = empty[0]            # a slot whose descriptor has no data
    for lst in slots:
        lst[empty[0]] = None
    return experts, slots, table


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_misses_flag_exactly_the_missing_pairs(be, ref, dt, T):
    rng = np.random.default_rng(1000 + 10 * T + (dt == "bf16"))
    experts, slots, table = _missing_setup(rng, T, dt)
    # every token but the last routes to a missing expert at least once; ids outside [0, M) too
    ids, tw = _routing(rng, T, E, extra=[((0, 0), 1), ((0, 1), 2), ((1, 1), 4), ((2, 0), 6), ((3, 1), -1),
                                         ((4, 0), E)])
    x = rng.standard_normal((T, H)) * 2
    misses, buf = _misses_buffer(T)
    got, miss = _call(be, x, ids, tw, slots, dt, table=table, misses=misses)

    inside = (ids >= 0) & (ids < E)
    lost = inside & np.isin(ids, [1, 2, 4, 6])
    assert np.array_equal(miss, lost.astype(np.int64)), f"misses {miss.tolist()}, expected {lost.astype(int).tolist()}"
    assert lost.any()
    wide = be.to_numpy(buf)
    assert (wide[:, 0] == -5).all() and (wide[:, K + 1:] == -5).all(), "misses wrote outside its view"

    # the missed pairs contribute nothing: the unmapped call without them, bit for bit
    skipped = np.where(lost, -1, ids)
    assert np.array_equal(got, _call(be, x, skipped, tw, experts, dt))
    # and the reference agrees on both
    want, want_miss = _call(ref, x, ids, tw, slots, dt, table=table, misses=_misses_buffer(T)[0])
    assert np.array_equal(miss, want_miss)
    _close(got, want, dt, "moe_experts with misses vs the reference")


def test_misses_overwrites_every_element(be):
    """misses is poisoned with 7 (and then with 1): every element comes back 0 or the miss flag."""
    rng = np.random.default_rng(11)
    T = 6
    experts, slots, table = _missing_setup(rng, T, "f32")
    ids, tw = _routing(rng, T, E, extra=[((0, 0), 1), ((2, 1), -3), ((5, 0), E + 1)])
    x = rng.standard_normal((T, H))
    lost = np.isin(ids, [1, 2, 4, 6]) & (ids >= 0)
    for fill in (7, 1):
        got, miss = _call(be, x, ids, tw, slots, "f32", table=table, misses=_misses_buffer(T, fill=fill)[0])
        assert np.array_equal(miss, lost.astype(np.int64)), f"poison {fill}: {miss.tolist()}"
    # nothing resident at all: every in-range pair is a miss and out is zero (not left as it was)
    none = _slots(experts, np.full(E, -1), E)
    got, miss = _call(be, x, ids, tw, none, "f32", table=np.full(E, -1), misses=_misses_buffer(T)[0])
    assert np.array_equal(miss, ((ids >= 0) & (ids < E)).astype(np.int64))
    assert np.array_equal(got, np.zeros((T, H)))


def test_a_miss_is_not_failed_precondition(be):
    """Without a map a routed expert that is not resident is FAILED_PRECONDITION; through a map the
    same call reports the pair in misses instead."""
    rng = np.random.default_rng(12)
    T = 3
    experts = _weights(rng, E, "f32")
    holes = _slots(experts, [e if e != 3 else -1 for e in range(E)], E)   # expert 3 not resident
    ids, tw = _routing(rng, T, E, extra=[((1, 0), 3)])
    x = rng.standard_normal((T, H))
    with pytest.raises(BackendCallError) as e:
        _call(be, x, ids, tw, holes, "f32")
    assert e.value.status_name == "FAILED_PRECONDITION" and "expert 3" in e.value.message
    got, miss = _call(be, x, ids, tw, holes, "f32", table=np.arange(E), misses=_misses_buffer(T)[0])
    assert np.array_equal(miss, (ids == 3).astype(np.int64))
    assert np.array_equal(got, _call(be, x, np.where(ids == 3, -1, ids), tw, experts, "f32"))


# ====================================================================== accumulate


@pytest.mark.parametrize("T", [2, 33])
def test_accumulate_with_a_map(be, ref, T):
    rng = np.random.default_rng(50 + T)
    experts, slots, table = _missing_setup(rng, T, "f32")
    ids, tw = _routing(rng, T, E, extra=[((0, 1), 1), ((1, 0), 2)])
    x = rng.standard_normal((T, H))
    out0 = rng.standard_normal((T, H)).astype(np.float32)
    got, miss = _call(be, x, ids, tw, slots, "f32", table=table, misses=_misses_buffer(T)[0], out0=out0,
                      accumulate=1)
    lost = np.isin(ids, [1, 2, 4, 6])
    assert np.array_equal(miss, lost.astype(np.int64))
    assert np.array_equal(got, _call(be, x, np.where(lost, -1, ids), tw, experts, "f32", out0=out0, accumulate=1))
    want, _ = _call(ref, x, ids, tw, slots, "f32", table=table, misses=_misses_buffer(T)[0], out0=out0,
                    accumulate=1)
    _close(got, want, "f32", "accumulate with a map vs the reference")
    fresh, _ = _call(be, x, ids, tw, slots, "f32", table=table, misses=_misses_buffer(T)[0])
    assert np.abs(got - fresh - out0).max() < 1e-5 * max(1.0, np.abs(got).max())


# ====================================================================== argument checks


def _error_call(be, T=4, **over):
    rng = np.random.default_rng(99)
    experts = _weights(rng, E, "f32")
    ids, tw = _routing(rng, T, E)
    kw = dict(x=Tensor.from_numpy(rng.standard_normal((T, H)).astype(np.float32)),
              topk_ids=Tensor.from_numpy(ids), topk_weights=Tensor.from_numpy(tw), w_gate=experts[0],
              w_up=experts[1], w_down=experts[2], out=be.empty((T, H), "f32", fill=np.nan), num_experts=E,
              accumulate=0, expert_map=Tensor.from_numpy(np.arange(E, dtype=np.int32)),
              misses=Tensor.from_numpy(np.full((T, K), 7, np.int32)))
    kw.update(over)
    kw = {k: v for k, v in kw.items() if v is not None}
    with pytest.raises(BackendCallError) as e:
        be.moe_experts(**kw)
    return e.value, kw


@pytest.mark.parametrize("case,match", [
    (dict(misses=None), "expert_map needs misses"),
    (dict(expert_map=None), "misses is written only with expert_map"),
    (dict(misses=Tensor.from_numpy(np.zeros((4, K + 1), np.int32))), "misses.shape[1]"),
    (dict(misses=Tensor.from_numpy(np.zeros((3, K), np.int32))), "misses.shape[0]"),
    (dict(misses=Tensor.from_numpy(np.zeros(4 * K, np.int32))), "misses.ndim"),
    (dict(misses=Tensor.from_numpy(np.zeros((4, K), np.int64))), "misses.dtype"),
    (dict(expert_map=Tensor.from_numpy(np.arange(E, dtype=np.int64))), "expert_map.dtype"),
    (dict(expert_map=Tensor.from_numpy(np.arange(E, dtype=np.float32))), "expert_map.dtype"),
    (dict(expert_map=Tensor.from_numpy(np.arange(E, dtype=np.int32).reshape(2, E // 2))), "expert_map.ndim"),
])
def test_argument_errors(be, ref, case, match):
    err, kw = _error_call(be, **case)
    assert err.status_name == "INVALID_ARGUMENT", str(err)
    assert match in err.message, err.message
    if "misses" in kw and "misses" not in case:   # refused before any work: misses as the caller left it
        assert (be.to_numpy(kw["misses"]) == 7).all()
    # the reference refuses the same calls
    rkw = {k: v for k, v in kw.items()}
    rkw["out"] = ref.empty((4, H), "f32", fill=np.nan)
    with pytest.raises((ValueError, TypeError)):
        ref.moe_experts(**rkw)


def test_op_query_checks_the_pair(be):
    """op_query (every data pointer may be NULL) applies the same rules."""
    rng = np.random.default_rng(5)
    T = 4
    experts = _weights(rng, E, "f32")
    ids, tw = _routing(rng, T, E)
    kw = dict(x=Tensor.from_numpy(rng.standard_normal((T, H)).astype(np.float32)), topk_ids=Tensor.from_numpy(ids),
              topk_weights=Tensor.from_numpy(tw), w_gate=experts[0], w_up=experts[1], w_down=experts[2],
              out=be.empty((T, H), "f32"), num_experts=E, accumulate=0,
              expert_map=Tensor.from_numpy(np.arange(E, dtype=np.int32)), misses=be.empty((T, K), "int32"))
    assert be.query("moe_experts", **kw)[0] == abi.SUPPORT_YES
    with pytest.raises(BackendCallError, match="expert_map needs misses"):
        be.query("moe_experts", **{k: v for k, v in kw.items() if k != "misses"})
    with pytest.raises(BackendCallError, match=r"misses.shape\[1\]"):
        be.query("moe_experts", **{**kw, "misses": be.empty((T, K + 1), "int32")})


# ====================================================================== older callers, graphs


def test_an_older_callers_struct_has_no_map(be):
    """A 1.4 caller's struct ends before expert_map: the bytes after it (here a valid map and misses,
    as a 1.5 caller would set them) are not read or written, and a non-resident routed expert is
    FAILED_PRECONDITION as in 1.4."""
    rng = np.random.default_rng(14)
    T = 5
    experts = _weights(rng, E, "f32")
    holes = _slots(experts, [e if e != 5 else -1 for e in range(E)], E)
    ids, tw = _routing(rng, T, E, extra=[((2, 1), 5)])
    x = rng.standard_normal((T, H)).astype(np.float32)
    size14 = abi.args_struct_size("moe_experts", 4)
    assert size14 == abi.ffi.offsetof("DI_MoEExpertsArgs", "expert_map") == abi.args_struct_size("moe_experts", 3)

    def raw(weights, table):
        out = be.empty((T, H), "f32", fill=np.nan)
        misses = Tensor.from_numpy(np.full((T, K), 7, np.int32))
        args, keep = be._marshal("moe_experts", dict(
            x=Tensor.from_numpy(x), topk_ids=Tensor.from_numpy(ids), topk_weights=Tensor.from_numpy(tw),
            w_gate=weights[0], w_up=weights[1], w_down=weights[2], out=out, num_experts=E, accumulate=0,
            expert_map=Tensor.from_numpy(np.asarray(table, np.int32)), misses=misses))
        assert args.expert_map.data != abi.ffi.NULL and args.misses.data != abi.ffi.NULL
        args.header.struct_size = size14
        st = be._api.moe_experts(be._ctx, args)
        return st, be.to_numpy(out).astype(np.float64), be.to_numpy(misses)

    st, _, miss = raw(holes, np.arange(E))
    assert st == abi.FAILED_PRECONDITION
    assert (miss == 7).all(), "misses written for a caller that does not know it"
    # all resident, through a map that would send every pair elsewhere: the map is not read
    st, got, miss = raw(experts, np.full(E, -1))
    assert st == abi.OK and (miss == 7).all()
    assert np.array_equal(got, _call(be, x, ids, tw, experts, "f32"))


def test_graph_replay_reads_the_map_at_launch(cpu_backend):
    """A captured moe_experts reads expert_map (and writes misses) when launched: the cache changes
    the table in place between steps."""
    b = deepinfer.loader.load_library(cpu_backend.info.path, num_threads=2)
    s = b.create_stream()
    b.set_stream(s)
    try:
        rng = np.random.default_rng(21)
        T, S = 4, E + 1
        experts = _weights(rng, E, "f32")
        table = rng.permutation(S)[:E].astype(np.int32)
        slots = _slots(experts, table, S)
        ids, tw = _routing(rng, T, E)
        x = rng.standard_normal((T, H)).astype(np.float32)
        tmap = Tensor.from_numpy(table.copy())
        misses = Tensor.from_numpy(np.full((T, K), 7, np.int32))
        out = b.empty((T, H), "f32", fill=np.nan)
        call = b.prepare("moe_experts", x=Tensor.from_numpy(x), topk_ids=Tensor.from_numpy(ids),
                         topk_weights=Tensor.from_numpy(tw), w_gate=slots[0], w_up=slots[1], w_down=slots[2],
                         out=out, num_experts=S, accumulate=0, expert_map=tmap, misses=misses)
        g = b.capture([call])
        g.launch()
        b.synchronize()
        assert np.array_equal(b.to_numpy(out), _call(b, x, ids, tw, experts, "f32").astype(np.float32))
        assert not b.to_numpy(misses).any()
        # expert ids[0, 0] leaves the cache: the next launch reports it and skips that pair
        gone = int(ids[0, 0])
        b.write(tmap, np.where(np.arange(E) == gone, -1, table).astype(np.int32))
        g.launch()
        b.synchronize()
        assert np.array_equal(b.to_numpy(misses), (ids == gone).astype(np.int32))
        want = _call(b, x, np.where(ids == gone, -1, ids), tw, experts, "f32").astype(np.float32)
        assert np.array_equal(b.to_numpy(out), want)
        g.close()
    finally:
        b.set_stream(None)
        s.close()
        b.close()


@pytest.mark.parametrize("T", [3, 33])
def test_map_is_ids_replaced_by_descriptors(be, T):
    """abi/README.md section 8's statement: a call with the map gives the bits of the same call with
    each topk_ids[t, k] replaced by the descriptor the map names (-1 where the pair is skipped), with
    more model experts than descriptors and several entries naming one descriptor."""
    rng = np.random.default_rng(300 + T)
    S, M = 6, 14
    slots = [list(w) for w in _weights(rng, S, "f32")]
    for lst in slots:
        lst[4] = None                                       # descriptor 4 not resident
    table = rng.integers(0, S, M).astype(np.int32)          # aliasing: entries repeat
    table[[0, 5, 9]] = [-1, S, 4]                           # not resident three ways
    ids = np.stack([rng.permutation(M)[:K] for _ in range(T)]).astype(np.int32)
    ids[0, 0], ids[1, 1], ids[2, 0] = 0, 9, M               # a miss of each kind; M is skipped unflagged
    tw = rng.random((T, K)).astype(np.float32)
    x = rng.standard_normal((T, H))
    got, miss = _call(be, x, ids, tw, slots, "f32", table=table, misses=_misses_buffer(T)[0])
    inside = (ids >= 0) & (ids < M)
    d = np.where(inside, table[np.where(inside, ids, 0)], -1)
    ok = (d >= 0) & (d < S) & (d != 4)
    assert np.array_equal(miss, (inside & ~ok).astype(np.int64)) and miss[0, 0] == 1 and miss[2, 0] == 0
    assert np.array_equal(got, _call(be, x, np.where(ok, d, -1), tw, slots, "f32"))
