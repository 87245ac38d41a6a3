"""Our DeepSeek graph against transformers on tiny random checkpoints, on every backend:
prefill logits, decode step by step through the paged cache, batched prompts of different
lengths, greedy continuations token for token, the MTP head, bf16 and fp8 checkpoints."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from deepinfer.engine import ModelRunner, RunnerConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

F32_FAMILIES = ["v2", "v2lite", "v3", "v3fp8", "v32"]
PROMPT = [5, 17, 200, 3, 99, 42, 7, 130, 64, 11]
PROMPT2 = [250, 8, 31, 77]
_GREEDY: dict = {}   # transformers' greedy continuations per family, shared by the backends


def hf_logits(m, ids) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(1.0, np.abs(b).max()))


def make_model(path, be, **kw):
    kw.setdefault("max_batch", 4)
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("block_size", 4)   # small blocks: every sequence spans several, out of order
    return ModelRunner(path, be, RunnerConfig(**kw))


@pytest.mark.parametrize("family", F32_FAMILIES)
def test_prefill_and_decode_match_transformers(family, model_backend, tiny_checkpoint):
    path, hf, _ = tiny_checkpoint(family)
    be = model_backend
    model = make_model(path, be)
    ref = hf_logits(hf, PROMPT)
    got = be.to_numpy(model.forward([(0, PROMPT, 0)], all_logits=True))
    assert got.shape == ref.shape and got.dtype == np.float32
    assert rel_err(got, ref) < 1e-4
    last = be.to_numpy(model.forward([(1, PROMPT, 0)]))
    assert rel_err(last[0], ref[-1]) < 1e-4
    # a third sequence whose cache blocks interleave with the others': prefill 3 tokens, then decode
    model.free(0)
    model.forward([(2, PROMPT[:3], 0)])
    for i in range(3, len(PROMPT)):
        step = be.to_numpy(model.forward([(2, [PROMPT[i]], i)]))
        assert rel_err(step[0], ref[i]) < 1e-4, f"decode position {i}"


@pytest.mark.parametrize("family", ["v2", "v3", "v32"])
def test_batched_prompts_of_different_lengths(family, model_backend, tiny_checkpoint):
    path, hf, _ = tiny_checkpoint(family)
    be = model_backend
    model = make_model(path, be)
    r1, r2 = hf_logits(hf, PROMPT), hf_logits(hf, PROMPT2)
    a, b = PROMPT[:6], PROMPT2[:2]
    got = be.to_numpy(model.forward([10, 11], [a, b], [0, 0]))
    assert rel_err(got[0], r1[5]) < 1e-4 and rel_err(got[1], r2[1]) < 1e-4
    # mixed step: one sequence decodes one token while the other takes a chunk of two
    got = be.to_numpy(model.forward([10, 11], [[PROMPT[6]], PROMPT2[2:4]], [6, 2], all_logits=True))
    assert rel_err(got[0], r1[6]) < 1e-4
    assert rel_err(got[1], r2[2]) < 1e-4 and rel_err(got[2], r2[3]) < 1e-4
    # plain batched decode
    got = be.to_numpy(model.forward([10, 11], [[PROMPT[7]], [PROMPT[0]]], [7, 4]))
    assert rel_err(got[0], r1[7]) < 1e-4
    assert rel_err(got[1], hf_logits(hf, PROMPT2 + [PROMPT[0]])[-1]) < 1e-4


@pytest.mark.parametrize("family", F32_FAMILIES)
def test_greedy_continuation_matches_transformers(family, model_backend, tiny_checkpoint):
    path, hf, _ = tiny_checkpoint(family)
    be = model_backend
    model = make_model(path, be)
    prompts = [PROMPT[:5], PROMPT2]
    if family not in _GREEDY:
        # transformers' greedy loop, recomputing the whole sequence each step (no cache involved)
        _GREEDY[family] = []
        for p in prompts:
            ids = list(p)
            for _ in range(16):
                ids.append(int(hf_logits(hf, ids)[-1].argmax()))
            _GREEDY[family].append(ids[len(p):])
    want = _GREEDY[family]
    sids = [model.new_sequence() for _ in prompts]
    feed, pos, out = [list(p) for p in prompts], [0, 0], [[], []]
    for _ in range(16):
        logits = model.forward(sids, feed, pos)
        new = model.sample(logits, temperature=[0.0, 0.0])
        for r, t in enumerate(new):
            pos[r] += len(feed[r])
            feed[r] = [t]
            out[r].append(t)
    for s in sids:
        model.free(s)
    assert out == want
    assert model.block_manager.num_free_blocks == model.block_manager.num_blocks


def test_bf16_checkpoint(model_backend, tiny_checkpoint):
    """bf16 weights and activations: close to transformers in bf16 and no further from the f32
    result (same weights) than transformers' own bf16 run is."""
    path, hf, _ = tiny_checkpoint("v3bf16")
    be = model_backend
    hf32 = copy.deepcopy(hf).float()
    ref16, ref32 = hf_logits(hf, PROMPT), hf_logits(hf32, PROMPT)
    model = make_model(path, be, dtype="bf16")
    got = be.to_numpy(model.forward([(0, PROMPT[:4], 0)], all_logits=True))
    for i in range(4, len(PROMPT)):
        got = np.concatenate([got, be.to_numpy(model.forward([(0, [PROMPT[i]], i)]))])
    hf_own = rel_err(ref16, ref32)
    assert rel_err(got, ref16) < 5e-2
    assert rel_err(got, ref32) < 2 * hf_own + 1e-2
    # bf16 weights computed in f32 activations agree with transformers in f32 tightly
    m32 = make_model(path, be, dtype="f32")
    assert rel_err(be.to_numpy(m32.forward([(0, PROMPT, 0)], all_logits=True)), ref32) < 1e-4


