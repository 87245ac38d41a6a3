"""DeepSeek V4 against transformers on tiny random checkpoints (tests/tiny_v4.py), on every backend:
prefill logits, chunked prefill and decode step by step through the paged caches (sliding window,
CSA and HCA compressed entries, the indexer), batched sequences whose blocks interleave, block
sizes below and above the compression ratios, 16-token greedy continuations, DeepSeek's own
tensor layout and transformers' fused one, and `deepinfer run` on a V4 directory."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from deepinfer.engine import ModelRunner, RunnerConfig

import tiny_v4
from tiny_checkpoints import add_tokenizer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT, rel_err = tiny_v4.PROMPT, tiny_v4.rel_err
PROMPT2 = [250, 8, 31, 77, 101, 4, 66, 19, 203, 45, 12]
_CKPT: dict = {}


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    """(path, transformers model) per layout, made once per module."""
    def get(layout="hf", hc_mult=2):
        key = (layout, hc_mult)
        if key not in _CKPT:
            path = tmp_path_factory.mktemp(f"v4_{layout}_{hc_mult}")
            m = tiny_v4.make(path, seed=3, layout=layout, hc_mult=hc_mult)
            add_tokenizer(path)
            _CKPT[key] = (path, m, tiny_v4.full_logits(m, PROMPT).numpy())
        return _CKPT[key]
    return get


def make_runner(path, be, **kw):
    kw.setdefault("max_batch", 4)
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("block_size", 4)
    return ModelRunner(path, be, RunnerConfig(**kw))


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_then_decode_match_transformers(block_size, model_backend, v4_checkpoint):
    path, hf, ref = v4_checkpoint()
    be = model_backend
    tiny_v4.check_cached_steps(make_runner(path, be, block_size=block_size), be, ref)


def test_batched_sequences_interleaved_blocks(model_backend, v4_checkpoint):
    path, hf, ref = v4_checkpoint()
    be = model_backend
    ref2 = tiny_v4.full_logits(hf, PROMPT2).numpy()
    m = make_runner(path, be)
    got = be.to_numpy(m.forward([10, 11], [PROMPT[:9], PROMPT2[:3]], [0, 0]))
    assert rel_err(got[0], ref[8]) < 1e-4 and rel_err(got[1], ref2[2]) < 1e-4
    # one sequence decodes while the other takes a chunk, over several steps (their blocks alternate)
    a, b = 9, 3
    while a < len(PROMPT) and b < len(PROMPT2):
        n = min(3, len(PROMPT2) - b)
        got = be.to_numpy(m.forward([10, 11], [[PROMPT[a]], PROMPT2[b:b + n]], [a, b], all_logits=True))
        assert rel_err(got[0], ref[a]) < 1e-4, f"seq 10 position {a}"
        assert rel_err(got[1:], ref2[b:b + n]) < 1e-4, f"seq 11 positions {b}..{b + n - 1}"
        a, b = a + 1, b + n


def test_greedy_continuation_matches_transformers(model_backend, v4_checkpoint):
    path, hf, _ = v4_checkpoint()
    be = model_backend
    want = tiny_v4.greedy(hf, PROMPT[:12], 16)
    m = make_runner(path, be)
    ids, got = list(PROMPT[:12]), []
    logits = be.to_numpy(m.forward([(0, ids, 0)]))
    for i in range(16):
        t = int(np.argmax(logits[0]))
        got.append(t)
        logits = be.to_numpy(m.forward([(0, [t], len(ids))]))
        ids.append(t)
    assert got == want


@pytest.mark.parametrize("layout", ["deepseek", "fused"])
def test_layouts_load_the_same_model(layout, model_backend, v4_checkpoint):
    path, _, ref = v4_checkpoint(layout)
    be = model_backend
    m = make_runner(path, be)
    got = be.to_numpy(m.forward([(0, PROMPT, 0)], all_logits=True))
    assert rel_err(got, ref) < 1e-4


def test_four_streams(model_backend, v4_checkpoint):
    path, _, ref = v4_checkpoint("hf", hc_mult=4)
    be = model_backend
    m = make_runner(path, be)
    got = be.to_numpy(m.forward([(0, PROMPT[:20], 0)], all_logits=True))
    assert rel_err(got, ref[:20]) < 1e-4
    got = be.to_numpy(m.forward([(0, PROMPT[20:], 20)], all_logits=True))
    assert rel_err(got, ref[20:]) < 1e-4


def test_deepseek_layout_names_are_renamed(tmp_path):
    """Every tensor of DeepSeek's layout maps onto one of transformers' modules."""
    from deepinfer.model import v4_names

    m = tiny_v4.hf_model(0)
    names = set(tiny_v4._per_expert_state(m))
    stored = [tiny_v4.deepseek_name(n) for n in names]
    stored = [n.replace(".wgate.", ".w1.") if ".ffn.experts." in n else n for n in stored]
    stored = [n.replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2.") for n in stored]
    ren = v4_names.renames(stored)
    assert {ren.get(n, n) for n in stored} == names
    # DeepSeek's block scales (`.scale` beside a `.weight`) become V3's weight_scale_inv
    r = v4_names.renames(["layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.0.hc_attn_scale"])
    assert r["layers.0.attn.wq_a.scale"] == "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    assert r["layers.0.hc_attn_scale"] == "model.layers.0.attn_hc.scale"


def test_mtp_layer_names_are_renamed():
    """DeepSeek's `mtp.0.*` become layer num_hidden_layers: the block with the per-layer renames,
    the MTP layer's own pieces under V3's names where V3 has them."""
    from deepinfer.model import v4_names

    r = v4_names.renames(["mtp.0.e_proj.weight", "mtp.0.e_proj.scale", "mtp.0.norm.weight", "mtp.0.head.weight",
                          "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.attn_norm.weight",
                          "mtp.0.ffn.experts.5.w2.weight", "mtp.0.ffn.gate.bias", "mtp.0.hc_ffn_scale"], num_layers=43)
    assert r == {"mtp.0.e_proj.weight": "model.layers.43.e_proj.weight",
                 "mtp.0.e_proj.scale": "model.layers.43.e_proj.weight_scale_inv",
                 "mtp.0.norm.weight": "model.layers.43.shared_head.norm.weight",
                 "mtp.0.head.weight": "model.layers.43.shared_head.head.weight",
                 "mtp.0.hc_head_fn": "model.layers.43.hc_head.hc_fn",
                 "mtp.0.attn.wq_a.weight": "model.layers.43.self_attn.q_a_proj.weight",
                 "mtp.0.attn_norm.weight": "model.layers.43.input_layernorm.weight",
                 "mtp.0.ffn.experts.5.w2.weight": "model.layers.43.mlp.experts.5.down_proj.weight",
                 "mtp.0.ffn.gate.bias": "model.layers.43.mlp.gate.e_score_correction_bias",
                 "mtp.0.hc_ffn_scale": "model.layers.43.ffn_hc.scale"}


@pytest.fixture(scope="module")
def v4_mtp_checkpoint(tmp_path_factory):
    """A DeepSeek-layout V4 checkpoint with its `mtp.0` layer, and the MTP oracle (tiny_v4.MTP)."""
    path = tmp_path_factory.mktemp("v4_mtp")
    hf, mtp = tiny_v4.make(path, seed=3, layout="deepseek", mtp=True)
    add_tokenizer(path)
    return path, hf, mtp


def test_mtp_head_matches_the_oracle(model_backend, v4_mtp_checkpoint):
    """V4's MTP layer: the main model's last streams and the next tokens, e_proj / h_proj, a V4
    block (sliding window of 8: 16 positions reach past it), its hyper-connection head and the
    shared head; against the same computation from transformers' V4 modules. A prefill of 10, then
    decode steps through the MTP layer's own cache."""
    path, hf, mtp = v4_mtp_checkpoint
    be = model_backend
    ids, nxt = PROMPT[:16], PROMPT[1:17]
    want = mtp.reference_logits(ids, nxt).numpy()
    m = make_runner(path, be)
    assert m.has_mtp and m.hidden_width == hf.config.hc_mult * hf.config.hidden_size
    m.forward([(0, ids[:10], 0)], keep_hidden=True)
    got = be.to_numpy(m.mtp_logits([(0, nxt[:10], 0)], all_logits=True))
    assert rel_err(got, want[:10]) < 1e-4
    for i in range(10, 16):
        m.forward([(0, [ids[i]], i)], keep_hidden=True)
        got = be.to_numpy(m.mtp_logits([(0, [nxt[i]], i)]))
        assert rel_err(got[0], want[i]) < 1e-4, f"mtp position {i}"
    # the main model is unchanged by the extra layer
    ref = tiny_v4.full_logits(hf, ids).numpy()
    assert rel_err(be.to_numpy(m.forward([(1, ids, 0)], all_logits=True)), ref) < 1e-4


