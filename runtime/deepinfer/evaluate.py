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
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import validate as V
from .engine import Engine, resolve_model_dir
from .errors import CheckpointError, InputError


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
    """The text to score: `text_path`, or the model directory's heldout.txt (a non-empty UTF-8 text
    file, or an InputError that says what it is instead)."""
    if text_path:
        return V.read_text_file(text_path, "--text")
    p = Path(model_dir) / "heldout.txt"
    if not p.exists():
        raise InputError(f"{p}: the model has no held-out text; give --text FILE")
    return V.read_text_file(p, "held-out text")


def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(engine, text: str, max_tokens: int = 4096, window: int = 512,
               progress: Optional[Callable[[int, int], None]] = None) -> PplResult:
    """Non-overlapping windows of `window` tokens (the tokenizer's BOS first, as in training); every
    token but a window's first is a target. The same protocol as tools/mtp_acceptance.evaluate, so
    the training run's recorded perplexity is directly comparable. `progress(tokens done, total)`
    is called after each window."""
    if window < 2 or max_tokens < 2:
        raise InputError(f"window and max_tokens must be at least 2 (a window's first token only conditions), "
                         f"not {window} and {max_tokens}")
    ids = engine.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise InputError("the text is shorter than two tokens: nothing to score")
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
        if progress:
            progress(min(start + window, len(ids)), len(ids))
    nll = total_nll / count
    return PplResult(engine.config.precision, engine.backend.name, count, nll, math.exp(nll), np.concatenate(top1))


def baseline_of(model_dir: Path) -> tuple[Path, str]:
    """What a model's perplexity is compared with: for a directory `deepinfer quantize` wrote, the
    source checkpoint it recorded (at bf16), so the change includes the quantization's own error;
    otherwise (or when that source is gone) the directory's own weights at bf16, said plainly."""
    cfg = V.read_json(Path(model_dir) / "config.json", "model config", err=CheckpointError)
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    src = qc.get("source") if isinstance(qc, dict) else None
    src_path = src.get("path") if isinstance(src, dict) else None
    if not isinstance(src_path, str):
        return Path(model_dir), f"{model_dir} itself at bf16"
    if (Path(src_path) / "config.json").is_file():
        return Path(src_path), f"the source checkpoint {src_path} at bf16 (recorded by deepinfer quantize)"
    return Path(model_dir), (f"{model_dir}'s own quantized weights dequantized to bf16: its source checkpoint "
                             f"{src_path} is not here, so the quantization error itself is not measured")


def _progress_bar(label: str) -> Optional[Callable[[int, int], None]]:
    """A one-line progress report on stderr when it is a terminal (nothing in logs and pipes)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\rdeepinfer eval-ppl: {label}: {done}/{total} tokens ({100 * done // total}%)", end=end,
              file=sys.stderr, flush=True)
    return show


def main(args) -> int:
    model_dir = resolve_model_dir(args.model, getattr(args, "revision", None))
    text = heldout_text(model_dir, args.text)
    baseline_dir, baseline = baseline_of(model_dir)
    overrides = {"precision": args.precision}
    if args.backend:
        overrides["backend"] = args.backend
    eng = Engine.from_pretrained(model_dir, config=args.config, **overrides)
    res = perplexity(eng, text, args.max_tokens, args.window, _progress_bar(args.precision))
    out = {**res.as_dict(), "window": min(args.window, eng.config.max_seq_len)}
    if args.precision not in ("bf16", "f32") or baseline_dir != model_dir:
        ref_eng = Engine.from_pretrained(baseline_dir, config=args.config, **{**overrides, "precision": "bf16"})
        ref = perplexity(ref_eng, text, args.max_tokens, args.window, _progress_bar("bf16 baseline"))
        out["baseline"] = baseline
        out["bf16_ppl"] = ref.ppl
        out["ppl_change_pct"] = 100.0 * (res.ppl / ref.ppl - 1.0)
        out["top1_agreement_vs_bf16"] = float((res.top1 == ref.top1).mean())
    print(json.dumps(out, indent=2))
    return 0
