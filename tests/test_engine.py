"""The engine end to end on the embedded model: batching, streaming, stop strings, seeded sampling,
chat, the CLI, and the embedded model against transformers (logits, greedy tokens, perplexity)."""
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import deepinfer
from deepinfer.engine import Engine, default_model_dir
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.evaluate import heldout_text, perplexity

MODEL = default_model_dir()
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]


def _backends():
    out = [pytest.param("reference", id="reference")]
    cpu = [c for c in deepinfer.candidates() if c.ok and c.name == "cpu"]
    out.append(pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not cpu, reason="libdeepinfer_cpu.so not built")))
    return out


@pytest.fixture(scope="module", params=_backends())
def engine(request):
    return Engine.from_pretrained(MODEL, config={"backend": request.param, "precision": "f32", "max_batch": 4,
                                                 "max_seq_len": 640})


def test_run_api_uses_the_embedded_model():
    out = deepinfer.run("def fibonacci(n):", max_new_tokens=8, config={"backend": "reference", "precision": "f32"})
    assert isinstance(out, str) and len(out) > 0


def test_batched_prompts_equal_one_at_a_time(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    together = engine.generate_ids(ids, max_new_tokens=12)
    alone = [engine.generate_ids([i], max_new_tokens=12)[0] for i in ids]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_stream_equals_generate_and_feeds_the_callback(engine):
    seen = []
    pieces = list(engine.stream(PROMPTS[0], callback=seen.append, max_new_tokens=16))
    assert pieces == seen and len(pieces) > 1
    assert "".join(pieces) == engine.generate(PROMPTS[0], max_new_tokens=16)


def test_stop_string_cuts_the_output(engine):
    full = engine.generate(PROMPTS[1], max_new_tokens=24)
    stop = full.strip()[3:6] if len(full.strip()) > 6 else None
    if not stop:
        pytest.skip("greedy continuation too short to pick a stop string")
    cut = engine.generate(PROMPTS[1], max_new_tokens=24, stop=[stop])
    assert stop not in cut
    assert full.startswith(cut) and len(cut) < len(full)


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate(PROMPTS[0], max_new_tokens=16, temperature=1.0, top_p=0.95, seed=5)
    b = engine.generate(PROMPTS[0], max_new_tokens=16, temperature=1.0, top_p=0.95, seed=5)
    c = [engine.generate(PROMPTS[0], max_new_tokens=16, temperature=1.0, top_p=0.95, seed=s) for s in (6, 7, 8)]
    assert a == b
    assert any(x != a for x in c)


def test_top_k_one_is_greedy(engine):
    assert engine.generate(PROMPTS[2], max_new_tokens=10, temperature=0.8, top_k=1, seed=3) == \
        engine.generate(PROMPTS[2], max_new_tokens=10)


def test_chat_template(engine):
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in text
    assert isinstance(engine.chat([{"role": "user", "content": "hi"}], max_new_tokens=4), str)


def test_more_prompts_than_max_batch_queue_and_complete(engine):
    prompts = [p + " " * i for i, p in enumerate(PROMPTS * 2)]        # 6 prompts, max_batch 4
    together = engine.generate_batch(prompts, max_new_tokens=6)
    assert together == [engine.generate(p, max_new_tokens=6) for p in prompts]
    assert engine.block_manager.num_used_blocks == 0


def test_limits_are_clear_errors(engine):
    with pytest.raises(ConfigError, match="max_seq_len"):
        engine.generate("x", max_new_tokens=1000)
    with pytest.raises(ConfigError, match="unknown sampling option"):
        engine.generate("x", temprature=0.5)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")


def test_cli_run_streams_text(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "deepinfer.cli", "run", str(MODEL), "def add(a, b):",
                        "--max-new-tokens", "8", "--backend", "reference"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def add(a, b):") and len(r.stdout) > len("def add(a, b):\n")
    assert "precision" in r.stderr or "f32" in r.stderr or "bf16" in r.stderr


def test_cli_unknown_config_key_fails(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"backend": "reference", "max_btach": 2}))
    r = subprocess.run([sys.executable, "-m", "deepinfer.cli", "run", "hello", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "max_btach" in r.stderr


# ---------------------------------------------------------------- the embedded model vs transformers

@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    m = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    return m.eval()


def test_embedded_model_logits_match_transformers(engine, hf_model):
    import torch

    ids = engine.tokenizer.encode(heldout_text(MODEL)[:600])[:96]
    ours = engine.runner.score(ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.isfinite(ours).all()
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err < 1e-4, err


def test_embedded_model_greedy_matches_transformers(engine, hf_model):
    """Greedy tokens against transformers recomputing the whole prefix each step. (transformers'
    own cached `generate` departs from its uncached forward on this model after one token, so the
    uncached forward is the oracle.)"""
    import tiny_checkpoints

    ids = engine.tokenizer.encode(PROMPTS[0])
    ours = engine.generate_ids([ids], max_new_tokens=16)[0]
    assert ours == tiny_checkpoints.transformers_greedy(hf_model, ids, 16)


# Training run (tools/train_nano.py, training.json): held-out ppl 20.89 over 42707 tokens in windows of
# 512 (deepinfer eval-ppl reproduces 20.8908). Its first 4096 tokens are harder: our CPU and reference
# backends measure 40.80 there (f32). The bound leaves a 5% margin; the unigram baseline is ~760.
PPL_FIRST_4096_BOUND = 42.8


def test_embedded_model_heldout_perplexity_is_bounded(engine):
    res = perplexity(engine, heldout_text(MODEL), max_tokens=4096, window=512)
    assert math.isfinite(res.ppl)
    assert res.ppl < PPL_FIRST_4096_BOUND, res.ppl
    training = json.loads((MODEL / "training.json").read_text())
    assert res.ppl < training["verify"]["unigram_ppl"] / 15   # far below the unigram baseline
