"""Tiny chat models of the DeepSeek families for the serving tests: the embedded model with a family's
published chat template (tests/data/chat_templates, PROVENANCE.md says where each comes from) and that
family's special tokens added to its tokenizer, the embedding and output rows of the new ids drawn
small and random (the model never learned them; the tests force them through grammars).

    family_model(tmp_dir, "r1") -> model dir     ("r1": DeepSeek-R1's template, think + tool tokens;
                                                  "v31": DeepSeek-V3.1's, thinking switch + tool tokens)
    family_model(tmp_dir, "v32", weights_from=DIR)       (a tiny V3.2 checkpoint (tests/tiny_checkpoints.py)
                                                  with the embedded tokenizer, no template: the DSML
                                                  encoder of engine.dsml_encoding renders its prompts)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from deepinfer.engine import default_model_dir

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"
TOOL_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
               "<｜tool▁output▁end｜>"]
THINK_TOKENS = ["<think>", "</think>"]
FAMILIES = {"r1": "deepseek-r1.jinja", "v31": "deepseek-v3.1.jinja", "v32": None}
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")


def family_model(tmp_dir: Path, family: str, weights_from: Path = None) -> Path:
    """weights_from: the checkpoint whose weights to use (default: the embedded model); its tokenizer is
    replaced by the embedded model's with the family's tokens added."""
    src = default_model_dir()
    out = Path(tmp_dir) / f"nano-{family}"
    if (out / "config.json").exists():
        return out
    shutil.copytree(weights_from or src, out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    tok = json.loads((out / "tokenizer.json").read_text())
    base = max(t["id"] for t in tok["added_tokens"]) + 1
    base = max(base, len(tok["model"]["vocab"]))
    # DeepSeek's tokenizers mark the think tokens as ordinary added tokens and the tool tokens as special
    # (V3.2's DSML markup stays plain text: `<｜DSML｜invoke name=...>` is written in ordinary tokens)
    new = [(t, False) for t in THINK_TOKENS] + [(t, True) for t in TOOL_TOKENS]
    for i, (content, special) in enumerate(new):
        tok["added_tokens"].append({"id": base + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": special})
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    vocab = base + len(new)
    vocab += -vocab % 8
    cfg = json.loads((out / "config.json").read_text())
    old = cfg["vocab_size"]
    cfg["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(0)
    for f in sorted(out.glob("*.safetensors")):
        ws = load_file(str(f))
        changed = False
        for name in [n for n in ws if n.endswith(VOCAB_ROWS)]:
            if ws[name].shape[0] == old:
                w = ws[name]
                extra = (rng.standard_normal((vocab - old, w.shape[1])) * 0.02).astype(ml_dtypes.bfloat16)
                ws[name] = np.concatenate([w, extra.astype(w.dtype)])
                changed = True
        if changed:
            save_file(ws, str(f), metadata={"format": "pt"})
    tc = json.loads((out / "tokenizer_config.json").read_text())
    if FAMILIES[family] is None:
        tc.pop("chat_template", None)       # V3.2 ships an encoder, not a template
    else:
        tc["chat_template"] = (TEMPLATES / FAMILIES[family]).read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False, indent=1))
    return out
