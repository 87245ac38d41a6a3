"""Host cost of a plan for a new batch shape: tracing + binding, and preparing (marshalling every call
into its C args struct), on the CPU backend.

    python benchmarks/bench_plan_marshal.py [--lib libdeepinfer_cpu.so] [--json out.json]

Two workloads:
  * the embedded nano model (5 layers, 16 routed experts): decode plans for batch 1..8, each a new
    shape; the first one pays for every weight descriptor, later ones show what a new shape costs;
  * one moe_experts call of DeepSeek-V3's width (256 experts x 3 weights, int4 g128 with scales), bound
    for 8 token counts: the per-MoE-layer share of a V3 plan (58 such layers).

Run it from any checkout: it imports the deepinfer next to it (`runtime/`), so running the same file
from an older commit's worktree gives the before/after comparison in one command each. Not a test:
the numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this checkout's deepinfer, even where an editable install of another checkout would redirect imports
sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]
sys.path.insert(0, str(ROOT / "runtime"))
NANO = ROOT / "runtime/deepinfer/assets/deepseek-v3-nano"


def nano_plans(be, shapes):
    from deepinfer.model import Checkpoint
    from deepinfer.engine import ModelRunner, RunnerConfig

    model = ModelRunner(Checkpoint(NANO), be, RunnerConfig(max_batch=max(shapes)))
    # count the DI_Tensor descriptors actually filled (1.0: every one, every plan; 1.1: _fill_new runs
    # only for tensors never marshalled before, and copies cover the rest)
    name = "_fill_new" if hasattr(be, "_fill_new") else "_fill_tensor"
    real = getattr(be, name)
    filled = [0]

    def counting(*a, **k):
        filled[0] += 1
        return real(*a, **k)

    setattr(be, name, counting)
    rows = []
    for T in shapes:
        filled[0] = 0
        t0 = time.perf_counter()
        p = model.plan("main", "decode", T, T)
        t1 = time.perf_counter()
        prepared = [be.prepare(op, **kw) for op, kw in p.bound]
        t2 = time.perf_counter()
        rows.append({"batch": T, "calls": len(prepared), "descriptors_filled": filled[0],
                     "trace_bind_ms": round((t1 - t0) * 1e3, 2), "prepare_ms": round((t2 - t1) * 1e3, 2)})
    return rows


def v3_moe(be, token_counts, E=256, H=7168, I=2048):
    """moe_experts with V3's expert count; small-data descriptors (the host cost does not depend on
    the bytes behind them, so the weights are views of one shared buffer)."""
    import numpy as np

    from deepinfer.tensor import Quant, Tensor

    g = 128
    q = Tensor.from_numpy(np.zeros((I, H), np.int8), "int4")
    s = Tensor.from_numpy(np.ones((I, H // g), np.float32))
    qd = Tensor.from_numpy(np.zeros((H, I), np.int8), "int4")
    sd = Tensor.from_numpy(np.ones((H, I // g), np.float32))

    def w(qq, ss):
        return Tensor(qq.buffer, qq.shape, qq.dtype, qq.strides, 0, Quant(ss, (1, g)))

    gate = [w(q, s) for _ in range(E)]
    up = [w(q, s) for _ in range(E)]
    down = [w(qd, sd) for _ in range(E)]
    rows = []
    for T in token_counts:
        x = Tensor.empty((T, H), "f32")
        ids = Tensor.from_numpy(np.zeros((T, 8), np.int32))
        tw = Tensor.from_numpy(np.zeros((T, 8), np.float32))
        out = Tensor.empty((T, H), "f32")
        t0 = time.perf_counter()
        be.prepare("moe_experts", x=x, topk_ids=ids, topk_weights=tw, w_gate=gate, w_up=up, w_down=down, out=out)
        rows.append({"tokens": T, "prepare_ms": round((time.perf_counter() - t0) * 1e3, 2)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=None, help="libdeepinfer_cpu.so (default: the best CPU library found)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from deepinfer import abi
    from deepinfer.loader import get_backend, load_library

    be = load_library(args.lib) if args.lib else get_backend("cpu")
    res = {"abi": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", "library": be.info.path,
           "nano_decode_plans": nano_plans(be, list(range(1, 9))),
           "v3_moe_experts_prepare": v3_moe(be, [1, 2, 4, 8, 16, 32, 64, 128])}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
