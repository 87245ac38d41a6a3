"""Host cost of structured-output masks: fill_masks for a batch of constrained requests per decode
step, on llguidance's thread pool (parallel=True) and row by row (parallel=False), on the CPU only.

    python benchmarks/bench_structured_masks.py [--batch 16] [--steps 200] [--tokenizer DIR] [--vocab-size N]

Each spec gets `batch` matchers that walk at random (a uniformly chosen allowed token each step, eos
with probability 0.1 when allowed; a finished row restarts), so the masks are those of real mid-output
states: inside strings, between keys, in numbers. The default tokenizer is the embedded nano model's
(4096 tokens); mask cost grows with the vocabulary, so pass a real model's directory (--tokenizer)
for its numbers. Prints a table; writes nothing. Not a test: the numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# this checkout's deepinfer, even where an editable install of another checkout would redirect imports
sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]
sys.path.insert(0, str(ROOT / "runtime"))
NANO = ROOT / "runtime/deepinfer/assets/deepseek-v3-nano"

SPECS = {
    "json_object": {"type": "json_object"},
    "flat_object": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}},
    "answer_with_sources": {"type": "json_schema", "schema": {
        "type": "object", "additionalProperties": False, "required": ["answer", "confidence", "sources"],
        "properties": {"answer": {"type": "string"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                       "sources": {"type": "array", "items": {"type": "string", "format": "uri"}, "maxItems": 5}}}},
    "formats_and_enums": {"type": "json_schema", "schema": {
        "type": "object", "additionalProperties": False, "required": ["id", "at", "email", "level"],
        "properties": {"id": {"type": "string", "format": "uuid"}, "at": {"type": "string", "format": "date-time"},
                       "email": {"type": "string", "format": "email"},
                       "level": {"enum": ["debug", "info", "warning", "error"]}}}},
    "regex_phone": {"type": "regex", "pattern": r"\+?[0-9]{1,3}-[0-9]{3}-[0-9]{4}"},
    "choice_1000": {"type": "choice", "choices": [f"option {i}" for i in range(1000)]},
}


def bits_of(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def bench(compiler, spec, batch: int, steps: int, eos: int, rng) -> dict:
    from deepinfer.engine.structured import fill_masks, mask_words

    t0 = time.perf_counter()
    grammar = compiler.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    matchers = [grammar.matcher() for _ in range(batch)]
    words = mask_words(compiler.vocab_size)
    par, one = np.zeros((batch, words), np.int32), np.zeros((batch, words), np.int32)
    t_par, t_one = [], []
    for step in range(steps):
        # alternate the order: whichever runs second must not look faster for a warm cache
        for parallel in ((True, False) if step % 2 else (False, True)):
            (t_par if parallel else t_one).append(fill_masks(matchers, par if parallel else one, parallel=parallel))
        assert np.array_equal(par, one)
        for i, m in enumerate(matchers):
            ids = bits_of(par[i])
            others = ids[ids != eos]
            if others.size == 0 or (others.size < ids.size and rng.random() < 0.1):
                matchers[i] = grammar.matcher()     # finished: a new request takes the row
            else:
                m.accept(int(rng.choice(others)))
    p, s = np.asarray(t_par) * 1e6, np.asarray(t_one) * 1e6
    return {"compile_ms": compile_ms, "par_mean": p.mean(), "par_p50": np.median(p), "par_p99": np.percentile(p, 99),
            "serial_mean": s.mean(), "serial_p50": np.median(s), "serial_p99": np.percentile(s, 99)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokenizer", type=Path, default=NANO, help="a model directory with tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=None, help="the logits width (default: the tokenizer's)")
    args = ap.parse_args(argv)

    from deepinfer.engine import Tokenizer
    from deepinfer.engine.structured import PARALLEL_MIN_CPUS, StructuredCompiler

    tok = Tokenizer(args.tokenizer)
    vocab = args.vocab_size or tok.vocab_size
    compiler = StructuredCompiler(tok, vocab, [tok.eos_id])
    print(f"tokenizer {args.tokenizer.name} ({tok.vocab_size} tokens), logits width {vocab}, batch {args.batch}, "
          f"{args.steps} steps, {os.cpu_count()} CPUs (fill_masks's default here: "
          f"{'parallel' if (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS else 'serial'}); us per step of the batch")
    head = (f"{'spec':22s} {'compile ms':>10s} | {'parallel mean':>13s} {'p50':>7s} {'p99':>7s} | "
            f"{'serial mean':>11s} {'p50':>7s} {'p99':>7s}")
    print(head + "\n" + "-" * len(head))
    rng = np.random.default_rng(0)
    for name, spec in SPECS.items():
        r = bench(compiler, spec, args.batch, args.steps, tok.eos_id, rng)
        print(f"{name:22s} {r['compile_ms']:10.1f} | {r['par_mean']:13.1f} {r['par_p50']:7.1f} {r['par_p99']:7.1f} | "
              f"{r['serial_mean']:11.1f} {r['serial_p50']:7.1f} {r['serial_p99']:7.1f}")


if __name__ == "__main__":
    main()
