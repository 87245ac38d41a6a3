"""The default precision keeps the checkpoint's own output: `deepinfer.run` on a bf16 checkpoint,
with no config at all, gives transformers' greedy text for that checkpoint.

The oracle is transformers running the checkpoint's bf16 weights with f32 arithmetic
(from_pretrained(dtype=torch.float32)), which is what our CPU default computes (bf16 weights, f32
activations). transformers' own bf16 arithmetic departs from that result at near-ties after a few
tokens, so it is compared by its logits (test_model_oracle.test_bf16_checkpoint), not its text."""
from __future__ import annotations

import shutil

import pytest
import torch

import deepinfer
import tiny_checkpoints

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = ["t5 t17 t200 t3 t99", "t42 t7 t130 t64 t11 t250", "t8 t31 t77", "t100 t101 t102 t103",
           "t9", "t220 t14 t180 t66 t2 t90 t33", "t60 t61", "t150 t151 t152 t153 t154 t155 t156 t157"]
NEW = 12


@pytest.fixture(scope="module")
def bf16_dir(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path, _, _ = tiny_checkpoint("v3bf16")
    d = tmp_path_factory.mktemp("bf16_run") / "model"
    shutil.copytree(path, d)
    tiny_checkpoints.add_tokenizer(d)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    return d, hf


def test_default_run_gives_transformers_greedy_text(bf16_dir):
    d, hf = bf16_dir
    eng = deepinfer.load(str(d))
    assert eng.config.precision == "auto"
    assert eng.runner.precision == "bf16", eng.runner.precision_reason
    assert "the checkpoint's own precision (bf16)" in eng.runner.precision_reason
    assert "lossy" not in eng.runner.precision_reason
    for prompt in PROMPTS:
        ids = eng.tokenizer.encode(prompt)
        want = eng.tokenizer.decode(tiny_checkpoints.transformers_greedy(hf, ids, NEW, hf.config.eos_token_id))
        got = deepinfer.run(str(d), prompt, max_new_tokens=NEW)
        assert got.strip() == want.strip(), prompt


def test_cli_prints_the_choice_and_its_reason(bf16_dir, capsys, caplog):
    import logging

    from deepinfer import cli

    d, _ = bf16_dir
    assert cli.main(["run", str(d), "t5 t17", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "precision bf16: the checkpoint's own precision (bf16); its weights fit" in err
    with caplog.at_level(logging.WARNING, logger="deepinfer"):   # a lossy choice is a logged warning
        assert cli.main(["run", str(d), "t5 t17", "--max-new-tokens", "3", "--precision", "fastest"]) == 0
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "the fastest cpu path" in warned and "lossy (measured cost" in warned


def test_a_lossy_default_is_never_silent(bf16_dir, caplog):
    """When the bf16 weights do not fit, auto quantizes, and says so as a warning with the cost."""
    import logging

    d, _ = bf16_dir
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        eng = deepinfer.load(str(d), config={"memory_budget_bytes": 600_000, "backend": "cpu"})
    assert eng.runner.precision not in ("bf16", "f32") and eng.runner.precision_lossy
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("does not fit" in w and "lossy (measured cost" in w for w in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        eng = deepinfer.load(str(d), config={"backend": "cpu"})
    assert not eng.runner.precision_lossy and not [r for r in caplog.records if r.levelno >= logging.WARNING]
