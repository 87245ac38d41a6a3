"""moe_router against torch re-implementations of the DeepSeek gates; moe_experts against a torch loop."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import abi
from deepinfer.errors import BackendCallError
from deepinfer.reference import ReferenceBackend, quantize_array
from deepinfer.tensor import Tensor

ref = ReferenceBackend()
SOFTMAX, SIGMOID = abi.const("DI_SCORING_SOFTMAX"), abi.const("DI_SCORING_SIGMOID")
MAX, SUM_TOP2 = abi.const("DI_GROUP_SCORE_MAX"), abi.const("DI_GROUP_SCORE_SUM_TOP2")


def f32(a):
    return Tensor.from_numpy(np.asarray(a, dtype=np.float32))


def route(logits, K, bias=None, **kw):
    T = logits.shape[0]
    ids, weights = Tensor.empty((T, K), "int32", fill=-5), Tensor.empty((T, K), "f32", fill=np.nan)
    ref.moe_router(logits=f32(logits), bias=None if bias is None else f32(bias), topk_ids=ids, topk_weights=weights,
                   **kw)
    return ids.numpy().copy(), weights.numpy().copy()


def torch_gate(logits, K, bias, scoring, n_group, topk_group, group_score, norm, route_scale, mask_value):
    """HF DeepseekV3TopkRouter / DeepSeek model.py Gate after the router matmul, in float64.

    mask_value is what dropped groups' experts get: DeepSeek's model.py (and transformers 5.x)
    use -inf, HF's original remote code (modeling_deepseek.py) used 0.0.
    """
    logits = torch.from_numpy(logits).double()
    scores = logits.softmax(-1) if scoring == SOFTMAX else logits.sigmoid()
    choice = scores + torch.from_numpy(bias).double() if bias is not None else scores.clone()
    T, E = scores.shape
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        if group_score == MAX:
            gs = grouped.amax(-1)
        else:
            gs = grouped.topk(2, dim=-1)[0].sum(-1)
        gidx = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(~smask.bool(), mask_value)
    idx = torch.topk(choice, k=K, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx.numpy(), (w * route_scale).numpy()


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 5), n_group=st.sampled_from([1, 2, 4, 8]), per_group=st.integers(2, 6),
       scoring=st.sampled_from([SOFTMAX, SIGMOID]), group_score=st.sampled_from([MAX, SUM_TOP2]),
       biased=st.booleans(), norm=st.booleans(), data=st.data())
def test_router_matches_torch_gate(T, n_group, per_group, scoring, group_score, biased, norm, data):
    E = n_group * per_group
    topk_group = data.draw(st.integers(1, n_group))
    K = data.draw(st.integers(1, topk_group * per_group))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32) if biased else None
    kw = dict(scoring=scoring, n_group=n_group, topk_group=topk_group, group_score=group_score,
              norm_topk_prob=int(norm), routed_scaling_factor=2.5)
    ids, w = route(logits, K, bias, **kw)
    tid, tw = torch_gate(logits, K, bias, scoring, n_group, topk_group, group_score, norm, 2.5, float("-inf"))
    for t in range(T):
        assert sorted(ids[t]) == sorted(tid[t])
        torch_weight_of = dict(zip(tid[t].tolist(), tw[t].tolist()))
        np.testing.assert_allclose(w[t], [torch_weight_of[i] for i in ids[t].tolist()], rtol=1e-6)
        # descending order of the biased choice score
        sc = logits[t].astype(np.float64)
        s = np.exp(sc - sc.max()) / np.exp(sc - sc.max()).sum() if scoring == SOFTMAX else 1 / (1 + np.exp(-sc))
        choice = s + (bias if bias is not None else 0)
        assert np.all(np.diff(choice[ids[t]]) <= 0)


def test_dropped_groups_are_minus_inf_not_zero():
    # sigmoid(0) = 0.5 everywhere; the bias makes every biased score negative. Group 0 (experts 0, 1)
    # wins; group 1 is dropped. With HF's old 0.0 mask the dropped experts (0.0) beat the kept ones
    # (about -0.5) and get picked; with the documented -inf they never are.
    logits = np.zeros((1, 4), np.float32)
    bias = np.array([-1.0, -1.1, -2.0, -2.1], np.float32)
    kw = dict(scoring=SIGMOID, n_group=2, topk_group=1, group_score=SUM_TOP2, norm_topk_prob=1,
              routed_scaling_factor=1.0)
    ids, w = route(logits, 2, bias, **kw)
    np.testing.assert_array_equal(ids, [[0, 1]])
    np.testing.assert_allclose(w, [[0.5, 0.5]])
    hf_zero, _ = torch_gate(logits, 2, bias, SIGMOID, 2, 1, SUM_TOP2, True, 1.0, 0.0)
    assert sorted(hf_zero[0]) == [2, 3]          # the case where the two conventions differ
    inf_ids, _ = torch_gate(logits, 2, bias, SIGMOID, 2, 1, SUM_TOP2, True, 1.0, float("-inf"))
    assert sorted(inf_ids[0]) == [0, 1]


def test_router_ties_go_to_the_lower_index():
    ids, w = route(np.zeros((2, 6), np.float32), 3, scoring=SOFTMAX, n_group=1, routed_scaling_factor=1.0)
    np.testing.assert_array_equal(ids, [[0, 1, 2]] * 2)
    np.testing.assert_allclose(w, np.full((2, 3), 1 / 6), rtol=1e-6)
    # equal groups: the lower group is kept
    ids, _ = route(np.zeros((1, 6), np.float32), 2, scoring=SIGMOID, n_group=3, topk_group=1, group_score=MAX,
                   routed_scaling_factor=1.0)
    np.testing.assert_array_equal(ids, [[0, 1]])


def test_router_softmax_hand_case():
    # softmax([ln 1, ln 2, ln 3, ln 4]) = [0.1, 0.2, 0.3, 0.4]; top 2 = experts 3, 2
    logits = np.log(np.array([[1.0, 2.0, 3.0, 4.0]], np.float32))
    ids, w = route(logits, 2, scoring=SOFTMAX, n_group=1, routed_scaling_factor=1.0)
    np.testing.assert_array_equal(ids, [[3, 2]])
    np.testing.assert_allclose(w, [[0.4, 0.3]], rtol=1e-6)
    ids, w = route(logits, 2, scoring=SOFTMAX, norm_topk_prob=1, routed_scaling_factor=2.0)
    np.testing.assert_allclose(w, [[0.8 / 0.7, 0.6 / 0.7]], rtol=1e-6)


def test_router_validation():
    logits = np.zeros((1, 6), np.float32)
    with pytest.raises(ValueError, match="do not split into n_group=4"):
        route(logits, 2, scoring=SIGMOID, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match=r"topk_ids.shape\[1\]=3 > 2 experts eligible"):
        route(logits, 3, scoring=SIGMOID, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match=r"bias.shape\[0\]=5 != logits.shape\[1\]=6"):
        route(logits, 2, bias=np.zeros(5), scoring=SIGMOID)


# ---------------------------------------------------------------------------- moe_experts


def make_expert(rng, shape, fmt):
    w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    if fmt == "f32":
        return f32(w)
    if fmt == "bf16":
        return Tensor.from_numpy(w, dtype="bf16")
    return quantize_array(w, "int4", (1, 32), "bf16")


def torch_weight(t: Tensor) -> torch.Tensor:
    """An expert weight as float64, int4 group-32 weights decoded by torch from the packed bytes."""
    if t.quant is None:
        return torch.from_numpy(t.numpy().astype(np.float64))
    rows, cols = t.shape
    b = torch.from_numpy(t.buffer.astype(np.int64))                 # [rows, ceil(cols / 2)] bytes
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(rows, -1)[:, :cols]
    q = torch.where(codes >= 8, codes - 16, codes).double()
    scales = torch.from_numpy(t.quant.scales.buffer.astype(np.float64))   # bf16 -> float64 is exact
    return q * scales.repeat_interleave(32, dim=1)[:, :cols]


@pytest.mark.parametrize("accumulate", [0, 1])
def test_experts_match_torch_loop(accumulate):
    rng = np.random.default_rng(accumulate)
    T, H, I, E, K = 5, 40, 24, 6, 3
    fmts = ["f32", "bf16", "int4", "f32", "int4", "bf16"]
    gate = [make_expert(rng, (I, H), f) for f in fmts]
    up = [make_expert(rng, (I, H), f) for f in fmts]
    down = [make_expert(rng, (H, I), f) for f in fmts]
    gate[5] = up[5] = down[5] = None                     # not resident and never routed to
    ids = np.array([[0, 1, 2], [3, 4, -1], [2, 2, 0], [6, 1, 4], [4, 3, 0]], np.int32)   # -1 and 6: skipped
    wts = rng.random((T, K)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    out0 = rng.standard_normal((T, H)).astype(np.float32)
    out = f32(out0.copy())
    ref.moe_experts(x=f32(x), topk_ids=Tensor.from_numpy(ids), topk_weights=f32(wts), accumulate=accumulate,
                    w_gate=gate, w_up=up, w_down=down, out=out)
    xt = torch.from_numpy(x).double()
    want = torch.from_numpy(out0).double() if accumulate else torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if not 0 <= e < E:
                continue
            h = torch.nn.functional.silu(torch_weight(gate[e]) @ xt[t]) * (torch_weight(up[e]) @ xt[t])
            want[t] += float(wts[t, k]) * (torch_weight(down[e]) @ h)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_experts_not_resident_is_failed_precondition():
    rng = np.random.default_rng(0)
    gate = [make_expert(rng, (4, 8), "f32"), None]
    out = Tensor.empty((1, 8), "f32", fill=3.0)
    with pytest.raises(BackendCallError, match="expert 1 not resident") as e:
        ref.moe_experts(x=f32(np.ones((1, 8))), topk_ids=Tensor.from_numpy(np.array([[1]], np.int32)),
                        topk_weights=f32([[1.0]]), w_gate=gate, w_up=gate, w_down=[gate[0], None], out=out)
    assert e.value.status == abi.FAILED_PRECONDITION
    assert (out.numpy() == 3.0).all()   # nothing written


def test_experts_validation():
    rng = np.random.default_rng(0)
    g = [make_expert(rng, (4, 8), "f32")]
    args = dict(x=f32(np.ones((1, 8))), topk_ids=Tensor.from_numpy(np.array([[0]], np.int32)),
                topk_weights=f32([[1.0]]), out=Tensor.empty((1, 8), "f32"))
    with pytest.raises(ValueError, match=r"moe_experts: w_down\[0\].shape=\[4, 8\], expected \[8, 4\]"):
        ref.moe_experts(w_gate=g, w_up=g, w_down=g, **args)
    with pytest.raises(ValueError, match=r"len\(w_gate\)=1 != num_experts=2"):
        ref.moe_experts(num_experts=2, w_gate=g, w_up=g, w_down=g, **args)