def test_cli_runs_a_deepseek_layout_directory(tmp_path):
    path = tmp_path / "v4"
    tiny_v4.make(path, seed=1, layout="deepseek")
    add_tokenizer(path)
    r = subprocess.run([sys.executable, "-c", "import sys; from deepinfer.cli import main; sys.exit(main())", "run",
                        str(path), "hello world", "--max-new-tokens", "8", "--backend", "reference"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_engine_batches_and_reuses_cached_prefixes(backend, v4_checkpoint):
    """Continuous batching and the prefix cache on V4: every cache pool (window KV, compressor
    inputs, compressed entries, indexer keys) is a function of the block's tokens, so a request that
    reuses another's blocks continues exactly as transformers does."""
    import deepinfer
    from deepinfer.engine import Engine

    if backend == "cpu" and not [c for c in deepinfer.candidates() if c.ok and c.name == "cpu"]:
        pytest.skip("libdeepinfer_cpu.so not built")
    path, hf, _ = v4_checkpoint()
    eng = Engine.from_pretrained(path, config={"backend": backend, "precision": "f32", "max_batch": 3,
                                               "max_seq_len": 64, "kv_block_size": 4})
    prompts = [PROMPT[:20], PROMPT[:20] + [61, 7], PROMPT2]       # the second shares 5 full blocks
    want = [tiny_v4.greedy(hf, p, 8) for p in prompts]
    assert eng.generate_ids(prompts, max_new_tokens=8) == want
    # again, one at a time: every prompt now hits cached blocks
    assert [eng.generate_ids([p], max_new_tokens=8)[0] for p in prompts] == want
    assert eng.block_manager.num_used_blocks == 0
