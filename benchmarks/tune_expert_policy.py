"""Pick the LFRU decay of model/expert_cache/policy.py on text the embedded model trained on (never the
held-out text the benchmark reports on): record the real routing of a teacher-forced decode of the
first 6000 characters of some training files, replay it through LayerSlots for a range of decays.

    python benchmarks/tune_expert_policy.py [--files 12] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_expert_cache import simulate, trace_routing  # noqa: E402
from deepinfer.engine.llm_engine import default_model_dir  # noqa: E402
from deepinfer.engine.tokenizer import Tokenizer  # noqa: E402
from deepinfer.model.expert_cache import policy as expert_policy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    d = default_model_dir()
    info = json.loads((d / "training.json").read_text())
    root = Path(info["stdlib_root"])
    if not root.is_dir():   # the same training files of this interpreter's standard library
        import sysconfig

        root = Path(sysconfig.get_paths()["stdlib"])
        print(f"{info['stdlib_root']} is not here; reading the same files under {root}")
    names = [n for n in info["files"]["train"][:: max(1, len(info["files"]["train"]) // args.files)]
             if (root / n).is_file()][: args.files]
    text = "\n\n".join((root / n).read_text(errors="replace")[:6000] for n in names)
    ids = Tokenizer(d).encode(text)[: args.tokens]
    ns = SimpleNamespace(backend="cpu", threads=0, model=d, precision="bf16", tokens=len(ids))
    steps, n_layers, E, _, _ = trace_routing(ns, ids)
    print(f"{len(ids)} tokens of {len(names)} training files; {n_layers} layers x {E} experts")
    print("decay  " + "  ".join(f"{c:.0%} lru/lfru" for c in (0.25, 0.5, 0.75)))
    for decay in (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98):
        expert_policy.DECAY = decay
        row = []
        for c in (0.25, 0.5, 0.75):
            lru = simulate(steps, n_layers, E, c, "lru", False)["hit_rate"]
            lfru = simulate(steps, n_layers, E, c, "lfru", False)["hit_rate"]
            row.append(f"{lru:.3f}/{lfru:.3f}")
        print(f"{decay:<6} " + "  ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
