"""Where the time of an end-to-end prefill goes, per ABI op, on a backend library: a DeepSeek-V2-Lite
shaped model with random weights, prefilled with B sequences of T random tokens.

    PYTHONPATH=runtime python3 benchmarks/bench_gpu_prefill_profile.py LIB --commit SHA \
        --out benchmarks/results/gpu_prefill_profile_<date>.json \
        [--layers 8] [--prompt-tokens 128] [--batches 1,32] [--dtype bf16] [--repeats 3] [--no-peer]

    # on a machine without a GPU, against the CPU library (f32 activations):
    PYTHONPATH=runtime python3 benchmarks/bench_gpu_prefill_profile.py /tmp/build/backends/cpu/libdeepinfer_cpu.so \
        --out /tmp/prefill.json --layers 2 --prompt-tokens 16 --batches 1,2 --dtype f32

The model is the published DeepSeek-V2-Lite config.json (tests/data/hub_configs/deepseek-v2-lite.json:
hidden 2048, 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, no q-LoRA, 64 routed
experts top-6 + 2 shared, moe_intermediate 1408, a dense first layer of intermediate 10944, vocab
102400, yarn rope) truncated to --layers layers. transformers builds it (bf16 on cuda when torch sees
a GPU, else f32 on the CPU), the weights are re-drawn at unit scale by tests/tiny_checkpoints._redraw,
and save_pretrained writes it as safetensors to a temporary directory, which deepinfer loads on LIB
(ModelRunner, activations --dtype, weights as stored).

Per batch size B, after one warm-up prefill (it traces and binds the plan):
  - wall_ms: the median over --repeats prefills of model.forward (B sequences of T tokens from
    position 0, last-token logits), synchronized at both ends: the real figure;
  - profiled_wall_ms and per-op times: the same prefill with every plan step timed alone. Each op
    a plan runs is bound once by backend.prepare(op, **kwargs) (Plan.run calls it); the script wraps
    that method on the backend object, so each bound call synchronizes the backend's stream
    (backend.synchronize: stream_synchronize on the default stream, which plan steps run on),
    starts a clock, runs, synchronizes again and adds the time to its op. Per-op ms are summed over
    the prefill (the mean of --repeats profiled prefills) with their call counts, grouped into
    categories (linear / attention / experts / other), and linear is also split by weight (q,
    kv_a, kv_b, o, mlp.*, shared.*, router, lm_head). unattributed_ms is profiled wall minus the
    ops: host work between ops (input uploads, the plan loop, the per-op synchronizations);
  - hf_ms: transformers' DeepseekV2ForCausalLM (its default attention and experts implementations,
    recorded in the JSON) on the same weights and the same B x T token ids, no cache, last-token
    logits (logits_to_keep=1): median of --repeats forwards after a warm-up. An error is recorded
    instead when it cannot run.
No correctness check: tests/test_model_oracle.py does that at tiny sizes. Numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_checkpoints  # noqa: E402  (the published configs and the weight re-draw of the tests)

from deepinfer.loader import load_library  # noqa: E402
from deepinfer.engine.model_runner import ModelRunner  # noqa: E402
from deepinfer.engine.plan_key import PlanKey, bucket  # noqa: E402
from deepinfer.engine.runner_config import RunnerConfig  # noqa: E402
from deepinfer.model import Checkpoint  # noqa: E402
from deepinfer.tensor import Tensor  # noqa: E402

HUB_CONFIG = "deepseek-v2-lite"
CATEGORIES = {"linear": ("linear",), "attention": ("mla_prefill", "mla_decode", "mla_cache_write", "rope"),
              "experts": ("moe_experts", "moe_router")}
TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def category(op: str) -> str:
    return next((c for c, ops in CATEGORIES.items() if op in ops), "other")


# ---------------------------------------------------------------------------- the checkpoint


def hf_config(layers: int):
    """The published V2-Lite config with `layers` layers (layer 0 dense, the rest MoE)."""
    from transformers import AutoConfig

    d = json.loads((tiny_checkpoints.HUB_CONFIGS / f"{HUB_CONFIG}.json").read_text())
    d.pop("auto_map", None)   # transformers' own classes, not the hub's remote code
    d["num_hidden_layers"] = layers
    return AutoConfig.for_model(d.pop("model_type"), **d)


def make_checkpoint(out: Path, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """Build the random model with transformers on `device`, write it to `out`; returns the model."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = hf_config(layers)
    torch.manual_seed(seed)
    with torch.device(device), torch.no_grad():
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        # factories inside the device context draw on `device`, so the generator lives there too
        tiny_checkpoints._redraw(tiny_checkpoints._weights(m), torch.Generator(device=device).manual_seed(seed))
    m.save_pretrained(out, save_original_format=False)   # fused experts: the fastest to write and to read
    tiny_checkpoints._check_layout(out, "fused")
    return m


# ---------------------------------------------------------------------------- per-op profiling


