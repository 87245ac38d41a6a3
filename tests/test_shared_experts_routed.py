"""Shared experts run inside moe_experts, as routed experts every token takes with weight 1
(RunnerConfig.shared_experts_routed, model.weights.WeightLoader._shared_as_experts): the same model
as transformers', three ops fewer per MoE layer, and left as their own MLP wherever the pieces would
change what the model computes."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from deepinfer.engine import ModelRunner, RunnerConfig
from deepinfer.model.plan import Tracer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT = [5, 17, 200, 3, 99, 42, 7, 130, 64, 11]


def runner(path, be, **kw):
    return ModelRunner(path, be, RunnerConfig(max_batch=2, max_seq_len=64, block_size=4, **kw))


def moe_layers(r):
    return [l.moe for l in r.weights.layers if l.moe is not None]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(1.0, np.abs(b).max()))


def decode_ops(r, be) -> Counter:
    """Op counts of the one-token decode plan (after a prefill and one decode step)."""
    r.forward([(0, PROMPT[:4], 0)])
    be.to_numpy(r.forward([(0, [PROMPT[4]], 4)]))
    key = max((k for k in r.plans if k.mode == "decode"), key=lambda k: k.tokens, default=None)
    assert key is not None
    return Counter(op for op, _ in r.plans[key].calls)


@pytest.mark.parametrize("family", ["v2", "v2lite", "v3", "v3fp8"])
def test_matches_transformers_with_fewer_ops(family, model_backend, tiny_checkpoint):
    path, hf, _ = tiny_checkpoint(family)
    be = model_backend
    fused, apart = runner(path, be), runner(path, be, shared_experts_routed=False)
    layers = moe_layers(fused)
    n_shared = hf.config.n_shared_experts
    assert layers and all(m.shared is None and m.shared_experts is not None for m in layers)
    assert all(m.shared is not None and m.shared_experts is None for m in moe_layers(apart))
    for m in layers:
        gates, ups, downs = m.shared_experts
        assert len(gates) == len(ups) == len(downs) == n_shared
        # laid out as the routed experts (one layout for moe_experts' fast paths)
        for piece, routed in ((gates[0], m.experts_gate[0]), (downs[-1], m.experts_down[0])):
            assert piece.shape == routed.shape and piece.dtype == routed.dtype and piece.is_contiguous()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
    got = be.to_numpy(fused.forward([(0, PROMPT, 0)], all_logits=True))
    assert rel_err(got, ref) < 1e-4
    base = be.to_numpy(apart.forward([(0, PROMPT, 0)], all_logits=True))
    assert rel_err(got, base) < 1e-5
    # step by step through the cache: the constant columns survive the router's writes
    fused.free(0)
    fused.forward([(1, PROMPT[:3], 0)])
    for i in range(3, len(PROMPT)):
        step = be.to_numpy(fused.forward([(1, [PROMPT[i]], i)]))
        assert rel_err(step[0], ref[i]) < 1e-4, f"decode position {i}"
    ops_f, ops_a = decode_ops(runner(path, be), be), decode_ops(runner(path, be, shared_experts_routed=False), be)
    n = len(layers)
    # the shared gate_up (or gate and up, where they could not be stacked) and down
    assert ops_a["linear"] - ops_f["linear"] == sum(2 if m.shared.gate_up is not None else 3 for m in moe_layers(apart))
    assert ops_a["silu_mul"] - ops_f["silu_mul"] == n
    assert ops_f["moe_experts"] == ops_a["moe_experts"] == n


def test_moe_experts_takes_the_shared_experts_last(tiny_checkpoint):
    """The traced moe_experts call: E + S experts, the shared ones after the routed, K + S columns."""
    import deepinfer

    path, hf, _ = tiny_checkpoint("v2")
    be = deepinfer.get_backend("reference")
    r = runner(path, be)
    r.forward([(0, PROMPT[:4], 0)])
    E, K, S = hf.config.n_routed_experts, hf.config.num_experts_per_tok, hf.config.n_shared_experts
    plan = next(iter(r.plans.values()))
    calls = [kw for op, kw in plan.calls if op == "moe_experts"]
    assert calls
    for kw in calls:
        assert kw["num_experts"] == E + S and kw["accumulate"] == 0
        assert tuple(kw["topk_ids"].shape)[1] == K + S
    ids = [v for k, v in plan.constants.items() if k.startswith("shared_expert_ids")]
    wts = [v for k, v in plan.constants.items() if k.startswith("shared_expert_weights")]
    assert len(ids) == len(wts) == 1
    assert (ids[0][:, K:] == np.arange(E, E + S)).all() and (wts[0][:, K:] == 1).all()


@pytest.mark.parametrize("precision,group,fused", [
    ("int4", 16, True),      # groups of 16 columns: a piece of 32 holds whole groups
    ("int4", 64, False),     # a group would straddle two pieces
    ("int8", 64, False),     # one scale per row: a piece would get its own
    ("w8a8", 64, False),     # the shared MLP's linears quantize their input; moe_experts does not
])
def test_pieces_that_would_change_the_model_stay_one_mlp(precision, group, fused, tiny_checkpoint):
    import deepinfer

    path, _, _ = tiny_checkpoint("v2")      # two shared experts of 32 columns each
    be = deepinfer.get_backend("reference")
    r = runner(path, be, precision=precision, group_size=group)
    assert all((m.shared_experts is not None) == fused and (m.shared is None) == fused for m in moe_layers(r))
    if fused:     # the pieces are quantized as the whole would be: the same model as the MLP
        apart = runner(path, be, precision=precision, group_size=group, shared_experts_routed=False)
        a = be.to_numpy(r.forward([(0, PROMPT, 0)], all_logits=True))
        b = be.to_numpy(apart.forward([(0, PROMPT, 0)], all_logits=True))
        assert rel_err(a, b) < 1e-5


def test_one_shared_expert_keeps_its_stored_format(tiny_checkpoint):
    """V3 (one shared expert): the shared expert is taken whole, also as stored in fp8 or at load."""
    import deepinfer

    be = deepinfer.get_backend("reference")
    for family, precision in (("v3fp8", None), ("v3", "int8"), ("v3", "fp8")):
        path, _, _ = tiny_checkpoint(family)
        for m in moe_layers(runner(path, be, precision=precision)):
            (g,), (u,), (d,) = m.shared_experts
            assert g.dtype == m.experts_gate[0].dtype and d.quant is not None
            assert tuple(d.quant.block) == tuple(m.experts_down[0].quant.block)


def test_loaded_layouts_that_differ_keep_the_mlp(tiny_checkpoint, monkeypatch):
    """The format rules stand in for the loaded layouts moe_experts needs equal; where a loaded piece's
    layout would still differ from the routed experts' (here: made to), the shared MLP runs on its own
    and the model computes the same."""
    import deepinfer
    from deepinfer.model import weights as W

    path, _, _ = tiny_checkpoint("v2")
    be = deepinfer.get_backend("reference")
    pieces, real, load = set(), W._layout, W.WeightLoader._w

    def w(self, name, shape, part=None):      # remembers which tensors are the shared experts' pieces
        t = load(self, name, shape, part)
        if "shared_experts" in name:
            pieces.add(id(t))
        return t

    monkeypatch.setattr(W.WeightLoader, "_w", w)
    monkeypatch.setattr(W, "_layout", lambda t: (real(t), id(t) in pieces))
    r = runner(path, be)
    assert all(m.shared_experts is None and m.shared is not None for m in moe_layers(r))
    apart = runner(path, be, shared_experts_routed=False)
    a = be.to_numpy(r.forward([(0, PROMPT, 0)], all_logits=True))
    b = be.to_numpy(apart.forward([(0, PROMPT, 0)], all_logits=True))
    assert rel_err(a, b) < 1e-6


def test_constant_inputs():
    """Tracer.constant: one tensor per name, its value filled at bind; a second trace with another
    value is an error."""
    import deepinfer

    tr = Tracer(deepinfer.get_backend("reference"))
    v = np.arange(6, dtype=np.int32).reshape(2, 3)
    a = tr.constant("c", v)
    assert tr.constant("c", v) is a and a.shape == (2, 3)
    with pytest.raises(RuntimeError, match="different values"):
        tr.constant("c", v + 1)