def test_fp8_weights_stay_quantized(tiny_checkpoint):
    import deepinfer

    path, _, _ = tiny_checkpoint("v3fp8")
    model = make_model(path, deepinfer.get_backend("reference"))
    w = model.weights.layers[1].moe.experts_gate[0]
    assert w.dtype.name == "e4m3" and w.quant is not None and w.quant.block == (128, 128)
    assert w.quant.scales.shape == (1, 2)   # [96, 256]: one partial row block, two column blocks
    assert model.weights.layers[0].attn.q_b.quant.scales.shape == (2, 2)  # [192, 192]: partial edge blocks
    assert model.weights.layers[0].attn.kv_b_dense.quant is None and model.weights.layers[0].attn.kv_b_dense.dtype.name == "f32"


@pytest.mark.parametrize("family", ["v3", "v32"])
def test_mtp_head_matches_torch_oracle(family, model_backend, tiny_checkpoint):
    """The MTP head against transformers' blocks (v32: a V3.2 block whose indexer reads the MTP
    layer's own cache; 7 positions, so from the fifth on it picks 4 of them)."""
    import tiny_checkpoints
    from safetensors.torch import load_file

    path, hf, block = tiny_checkpoint(family)
    be = model_backend
    L = hf.config.num_hidden_layers
    state = {k.split(f"model.layers.{L}.", 1)[1]: v
             for k, v in load_file(str(path / tiny_checkpoints.MTP_SHARD)).items()}
    model = make_model(path, be)
    assert model.has_mtp
    ids = PROMPT[:7]
    nxt = PROMPT[1:8]
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state
    want = tiny_checkpoints.mtp_reference_logits(hf, block, hidden, torch.tensor([nxt]), state)[0].numpy()
    # prefill of 5 tokens, then its draft logits; then two decode steps with their drafts
    model.forward([(0, ids[:5], 0)], keep_hidden=True)
    got = be.to_numpy(model.mtp_logits([(0, nxt[:5], 0)], all_logits=True))
    assert rel_err(got, want[:5]) < 1e-4
    for i in (5, 6):
        model.forward([(0, [ids[i]], i)], keep_hidden=True)
        got = be.to_numpy(model.mtp_logits([(0, [nxt[i]], i)]))
        assert rel_err(got[0], want[i]) < 1e-4, f"mtp position {i}"