def weight_roles(model: ModelRunner) -> dict:
    """id(weight tensor) -> its role in a layer (q, kv_b, mlp.up, shared.down, router, lm_head...)."""
    import dataclasses

    roles = {id(model.weights.lm_head): "lm_head"}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, Tensor):
                name = "router" if (prefix, f.name) == ("moe", "gate") else (f"{prefix}.{f.name}" if prefix not in
                                                                            ("", "attn", "moe") else f.name)
                roles.setdefault(id(v), name)
            elif dataclasses.is_dataclass(v):
                walk(v, f.name if prefix in ("", "moe") else f"{prefix}.{f.name}")

    for w in model.weights.layers:
        walk(w, "")
    return roles


class OpProfiler:
    """While active, every plan step of `model` runs synchronized and timed alone.

    Plan.run binds each step once through backend.prepare(op, **kwargs) and keeps the bound calls;
    this wraps prepare on the backend object and drops the plans' bound calls on entry and on exit,
    so they are bound again through the wrapper (and, after exit, without it)."""

    def __init__(self, model: ModelRunner):
        self.model, self.be = model, model.backend
        self.roles = weight_roles(model)
        self.ops = defaultdict(lambda: [0.0, 0])        # op -> [seconds, calls]
        self.linears = defaultdict(lambda: [0.0, 0, ""])  # weight role -> [seconds, calls, shape]

    def _unbind(self) -> None:
        for p in self.model.plans.values():
            p._prepared = None

    def __enter__(self):
        be, orig = self.be, type(self.be).prepare

        def prepare(op, **kw):
            run = orig(be, op, **kw)
            lin = None
            if op == "linear":
                x, w = kw["x"], kw["w"]
                lin = (self.roles.get(id(w), "?"), f"{x.shape[0]}x{w.shape[0]}x{w.shape[1]} {w.dtype.name}")

            def timed():
                be.synchronize()
                t0 = time.perf_counter()
                run()
                be.synchronize()
                dt = time.perf_counter() - t0
                rec = self.ops[op]
                rec[0] += dt
                rec[1] += 1
                if lin is not None:
                    r = self.linears[lin[0]]
                    r[0] += dt
                    r[1] += 1
                    r[2] = lin[1]
            return timed

        self._unbind()
        be.prepare = prepare   # an instance attribute: shadows the class's method
        return self

    def __exit__(self, *exc):
        del self.be.prepare
        self._unbind()


# ---------------------------------------------------------------------------- runs


def prefill(model: ModelRunner, prompts: list) -> float:
    """Seconds of one synchronized prefill of `prompts` (fresh sequences, freed afterwards)."""
    be = model.backend
    sids = [model.new_sequence() for _ in prompts]
    be.synchronize()
    t0 = time.perf_counter()
    model.forward(sids, prompts, [0] * len(prompts))
    be.synchronize()
    dt = time.perf_counter() - t0
    for s in sids:
        model.free(s)
    return dt


