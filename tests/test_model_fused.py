"""The runtime's use of ABI 1.6's fused mla_rope_cache_write (model.deepseek's mla_prologue): a backend
that has it runs one op per layer where there were four (prefill writing latent and k_pe back into kv_a's
output for kv_b and mla_prefill, decode without kv_out), and the greedy tokens are those of the unfused
ops, bit for bit, on the reference and the CPU library."""
from __future__ import annotations

import collections

import pytest

from deepinfer.engine import Engine, default_model_dir
from deepinfer.model.graph import FUSED_OPS

PROMPTS = ["def fibonacci(n):", "import os\n"]


def _generate(backend: str, precision: str, fused: bool):
    engine = Engine.from_pretrained(default_model_dir(), config={"backend": backend, "precision": precision,
                                                                 "max_batch": 2, "max_seq_len": 64})
    try:
        graph = engine.runner.graph
        assert "mla_rope_cache_write" in graph.fused_ops      # both backends implement ABI 1.6
        if not fused:
            graph.fused_ops = frozenset()                      # as on a 1.5 library
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        tokens = engine.generate_ids(ids, max_new_tokens=6, ignore_eos=True)
        # the ops every traced step recorded (the CPU library replays them natively, not through _run)
        calls = collections.Counter(op + ("+kv_out" if kw.get("kv_out") is not None else "")
                                    for plan in engine.runner.plans.values() for op, kw in plan.calls)
        return tokens, calls
    finally:
        engine.close()


@pytest.mark.parametrize("backend,precision", [("reference", "f32"), ("cpu", "f32"), ("cpu", "bf16")])
def test_fused_prologue_gives_the_unfused_tokens(backend, precision):
    fused, calls = _generate(backend, precision, True)
    plain, plain_calls = _generate(backend, precision, False)
    assert fused == plain
    # one fused op per layer and step, prefill's with kv_out, and none of the four it replaces
    assert calls["mla_rope_cache_write+kv_out"] and calls["mla_rope_cache_write"]
    assert not calls["mla_cache_write"] and not calls["rope"]
    assert plain_calls["mla_cache_write"] and not plain_calls["mla_rope_cache_write"]
    assert FUSED_OPS == ("mla_rope_cache_write",)
