"""The expert cache's disk piece size and readers against the transfer bound, on one model.

    python benchmarks/sweep_expert_chunks.py --backend LIB --model DIR [--chunks-mib 1 2 4] [--capacities 0.5 0.75]
        [--readers native python]

On a device a disk expert is read in pieces (model.expert_cache.loads.CHUNK_BYTES) by DEVICE_READ_THREADS
readers, each piece sent to its slot as soon as it is read. The piece size trades how many readers
one miss keeps busy (an expert of 17 MB in 4 MiB pieces keeps 5 of 8 busy) against the per-piece
cost (a reader hand-off and a copy call each). For every piece size and capacity this decodes the
same teacher-forced tokens as bench_expert_cache.py (LFRU + prefetch by default) and reports the
step time against the transfer bound measured in the same run (resident step + bytes moved per
token / the slowest source stage), and whether the logits equal the resident model's. --readers
compares the native readers (model.expert_cache.native: pread and copies on native threads) with the
Python ones (every piece a GIL hand-off) on the same tokens.
Results: <out-dir>/expert_chunks_<backend>_<date>_<commit>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_expert_cache as B  # noqa: E402
from deepinfer.model.expert_cache import ExpertCacheConfig  # noqa: E402
from deepinfer.model.expert_cache import loads as EC  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=56)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--source", default="disk", choices=("disk",))
    ap.add_argument("--chunks-mib", type=float, nargs="+", default=[1, 2, 4])
    ap.add_argument("--capacities", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--config", default="lfru+prefetch", choices=list(B.CONFIGS))
    ap.add_argument("--readers", nargs="+", default=["native"], choices=("native", "python"))
    ap.add_argument("--profile", action="store_true",
                    help="profile the main thread's decode of each run (cProfile; top functions by own time "
                         "in <out-dir>/profile_<piece>_<capacity>.txt)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out-dir", default=str(B.ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    args.model = Path(args.model)
    _, ids = B.heldout_tokens(args.model, None, args.tokens)

    resident = B.runner_for(args, None)
    base = B.decode(resident, ids)
    t_res = B.med(base["times"][args.warmup:])
    del resident
    gc.collect()
    label, opts = B.CONFIGS[args.config]
    rows, bw = [], None
    default_chunk = EC.CHUNK_BYTES
    try:
        for mib, c, readers in ((m, c, k) for m in args.chunks_mib for c in args.capacities for k in args.readers):
            EC.CHUNK_BYTES = int(mib * (1 << 20))
            ec = ExpertCacheConfig.parse({"capacity": c, **opts, "source": args.source})
            ec.native_readers = readers == "native"
            r = B.runner_for(args, ec)
            if bw is None:
                bw = B.source_bandwidth(r)["bound"]
            if args.profile:
                import cProfile
                import io
                import pstats
                prof = cProfile.Profile()
                out = prof.runcall(B.decode, r, ids)
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.out_dir) / f"profile_{mib:g}MiB_{c:g}_{readers}.txt").write_text(buf.getvalue())
            else:
                out = B.decode(r, ids)
            st = r.expert_stats()
            t = B.med(out["times"][args.warmup:])
            moved = st["expert_bytes_streamed"] / len(ids)
            bound = t_res + moved / bw
            rows.append({"chunk_mib": mib, "capacity": c, "readers": r.experts.readers, "step_ms": 1e3 * t,
                         "bound_ms": 1e3 * bound, "vs_bound": t / bound, "hit_rate": st["expert_hit_rate"],
                         "wait_ms_per_token": 1e3 * st["expert_wait_seconds"] / len(ids),
                         "bytes_per_token": moved, "loads_given_up": st["expert_loads_given_up"],
                         "route_ms_per_token": 1e3 * r.experts.route_seconds / len(ids),
                         "sync_ms_per_token": 1e3 * r.experts.sync_seconds / len(ids),
                         "pause_free_steps": st["expert_pause_free_steps"],
                         "pause_free_retries": st["expert_pause_free_retries"],
                         "prefetch_late": st["expert_prefetch_late"], "misses": st["expert_misses"],
                         "bit_identical": all(np.array_equal(a, b) for a, b in zip(base["logits"], out["logits"]))})
            print(json.dumps(rows[-1]), flush=True)
            r.experts.close()
            del r
            gc.collect()
    finally:
        EC.CHUNK_BYTES = default_chunk
    res = {"date": dt.date.today().isoformat(), "commit": args.commit, "backend": args.backend,
           "model": args.model.name, "tokens": len(ids), "config": label, "resident_step_ms": 1e3 * t_res,
           "source_bandwidth_GBps": bw / 1e9, "default_chunk_mib": default_chunk / (1 << 20), "rows": rows,
           "command": "python benchmarks/sweep_expert_chunks.py " + " ".join(sys.argv[1:])}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lib = Path(args.backend).stem.replace("libdeepinfer_", "")
    stem = f"expert_chunks_{lib}_{res['date'].replace('-', '')}_{args.commit}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    L = [f"# Expert cache disk piece size: {args.model.name}, {len(ids)} tokens, {label}", "",
         f"{res['date']}, commit {args.commit}. Command: `{res['command']}`. Resident step {1e3 * t_res:.3f} ms; "
         f"source {bw / 1e9:.2f} GB/s (slowest stage). Default piece: {default_chunk >> 20} MiB.", "",
         "| piece MiB | capacity | readers | step ms | bound ms | vs bound | hit rate | wait ms/token | "
         "host ms/token | identical |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['chunk_mib']:g} | {r['capacity']:.0%} | {r['readers']} | {r['step_ms']:.3f} | "
                 f"{r['bound_ms']:.3f} | {r['vs_bound']:.2f}x | {r['hit_rate']:.3f} | {r['wait_ms_per_token']:.3f} | "
                 f"{r['route_ms_per_token']:.3f} | {'yes' if r['bit_identical'] else 'NO'} |")
    (out / f"{stem}.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
