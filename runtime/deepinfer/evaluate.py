"""Held-out perplexity and top-1 agreement: `deepinfer eval-ppl MODEL [--precision P]`.

The text is cut into windows of `window` tokens; each window is one fresh sequence whose every
position is scored (the first token of a window only conditions). Perplexity is
exp(mean negative log-likelihood) over all scored tokens. Top-1 agreement compares the argmax of
every position with the same positions under the bf16 path. Metrics are computed here on the host:
this is measurement, not model code.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np


@dataclass
class PplResult:
    precision: str
    backend: str
    tokens: int
    nll: float
    ppl: float
    top1: Optional[np.ndarray] = None  # argmax per scored position (kept for agreement)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("top1")
        return d


def heldout_text(model_dir: Path, text_path: Optional[str] = None) -> str:
    p = Path(text_path) if text_path else Path(model_dir) / "heldout.txt"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no held-out text (give --text FILE)")
    return p.read_text()


def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(engine, text: str, max_tokens: int = 4096, window: int = 512) -> PplResult:
    """Non-overlapping windows of `window` tokens (the tokenizer's BOS first, as in training); every
    token but a window's first is a target. The same protocol as tools/mtp_acceptance.evaluate, so
    the training run's recorded perplexity is directly comparable."""
    ids = engine.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError("held-out text is shorter than two tokens")
    window = min(window, engine.config.max_seq_len)
    total_nll, count, top1 = 0.0, 0, []
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        logits = engine.runner.score(chunk[:-1])  # [len-1, V] f32 host array: logits of every position
        lp = _log_softmax_rows(logits)
        tgt = np.asarray(chunk[1:])
        total_nll -= float(lp[np.arange(len(tgt)), tgt].sum())
        count += len(tgt)
        top1.append(logits.argmax(axis=-1))
    nll = total_nll / count
    return PplResult(engine.config.precision, engine.backend.name, count, nll, math.exp(nll), np.concatenate(top1))


def main(args) -> int:
    from .engine import Engine, resolve_model_dir

    model_dir = resolve_model_dir(args.model, getattr(args, "revision", None))
    text = heldout_text(model_dir, args.text)
    overrides = {"precision": args.precision}
    if args.backend:
        overrides["backend"] = args.backend
    eng = Engine.from_pretrained(model_dir, config=args.config, **overrides)
    res = perplexity(eng, text, args.max_tokens, args.window)
    out = res.as_dict()
    if args.precision not in ("bf16", "f32"):
        ref = perplexity(Engine.from_pretrained(model_dir, config=args.config,
                                                **{**overrides, "precision": "bf16"}), text, args.max_tokens, args.window)
        out["bf16_ppl"] = ref.ppl
        out["ppl_change_pct"] = 100.0 * (res.ppl / ref.ppl - 1.0)
        out["top1_agreement_vs_bf16"] = float((res.top1 == ref.top1).mean())
    print(json.dumps(out, indent=2))
    return 0
