"""Regenerates benchmarks/results/accuracy_nano.{md,json}: held-out perplexity of the embedded model
for every precision path, top-1 agreement against the bf16 path, transformers' perplexity on the
same windows as the cross-check, and the unigram baseline from the training run.

    python tools/accuracy_table.py [--backend cpu] [--max-tokens 16384] [--window 256]
    python tools/accuracy_table.py --package-only    # only rewrite the packaged copy (below)

It also writes the copy the engine ships, runtime/deepinfer/assets/accuracy_costs.json: the rows of
the paths `precision` can select, which precision.py uses to rank paths by accuracy and to quote
the cost of a lossy choice. tests/test_precision.py checks that the two agree.

Paths quantized at load (`precision=...` in the engine config) and paths written by
`deepinfer quantize` (asymmetric int4, calibrated clip search) are both measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import deepinfer
from deepinfer.engine import Engine, default_model_dir
from deepinfer.evaluate import heldout_text, perplexity

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
PACKAGED = ROOT / "runtime" / "deepinfer" / "assets" / "accuracy_costs.json"

# (label, engine precision, group size, quantize-command format or None, extra quantize args)
ROWS = [
    ("f32 (weights widened)", "f32", 64, None, {}),
    ("bf16 (as stored)", "bf16", 64, None, {}),
    ("fp8 e4m3 128x128", "fp8", 64, None, {}),
    ("int8 per-channel", "int8", 64, None, {}),
    ("w8a8 (int8 x int8)", "w8a8", 64, None, {}),
    ("int4 g32 sym", "int4", 32, None, {}),
    ("int4 g64 sym", "int4", 64, None, {}),
    ("int4 g128 sym", "int4", 128, None, {}),
    ("w4a8 g64 (int4 x int8)", "w4a8", 64, None, {}),
    ("int4 g64 asym (deepinfer quantize)", None, 64, "int4", {"symmetric": False}),
    ("int4 g64 sym + clip search (deepinfer quantize)", None, 64, "int4", {}),
]


def cost_table(results: dict) -> dict:
    """The packaged accuracy table from accuracy_nano.json: one row per load-time precision path
    (precision, int4 group or None, perplexity change and top-1 agreement against bf16)."""
    labels = {label: (precision, group) for label, precision, group, qformat, _ in ROWS if qformat is None}
    paths = []
    for row in results["rows"]:
        if row["path"] not in labels:
            continue
        precision, group = labels[row["path"]]
        paths.append({"precision": precision, "group": group if precision in ("int4", "w4a8") else None,
                      "ppl_change_pct": round(row["ppl_change_vs_bf16_pct"], 4),
                      "top1_agreement": round(row["top1_agreement_vs_bf16"], 4)})
    meta = results["meta"]
    return {"source": f"benchmarks/results/accuracy_nano.json, embedded model, {meta['tokens']} held-out tokens, "
                      f"{meta['backend']} backend, {meta['date']} commit {meta['commit']}",
            "paths": paths}


def write_packaged(results: dict) -> None:
    PACKAGED.write_text(json.dumps(cost_table(results), indent=2) + "\n")


def transformers_ppl(model_dir: Path, ids: list[int], window: int, dtype: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    m.eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), window):  # the windows of deepinfer.evaluate.perplexity
            c = ids[s:s + window]
            if len(c) < 2:
                break
            lp = torch.log_softmax(m(torch.tensor([c[:-1]])).logits[0].double(), -1)
            t = torch.tensor(c[1:])
            nll -= lp[torch.arange(len(t)), t].sum().item()
            n += len(t)
    return math.exp(nll / n)


TINY_FAMILIES = ("v2", "v2lite", "v3")
TINY_PRECISIONS = ("f32", "fp8", "int8", "w8a8", "int4", "w4a8")


def tiny_logit_errors(backend_name: str) -> dict:
    """Max |logit error| / max |logit| of each precision path on the transformers-generated tiny
    checkpoints of the tests, against transformers in f32 on the same (unquantized) weights."""
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_checkpoints

    from deepinfer.config import EngineConfig
    from deepinfer.loader import get_backend
    from deepinfer.engine import load_runner

    be = get_backend(backend_name)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in TINY_FAMILIES:
            d, hf, _ = tiny_checkpoints.make(fam, Path(tmp) / fam)
            ids = torch.randint(3, hf.config.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ref = hf(ids[None]).logits[0].double().numpy()
            out[fam] = {}
            for p in TINY_PRECISIONS:
                m = load_runner(d, be, EngineConfig(precision=p, group_size=32, max_batch=1, max_seq_len=64))
                got = m.score(ids.tolist())
                out[fam][p] = float(np.abs(got - ref).max() / np.abs(ref).max())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--package-only", action="store_true", help="rewrite the packaged copy from the committed table")
    args = ap.parse_args()
    if args.package_only:
        write_packaged(json.loads((OUT / "accuracy_nano.json").read_text()))
        print(f"wrote {PACKAGED}")
        return 0

    model_dir = default_model_dir()
    text = heldout_text(model_dir)
    training = json.loads((model_dir / "training.json").read_text())
    results, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for label, precision, group, qformat, qargs in ROWS:
            src = model_dir
            if qformat is not None:
                from deepinfer.quantizer import quantize_model

                src = Path(tmp) / label.replace(" ", "_").replace("(", "").replace(")", "")
                quantize_model(model_dir, src, qformat, group=group, **qargs)
                precision = "auto"
            cfg = {"backend": args.backend, "precision": precision, "group_size": group,
                   "max_seq_len": args.window + 8, "max_batch": 1}
            t0 = time.perf_counter()
            eng = Engine.from_pretrained(src, config=cfg)
            r = perplexity(eng, text, args.max_tokens, args.window)
            row = {"path": label, "precision_note": eng.runner.precision_note, "tokens": r.tokens,
                   "ppl": r.ppl, "seconds": time.perf_counter() - t0}
            if label.startswith("bf16"):
                base = r
            results.append((row, r))
            print(f"{label:48s} ppl {r.ppl:8.4f}")
    for row, r in results:
        row["ppl_change_vs_bf16_pct"] = 100.0 * (r.ppl / base.ppl - 1.0)
        row["top1_agreement_vs_bf16"] = float((r.top1 == base.top1).mean())
    ids = Engine.from_pretrained(model_dir, config={"backend": "reference", "max_batch": 1}).tokenizer.encode(
        text)[: args.max_tokens]
    hf = {} if args.skip_hf else {d: transformers_ppl(model_dir, ids, args.window, d) for d in ("float32", "bfloat16")}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"date": datetime.date.today().isoformat(), "commit": commit, "backend": args.backend,
            "machine": platform.processor() or platform.machine(), "deepinfer": deepinfer.__version__,
            "tokens": results[0][1].tokens, "window": args.window,
            "transformers_ppl": hf, "unigram_ppl": training.get("metrics", {}).get("unigram_ppl")
            or training.get("unigram_ppl")}
    meta["tiny_logit_rel_error"] = tiny = tiny_logit_errors(args.backend)
    OUT.mkdir(parents=True, exist_ok=True)
    table = {"meta": meta, "rows": [r for r, _ in results]}
    (OUT / "accuracy_nano.json").write_text(json.dumps(table, indent=2))
    write_packaged(table)
    lines = [f"# Held-out perplexity of the embedded model per precision path",
             "",
             f"{meta['date']}, commit {commit}, backend `{args.backend}`, {meta['tokens']} held-out tokens in "
             f"windows of {args.window}. Regenerate: `python tools/accuracy_table.py`.",
             "",
             "| path | ppl | vs bf16 | top-1 agreement vs bf16 |",
             "|---|---|---|---|"]
    for row, _ in results:
        lines.append(f"| {row['path']} | {row['ppl']:.4f} | {row['ppl_change_vs_bf16_pct']:+.2f}% | "
                     f"{100 * row['top1_agreement_vs_bf16']:.2f}% |")
    lines.append("")
    for d, v in hf.items():
        lines.append(f"- transformers ({d} weights->compute, same windows): ppl {v:.4f}")
    if meta["unigram_ppl"]:
        lines.append(f"- unigram baseline (training-split token frequencies): ppl {meta['unigram_ppl']:.1f}")
    lines += ["", "## Logit error on the transformers-generated tiny checkpoints", "",
              "max |logit - transformers f32| / max |logit| on 48 random tokens (int4 groups of 32; the tests' "
              "checkpoints are 64 wide). These random-weight models are chaotic: a small weight error flips "
              "expert routing, so quantized rows measure that sensitivity, not the kernels. The kernels are held "
              "to 1e-4 against an f32 model carrying the same dequantized weights in tests/test_model_precision.py.", "",
              "| family | " + " | ".join(TINY_PRECISIONS) + " |", "|---|" + "---|" * len(TINY_PRECISIONS)]
    for fam, row in tiny.items():
        lines.append(f"| {fam} | " + " | ".join(f"{row[p]:.1e}" for p in TINY_PRECISIONS) + " |")
    (OUT / "accuracy_nano.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
