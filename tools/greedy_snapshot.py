"""Greedy token ids of the embedded model and the tiny family checkpoints, on the reference and CPU
backends, as JSON: the before/after check of a restructuring that must not change what is computed.

    python tools/greedy_snapshot.py --out before.json          # on the old tree
    python tools/greedy_snapshot.py --out after.json --compare before.json

The tiny checkpoints are written by tests/tiny_checkpoints.py and tests/tiny_v4.py with fixed seeds,
so two runs on two trees see the same weights. Paths covered: each precision the CPU backend runs
on the embedded model, batched prompts, the expert cache (streamed, pauses) and MTP speculation.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the tiny checkpoint writers

import tiny_checkpoints as tc  # noqa: E402
import tiny_v4  # noqa: E402
from deepinfer.engine import Engine, default_model_dir  # noqa: E402

NANO_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]
TINY_PROMPTS = [[0, 5, 9, 17, 33, 2, 80], [0, 7], [0, 200, 3, 3, 3, 41, 12, 9, 100, 101, 102]]
NEW = 24


def nano_cases():
    model = default_model_dir()
    base = {"max_batch": 4, "max_seq_len": 256}
    for backend in ("reference", "cpu"):
        for precision in ("f32", "bf16", "int8", "int4", "w8a8"):
            if backend == "reference" and precision in ("int4", "w8a8"):
                continue    # slow on the oracle; int8 covers its quantized path
            yield f"nano/{backend}/{precision}", model, {**base, "backend": backend, "precision": precision}
        yield f"nano/{backend}/expert_cache", model, {
            **base, "backend": backend, "precision": "f32", "expert_cache": {"capacity": 0.5}}
        yield f"nano/{backend}/mtp", model, {
            **base, "backend": backend, "precision": "f32", "speculative": {"method": "mtp", "num_draft": 2}}


def tiny_cases(tmp: Path):
    for family in ("v2", "v2lite", "v3", "v32", "v3fp8"):
        d = tmp / family
        tc.make(family, d, seed=0)
        tc.add_tokenizer(d)
        for backend in ("reference", "cpu"):
            yield f"{family}/{backend}", d, {"backend": backend, "max_batch": 4, "max_seq_len": 128}
    d = tmp / "v4"
    tiny_v4.make(d, seed=0, layout="deepseek", mtp=True)
    tc.add_tokenizer(d)
    for backend in ("reference", "cpu"):
        yield f"v4/{backend}", d, {"backend": backend, "max_batch": 4, "max_seq_len": 128}
        yield f"v4/{backend}/mtp", d, {"backend": backend, "max_batch": 4, "max_seq_len": 128,
                                       "speculative": {"method": "mtp", "num_draft": 2}}


def run_case(model_dir: Path, config: dict, prompts) -> list:
    engine = Engine.from_pretrained(model_dir, config=config)
    try:
        ids = prompts if isinstance(prompts[0], list) else [engine.tokenizer.encode(p) for p in prompts]
        return engine.generate_ids(ids, max_new_tokens=NEW, ignore_eos=True)
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="an earlier snapshot: exit 1 when any case differs")
    ap.add_argument("--only", help="run only cases whose name contains this")
    args = ap.parse_args()
    snap = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(n, d, c, NANO_PROMPTS) for n, d, c in nano_cases()]
        cases += [(n, d, c, TINY_PROMPTS) for n, d, c in tiny_cases(Path(tmp))]
        for name, model_dir, config, prompts in cases:
            if args.only and args.only not in name:
                continue
            snap[name] = run_case(model_dir, config, prompts)
            print(f"{name}: {[len(s) for s in snap[name]]}", file=sys.stderr)
    Path(args.out).write_text(json.dumps(snap, indent=1))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    names = sorted(set(snap) if args.only else set(before) | set(snap))
    bad = [k for k in names if before.get(k) != snap.get(k)]
    for k in bad:
        print(f"DIFFERS: {k}", file=sys.stderr)
    print(f"{len(names) - len(bad)} of {len(names)} cases identical", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
