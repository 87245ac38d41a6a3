"""Greedy generation of the embedded model on two backends, token for token (issue: the CUDA
backend's greedy output must equal the CPU backend's for at least 64 tokens, or differ only where
the documented tolerances allow). Prints the first divergence and the logit margin there.

    python backends/cuda/compare_greedy.py LIB_A LIB_B [--tokens 64] [--activation-dtype f32]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from deepinfer.engine import Engine, default_model_dir

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "# Copyright"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib_a")
    ap.add_argument("lib_b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--activation-dtype", default="f32")
    args = ap.parse_args()
    cfg = {"precision": args.precision, "activation_dtype": args.activation_dtype, "max_batch": 4,
           "max_seq_len": 256}
    ea = Engine.from_pretrained(default_model_dir(), config={**cfg, "backend": args.lib_a})
    eb = Engine.from_pretrained(default_model_dir(), config={**cfg, "backend": args.lib_b})
    report = {"a": ea.backend.name, "b": eb.backend.name, "precision": args.precision,
              "activation_dtype": args.activation_dtype, "rows": []}
    ok = True
    for p in PROMPTS:
        ids = ea.tokenizer.encode(p)
        ta = ea.generate_ids([ids], max_new_tokens=args.tokens)[0]
        tb = eb.generate_ids([ids], max_new_tokens=args.tokens)[0]
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        row = {"prompt": p, "tokens": len(ta), "equal": ta == tb, "first_divergence": first}
        if first is not None:
            ctx = ids + ta[:first]
            la, lb = ea.runner.score(ctx)[-1], eb.runner.score(ctx)[-1]
            top = np.sort(la)[-2:]
            row["margin_at_divergence"] = float(top[1] - top[0])
            row["max_logit_diff_there"] = float(np.abs(la - lb).max())
        ids_all = ids + ta
        row["max_rel_logit_diff_over_sequence"] = float(
            np.abs(ea.runner.score(ids_all) - eb.runner.score(ids_all)).max() / np.abs(ea.runner.score(ids_all)).max())
        ok &= ta == tb
        report["rows"].append(row)
        print(json.dumps(row))
    report["all_equal"] = ok
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
