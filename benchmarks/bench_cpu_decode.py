"""Decode throughput of deepinfer's CPU backend against transformers on the same checkpoint.

    PYTHONPATH=runtime python benchmarks/bench_cpu_decode.py [--model DIR] [--lib libdeepinfer_cpu.so]
        [--batch 1 4] [--prompt-len 32] [--steps 32] [--threads N] [--json out.json]

Default model: the embedded runtime/deepinfer/assets/deepseek-v3-nano (a generated tiny V3
checkpoint when that is absent). Both sides run f32 activations on the same weights and the same
thread count; transformers decodes through its own KV cache. Also reports the plan's arena bytes
against the sum of all activations, and the largest logit difference between the two as a sanity
check (for quantized precisions it measures quantization error, not a bug). Not a test: numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
NANO = ROOT / "runtime/deepinfer/assets/deepseek-v3-nano"
LIB_GUESSES = ["/tmp/build/backends/cpu/libdeepinfer_cpu.so", str(ROOT / "build/backends/cpu/libdeepinfer_cpu.so")]


def find_model(arg):
    if arg:
        return Path(arg)
    if (NANO / "config.json").is_file():
        return NANO
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_checkpoints

    out = Path(tempfile.mkdtemp(prefix="bench_v3_")) / "v3"
    tiny_checkpoints.make("v3", out)
    return out


def bench_ours(model_dir, lib, batch, prompt_len, steps, threads, precision=None):
    import numpy as np

    import deepinfer
    from deepinfer.engine import ModelRunner, PlanKey, RunnerConfig

    be = deepinfer.loader.load_library(lib, num_threads=threads) if lib else deepinfer.get_backend("cpu",
                                                                                                  num_threads=threads)
    m = ModelRunner(model_dir, be, RunnerConfig(max_batch=batch, max_seq_len=prompt_len + steps + 8, dtype="f32",
                                                precision=precision))
    V = m.cfg.vocab_size
    prompts = [[(7 * r + 13 * i) % V for i in range(prompt_len)] for r in range(batch)]
    sids = [m.new_sequence() for _ in range(batch)]
    t0 = time.perf_counter()
    logits = m.forward(sids, prompts, [0] * batch)
    t1 = time.perf_counter()
    first = be.to_numpy(logits)
    toks = m.sample(logits, temperature=[0.0] * batch)
    # one warm-up decode step traces and binds the decode plan
    logits = m.forward(sids, [[t] for t in toks], [prompt_len] * batch)
    toks = m.sample(logits, temperature=[0.0] * batch)
    t2 = time.perf_counter()
    for s in range(1, steps):
        logits = m.forward(sids, [[t] for t in toks], [prompt_len + s] * batch)
        toks = m.sample(logits, temperature=[0.0] * batch)
    t3 = time.perf_counter()
    plan = m.plans[PlanKey("main", "decode", batch, batch)]
    pre = m.plans[PlanKey("main", "prefill", batch * prompt_len, batch)]
    return {
        "prefill_s": t1 - t0, "decode_tok_s": batch * (steps - 1) / (t3 - t2),
        "decode_arena_bytes": plan.arena_bytes, "decode_total_activation_bytes": plan.total_activation_bytes,
        "prefill_arena_bytes": pre.arena_bytes, "prefill_total_activation_bytes": pre.total_activation_bytes,
        "kv_cache_bytes": m.kv.nbytes, "first_logits": first, "prompts": prompts, "backend": be.name,
    }


def bench_hf(model_dir, prompts, steps, threads):
    import torch
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()   # it reports the MTP layer it does not load as unexpected
    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = m(input_ids=ids, use_cache=True)
        t1 = time.perf_counter()
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        first = out.logits[:, -1].float().numpy()
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        out = m(input_ids=nxt, cache=cache, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
        for _ in range(1, steps):
            out = m(input_ids=nxt, cache=cache, use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t3 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_tok_s": len(prompts) * (steps - 1) / (t3 - t2), "first_logits": first}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--lib", default=os.environ.get("DEEPINFER_CPU_LIB") or next(
        (p for p in LIB_GUESSES if Path(p).is_file()), None))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--precision", nargs="+", default=["f32"],
                    help="weight precisions of deepinfer to run (f32 bf16 int8 int4 w8a8 w4a8 fp8)")
    ap.add_argument("--json", default="bench_cpu_decode.json")
    a = ap.parse_args(argv)
    import numpy as np

    model_dir = find_model(a.model)
    rows = []
    for b in a.batch:
        hf = None
        for prec in a.precision:
            ours = bench_ours(model_dir, a.lib, b, a.prompt_len, a.steps, a.threads, prec)
            prompts = ours.pop("prompts")
            if hf is None:
                hf = bench_hf(model_dir, prompts, a.steps, a.threads)
                hf_first = hf.pop("first_logits")
            diff = float(np.abs(ours.pop("first_logits") - hf_first).max())
            rows.append({"batch": b, "precision": prec, "ours": ours, "transformers": hf, "max_logit_diff": diff,
                         "speedup": ours["decode_tok_s"] / hf["decode_tok_s"]})
    print(f"model: {model_dir}  threads: {a.threads}  prompt: {a.prompt_len}  decode steps: {a.steps}")
    print(f"{'batch':>5} {'precision':>9} {'deepinfer tok/s':>16} {'transformers tok/s':>19} {'speedup':>8} {'max |dlogit|':>13} "
          f"{'arena KiB':>10} {'all acts KiB':>13}")
    for r in rows:
        o = r["ours"]
        print(f"{r['batch']:>5} {r['precision']:>9} {o['decode_tok_s']:>16.1f} {r['transformers']['decode_tok_s']:>19.1f} "
              f"{r['speedup']:>8.2f} {r['max_logit_diff']:>13.2e} {o['decode_arena_bytes'] / 1024:>10.1f} "
              f"{o['decode_total_activation_bytes'] / 1024:>13.1f}")
    Path(a.json).write_text(json.dumps({"model": str(model_dir), "threads": a.threads, "prompt_len": a.prompt_len,
                                        "steps": a.steps, "rows": rows}, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
