"""What a grammar-constrained decode step costs against an unconstrained one (issue 46's target: at most
10% more at batch 16), on the CPU backend with the embedded model or on a GPU with the V2-Lite shape.

    PYTHONPATH=runtime python3 benchmarks/bench_structured_step.py [--backend cpu|LIB.so] [--model DIR]
        [--batch 16] [--steps 48] [--out-dir benchmarks/results --commit SHA]

B requests decode together (sampled at temperature 1, the same seeds in every configuration); the
step time is the median wall time of engine.step() once every request is decoding, so it holds the
model's forward, the sample op (with ABI 1.7's token_mask for the constrained rows) and the engine's
bookkeeping, including the matchers' consumption of each token. The constrained configurations use
grammars that cannot finish within the measured steps (a JSON string of at least 4000 characters; a
JSON array of at least 1000 objects with an integer and an enum), so every step is constrained;
regex_anything allows every token, so its rows write exactly the unconstrained tokens and the
difference from "none" is the machinery alone (the others also change which experts the tokens route
to, which moves a MoE step's time either way). The
engine's own counters say how long the mask fills took (on the constraints' worker, while the model
ran) and how long the step loop waited for them after the forward: that wait is what the overlap did
not hide.

--model: a checkpoint directory (default: the embedded model). --v2-lite N: build the random
DeepSeek-V2-Lite-shaped checkpoint of N layers the GPU benchmarks use (bench_gpu_prefill_profile's
make_checkpoint, transformers needed), with the embedded tokenizer copied in (its vocabulary is
smaller than the model's: the ids past it are never allowed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from deepinfer.engine import Engine, default_model_dir  # noqa: E402

GRAMMARS = {
    "none": None,
    "json_long_string": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}},
    "json_object_array": {"type": "json_schema", "schema": {
        "type": "array", "minItems": 1000, "items": {
            "type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["alpha", "beta", "gamma"]}},
            "required": ["id", "kind"], "additionalProperties": False}}},
    "regex_words": {"type": "regex", "pattern": "([a-z]+ ){500,}"},
    # every token allowed: the same tokens as "none" (same seeds, same distribution), so the difference
    # is the constraint machinery alone, not what the grammar makes the model write
    "regex_anything": {"type": "regex", "pattern": "(?s:.{0,100000})"},
}
PROMPT = "Write the answer as JSON.\n"


def v2_lite_checkpoint(layers: int, out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from bench_gpu_prefill_profile import make_checkpoint

    if not (out / "config.json").exists():
        make_checkpoint(out, layers, "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / f, out / f)
    return out


def run_config(engine: Engine, spec, B: int, steps: int, warm: int) -> dict:
    opts = dict(max_new_tokens=warm + steps + 8, ignore_eos=True, temperature=1.0)
    if spec is not None:
        opts["structured"] = spec
    engine.constraints.stats.update(masks=0, mask_s=0.0, wait_s=0.0)
    rids = [engine.add_request(PROMPT, seed=i, **opts) for i in range(B)]
    times = []
    n = 0
    while any(engine.is_running(r) for r in rids):
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        decoding = engine.scheduler.last_kind == "decode"
        if decoding:
            n += 1
            if warm < n <= warm + steps:
                times.append(dt)
        if n >= warm + steps:
            for r in rids:
                engine.abort(r)
        assert all(o.finish_reason != "error" for o in outs)
    st = dict(engine.constraints.stats)
    return {"step_ms": 1e3 * statistics.median(times), "steps": len(times),
            "mask_ms_per_step": 1e3 * st["mask_s"] / max(st["masks"], 1),
            "mask_wait_ms_per_step": 1e3 * st["wait_s"] / max(st["masks"], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--v2-lite", type=int, default=0, metavar="LAYERS")
    ap.add_argument("--ckpt-dir", default="/tmp/structured_ckpt")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="each configuration this many times, interleaved")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--machine", default="")
    a = ap.parse_args()
    model = Path(a.model) if a.model else (v2_lite_checkpoint(a.v2_lite, Path(a.ckpt_dir)) if a.v2_lite
                                           else default_model_dir())
    cfg = {"backend": a.backend, "max_batch": a.batch, "max_seq_len": 1024}
    engine = Engine.from_pretrained(model, config=cfg)
    rows = {name: [] for name in GRAMMARS}
    for _ in range(a.repeats):
        for name, spec in GRAMMARS.items():
            rows[name].append(run_config(engine, spec, a.batch, a.steps, a.warm))
    base = min(r["step_ms"] for r in rows["none"])
    print(f"backend {engine.backend.name}, model {model.name}, batch {a.batch}, {a.steps} steps after {a.warm}")
    print(f"{'grammar':20s} {'step ms':>9s} {'vs none':>8s} {'mask ms':>8s} {'wait ms':>8s}")
    table = []
    for name, rs in rows.items():
        best = min(rs, key=lambda r: r["step_ms"])
        r = dict(best, grammar=name, ratio=best["step_ms"] / base, all_step_ms=[x["step_ms"] for x in rs])
        table.append(r)
        print(f"{name:20s} {r['step_ms']:9.2f} {r['ratio']:8.3f} {r['mask_ms_per_step']:8.3f} "
              f"{r['mask_wait_ms_per_step']:8.3f}")
    if a.out_dir:
        date = datetime.date.today().isoformat()
        out = Path(a.out_dir) / f"structured_step_{date.replace('-', '')}_{engine.backend.name}.json"
        out.write_text(json.dumps({"date": date, "commit": a.commit, "machine": a.machine,
                                   "backend": engine.backend.name, "model": model.name, "batch": a.batch,
                                   "rows": table}, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
