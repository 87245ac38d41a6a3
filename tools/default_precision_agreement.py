"""How often the engine's default precision reproduces a bf16 checkpoint's own greedy text, against
`precision: "fastest"`: greedy continuations on tiny bf16 checkpoints (the v3bf16 test family and
every published V2/V3 release config shrunk to tiny dims, stored in bf16) compared token for token
with transformers running the same bf16 weights in f32 arithmetic.

    python tools/default_precision_agreement.py [--backend cpu] [--new 12]

Writes benchmarks/results/default_precision_agreement_<date>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_checkpoints as T  # noqa: E402

import deepinfer  # noqa: E402

UNSUPPORTED = ("deepseek-v3.2-exp", "deepseek-v4-flash")
PROMPTS = ["t5 t17 t200 t3 t99", "t42 t7 t130 t64 t11 t250", "t8 t31 t77", "t100 t101 t102 t103"]


def bf16_checkpoints(tmp: Path):
    """(name, dir) of tiny bf16 checkpoints, each with a word-level tokenizer."""
    d, _, _ = T.make("v3bf16", tmp / "v3bf16")
    T.add_tokenizer(d)
    yield "v3bf16", d
    for name in sorted(p.stem for p in T.HUB_CONFIGS.glob("deepseek-*.json") if p.stem not in UNSUPPORTED):
        d, m = T.make_from_hub_config(name, tmp / name)
        m.to(torch.bfloat16).save_pretrained(d)   # the same weights stored in bf16
        T.add_tokenizer(d)
        yield name, d


def greedy_f32(d: Path, ids, n, eos):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    return T.transformers_greedy(m, ids, n, eos)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--new", type=int, default=12)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, d in bf16_checkpoints(Path(tmp)):
            engines = {p: deepinfer.load(str(d), config={"backend": args.backend, "precision": p})
                       for p in ("auto", "fastest")}
            for prompt in PROMPTS:
                tok = engines["auto"].tokenizer
                ids = tok.encode(prompt)
                want = greedy_f32(d, ids, args.new, engines["auto"].model.eos_token_id)
                row = {"checkpoint": name, "prompt": prompt, "transformers_f32": want}
                for p, eng in engines.items():
                    got = eng.generate_ids([ids], max_new_tokens=args.new)[0]
                    got = got[:-1] if got and got[-1] in eng.eos_ids else got
                    row[p] = {"precision": eng.runner.precision, "match": got == want,
                              "agree_prefix": next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                                   min(len(got), len(want)))}
                rows.append(row)
            shutil.rmtree(d)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    summary = {p: sum(r[p]["match"] for r in rows) for p in ("auto", "fastest")}
    meta = {"date": date, "commit": commit, "backend": args.backend, "machine": platform.processor() or
            platform.machine(), "new_tokens": args.new, "cases": len(rows), "matches": summary,
            "precisions": {p: sorted({r[p]["precision"] for r in rows}) for p in ("auto", "fastest")}}
    out = ROOT / "benchmarks" / "results" / f"default_precision_agreement_{date.replace('-', '')}"
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Greedy text of bf16 checkpoints: default precision vs fastest", "",
             f"{date}, commit {commit}, backend `{args.backend}`, {len(rows)} cases ({len(PROMPTS)} prompts x "
             f"{len(rows) // len(PROMPTS)} tiny bf16 checkpoints), {args.new} greedy tokens each, against "
             f"transformers on the same bf16 weights in f32. Regenerate: `python tools/default_precision_agreement.py`.",
             "", "| precision policy | chosen | cases matching transformers token for token |", "|---|---|---|"]
    for p in ("auto", "fastest"):
        lines.append(f"| {p} | {', '.join(meta['precisions'][p])} | {summary[p]} of {len(rows)} |")
    (out.with_suffix(".md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