def bench_batch(model: ModelRunner, prompts: list, repeats: int) -> dict:
    prefill(model, prompts)   # traces, places and binds the plan
    wall = float(np.median([prefill(model, prompts) for _ in range(repeats)]))
    with OpProfiler(model) as prof:
        prof_wall = float(np.mean([prefill(model, prompts) for _ in range(repeats)]))
    n = repeats
    ops = {op: {"ms": s / n * 1e3, "calls": c // n} for op, (s, c) in
           sorted(prof.ops.items(), key=lambda kv: -kv[1][0])}
    cats = {c: 0.0 for c in (*CATEGORIES, "other")}
    for op, r in ops.items():
        cats[category(op)] += r["ms"]
    linears = {k: {"ms": s / n * 1e3, "calls": c // n, "shape": shape} for k, (s, c, shape) in
               sorted(prof.linears.items(), key=lambda kv: -kv[1][0])}
    T = sum(len(p) for p in prompts)
    plan = model.plans[PlanKey("main", "prefill", bucket(T), bucket(len(prompts)))]
    return {"batch": len(prompts), "tokens": T, "wall_ms": wall * 1e3, "tokens_per_s": T / wall,
            "profiled_wall_ms": prof_wall * 1e3, "ops_ms": sum(r["ms"] for r in ops.values()),
            "unattributed_ms": prof_wall * 1e3 - sum(r["ms"] for r in ops.values()),
            "per_op": ops, "per_category_ms": cats, "linear_by_weight": linears,
            "plan_ops": len(plan.calls), "arena_bytes": plan.arena_bytes}


def bench_hf(hf, prompts: list, device: str, repeats: int) -> dict:
    """transformers' forward of the same tokens: median ms, or the error it raised."""
    try:
        ids = torch.tensor(prompts, device=device)

        kw = {"use_cache": False, "logits_to_keep": 1}

        def run():
            with torch.no_grad():
                hf(input_ids=ids, **kw)
            if device == "cuda":
                torch.cuda.synchronize()

        try:
            run()
        except TypeError:   # a transformers without logits_to_keep: all positions' logits
            kw.pop("logits_to_keep")
            run()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
        return {"hf_ms": float(np.median(ts)) * 1e3, "hf_last_token_logits": "logits_to_keep" in kw}
    except Exception as e:  # a peer that cannot run is reported, not fatal
        if device == "cuda":
            torch.cuda.empty_cache()
        return {"hf_ms": None, "hf_error": f"{type(e).__name__}: {e}"[:300]}


def print_row(r: dict) -> None:
    hf = f"{r['hf_ms']:9.1f} ms" if r.get("hf_ms") is not None else f"error ({r.get('hf_error', 'not run')[:60]})"
    print(f"\nB={r['batch']} x T={r['tokens'] // r['batch']} ({r['tokens']} tokens): wall {r['wall_ms']:.1f} ms "
          f"({r['tokens_per_s']:.0f} tok/s), profiled {r['profiled_wall_ms']:.1f} ms "
          f"(ops {r['ops_ms']:.1f}, unattributed {r['unattributed_ms']:.1f}), HF {hf}")
    tot = r["ops_ms"] or 1.0
    print(f"  {'op':18s} {'ms':>10s} {'%':>6s} {'calls':>6s}")
    for op, v in r["per_op"].items():
        print(f"  {op:18s} {v['ms']:10.2f} {100 * v['ms'] / tot:6.1f} {v['calls']:6d}")
    print("  categories: " + "  ".join(f"{c} {ms:.1f} ms ({100 * ms / tot:.0f}%)"
                                       for c, ms in r["per_category_ms"].items()))
    print("  linear by weight: " + "  ".join(f"{k} {v['ms']:.1f} ms/{v['calls']} [{v['shape']}]"
                                             for k, v in r["linear_by_weight"].items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lib", help="backend library (libdeepinfer_cuda.so, libdeepinfer_cpu.so, ...)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtype", default="bf16", choices=sorted(TORCH_DTYPES), help="deepinfer's activation dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' timing")
    ap.add_argument("--workdir", default=None, help="where the temporary checkpoint goes (default: $TMPDIR)")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    T = a.prompt_tokens

    # transformers runs (and the checkpoint is stored) in bf16 on a GPU, f32 on the CPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    work = Path(tempfile.mkdtemp(prefix="bench_prefill_", dir=a.workdir))
    try:
        t0 = time.perf_counter()
        hf = make_checkpoint(work / "model", a.layers, device, hf_dtype)
        t_make = time.perf_counter() - t0
        be = load_library(a.lib)
        t0 = time.perf_counter()
        model = ModelRunner(Checkpoint(work / "model"), be,
                            RunnerConfig(max_batch=max(batches), max_seq_len=T, dtype=a.dtype))
        be.synchronize()
        t_load = time.perf_counter() - t0
        c = model.cfg
        print(f"{be.name} ({a.lib}) on {be.info.attributes.get('device.name', be.device)}: V2-Lite shape, "
              f"{c.num_hidden_layers} layers, {a.dtype} activations; checkpoint made in {t_make:.0f} s, "
              f"loaded in {t_load:.0f} s; transformers peer {str(hf_dtype).replace('torch.', '')} on {device}", flush=True)
        import transformers
        result = {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "commit": a.commit, "date": datetime.date.today().isoformat(), "library": a.lib,
            "backend": be.name, "backend_attributes": be.info.attributes,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "config": {"hub_config": HUB_CONFIG, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
                       "heads": c.num_attention_heads, "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": c.q_lora_rank,
                       "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
                       "v_head_dim": c.v_head_dim, "n_routed_experts": c.n_routed_experts,
                       "num_experts_per_tok": c.num_experts_per_tok, "n_shared_experts": c.n_shared_experts,
                       "moe_intermediate_size": c.moe_intermediate_size, "intermediate_size": c.intermediate_size,
                       "vocab_size": c.vocab_size, "prompt_tokens": T, "batches": batches, "dtype": a.dtype,
                       "weights": model.precision_note, "repeats": a.repeats},
            "peer": {"name": type(hf).__name__, "device": device, "dtype": str(hf_dtype).replace("torch.", ""),
                     "attn_implementation": getattr(hf.config, "_attn_implementation", None),
                     "experts_implementation": getattr(hf.config, "_experts_implementation", None)},
            "rows": [],
        }
        rng = np.random.default_rng(0)
        for B in batches:
            prompts = rng.integers(0, c.vocab_size, (B, T)).tolist()
            row = bench_batch(model, prompts, a.repeats)
            row.update({"hf_ms": None, "hf_error": "skipped (--no-peer)"} if a.no_peer else
                       bench_hf(hf, prompts, device, a.repeats))
            result["rows"].append(row)
            print_row(row)
            sys.stdout.flush()
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {a.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
