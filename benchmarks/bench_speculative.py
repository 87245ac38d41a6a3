"""MTP speculative decoding (engine.speculative) against plain decoding, in one process.

    python benchmarks/bench_speculative.py [--backend cpu] [--threads 2] [--batches 1 4 16]
        [--tokens 64] [--temps 0 0.7] [--configs off k1 k2 k3 auto] [--repeats 3] [--tag NAME]

For each batch size B and temperature: the same prompts (lines of the embedded model's held-out
text, which it never trained on; max(B, --prompts) of them, run B at a time), `--tokens` new
tokens per sequence with EOS ignored, through the engine's own step loop. Decode tokens/s counts the tokens generated after each sequence's first
one over the time of the steps that made them (the prefill step that makes the first is left
out). Configurations: speculation off; fixed K = 1, 2, 3 drafts (confidence 0: every draft
verified); the confidence scheduler ("auto", K = 3: drafts admitted while expected throughput
rises, plain steps when they would be faster). Reported per run: decode tokens/s (median of
--repeats, and the range), speed-up over off, acceptance per draft position, mean accepted length
(tokens a sequence gains per speculative step), verify tokens per step, the share of steps the
scheduler ran plain, and whether the greedy output equals speculation off (it must).
Results: benchmarks/results/speculative_<backend>_<date>_<commit>[_tag].{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from deepinfer.engine import Engine, default_model_dir  # noqa: E402
from deepinfer.engine.sampling import SamplingParams  # noqa: E402

CONFIGS = {
    "off": None,
    "k1": {"method": "mtp", "num_draft": 1, "confidence": 0.0},
    "k2": {"method": "mtp", "num_draft": 2, "confidence": 0.0},
    "k3": {"method": "mtp", "num_draft": 3, "confidence": 0.0},
    "auto": {"method": "mtp", "num_draft": 3, "confidence": "auto"},
}


def prompts(model: Path, n: int) -> list:
    lines = [l for l in (model / "heldout.txt").read_text().splitlines() if len(l.strip()) > 16]
    step = max(len(lines) // n, 1)
    return [lines[i * step][:48] for i in range(n)]


def snap(eng: Engine):
    """The speculation counters (copies), None without speculation."""
    if eng.spec is None:
        return None
    return eng.spec.cal.accepted.copy(), eng.spec.cal.tested.copy(), vars(eng.spec.stats).copy()


def run_once(eng: Engine, ids: list, params: SamplingParams, batch: int) -> tuple:
    """(decode tokens/s, outputs): the prompts in groups of `batch` requests, each group added
    before its first step and run to the end."""
    decode_tokens, decode_s, all_outs = 0, 0.0, []
    for g in range(0, len(ids), batch):
        rids = [eng.add_request(p, params) for p in ids[g:g + batch]]
        outs = {r: [] for r in rids}
        while eng.has_unfinished():
            started = all(outs[r] for r in rids)
            t0 = time.perf_counter()
            res = eng.step()
            dt_ = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in res)
            for o in res:
                outs[o.request_id] += o.token_ids
            if started:
                decode_tokens += n
                decode_s += dt_
        all_outs += [outs[r] for r in rids]
    return decode_tokens / decode_s, all_outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=default_model_dir())
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per run (at least the batch size), run in groups of "
                    "the batch size: acceptance depends on the text")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    maxb = max(args.batches)
    engines = {}
    for name in args.configs:
        # a cache for every sequence at full length: all the engines live at once, and a device's
        # default (90% of its free memory) would leave nothing for the second
        cfg = {"backend": args.backend, "precision": args.precision, "max_batch": maxb, "max_seq_len": 512,
               "kv_cache_tokens": maxb * 512, "num_threads": args.threads}
        if CONFIGS[name] is not None:
            cfg["speculative"] = CONFIGS[name]
        engines[name] = Engine.from_pretrained(args.model, config=cfg)
    eng0 = engines[args.configs[0]]
    texts = prompts(args.model, max(maxb, args.prompts))
    ids_all = [eng0.tokenizer.encode(t) for t in texts]
    rows = []
    for B in args.batches:
        ids = ids_all[:max(B, args.prompts)]
        for temp in args.temps:
            params = SamplingParams(max_new_tokens=args.tokens, temperature=temp, top_p=0.95 if temp else 1.0,
                                    seed=7, ignore_eos=True)
            # round robin: every configuration once per repeat, so a drift in the machine's speed
            # (a shared VM) lands on all of them alike
            snaps, tps, outs = {}, {n: [] for n in args.configs}, {}
            for name in args.configs:
                run_once(engines[name], ids[:B], params, B)          # warm-up: plans traced, graphs captured
                snaps[name] = snap(engines[name])
            for _ in range(args.repeats):
                for name in args.configs:
                    t, outs[name] = run_once(engines[name], ids, params, B)
                    tps[name].append(t)
            base = statistics.median(tps["off"]) if "off" in tps else None
            for name in args.configs:
                eng, before, after = engines[name], snaps[name], snap(engines[name])
                row = {"batch": B, "temperature": temp, "config": name, "decode_tok_s": statistics.median(tps[name]),
                       "decode_tok_s_range": [min(tps[name]), max(tps[name])]}
                if base:
                    row["speedup"] = row["decode_tok_s"] / base
                if temp == 0 and "off" in outs:
                    row["greedy_identical"] = outs[name] == outs["off"]
                if after is not None:
                    acc, tested = after[0] - before[0], after[1] - before[1]
                    d = lambda k: after[2][k] - before[2][k]
                    steps = d("spec_steps") + d("plain_steps")
                    row.update({
                        "acceptance_per_position": [float(a) / t if t else None for a, t in zip(acc, tested)],
                        "mean_accepted_length": d("tokens_emitted") / d("seq_steps") if d("seq_steps") else None,
                        "verify_tokens_per_step": d("verify_tokens") / d("spec_steps") if d("spec_steps") else None,
                        "spec_steps": d("spec_steps"), "plain_steps": d("plain_steps"),
                        "plain_share": d("plain_steps") / steps if steps else None,
                        "draft_runs": d("draft_runs"),
                        "drafts_verified": d("drafts_verified"), "drafts_accepted": d("drafts_accepted"),
                        "step_table_us": eng.spec.costs.describe(),
                    })
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "step_table_us"}), flush=True)
    meta = {"date": dt.date.today().isoformat(), "commit": commit + ("+dirty" if dirty else ""),
            "backend": eng0.backend.name, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "model": args.model.name, "precision": eng0.runner.precision_note,
            "tokens": args.tokens, "repeats": args.repeats, "prompts": args.prompts,
            "command": "python benchmarks/bench_speculative.py " + " ".join(sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"speculative_{eng0.backend.name}_{meta['date'].replace('-', '')}_{commit}" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(meta, rows))
    print(f"wrote {args.out / stem}.{{json,md}}")


def markdown(meta: dict, rows: list) -> str:
    out = [f"# MTP speculative decoding, {meta['model']} on {meta['backend']} ({meta['date']})", "",
           f"- commit {meta['commit']}; {meta['cpu']}, {meta['cores']} logical CPUs, {meta['threads']} threads; "
           f"{meta['precision']}",
           f"- {meta['tokens']} new tokens per sequence (EOS ignored), max(batch, {meta['prompts']}) prompts run batch at "
           f"a time, median of {meta['repeats']} runs after a warm-up "
           f"(configurations interleaved run by run); "
           f"decode tok/s excludes the prefill step",
           f"- command: `{meta['command']}`", "",
           "| batch | temp | config | decode tok/s (range) | speed-up | acceptance per position | mean accepted length "
           "| verify tokens/step | plain steps | greedy identical |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = r.get("acceptance_per_position")
        out.append("| {} | {} | {} | {:.0f} ({:.0f}-{:.0f}) | {} | {} | {} | {} | {} | {} |".format(
            r["batch"], r["temperature"], r["config"], r["decode_tok_s"], *r["decode_tok_s_range"],
            f"{r['speedup']:.2f}x" if "speedup" in r else "-",
            ", ".join("-" if a is None else f"{a:.2f}" for a in acc) if acc else "-",
            f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else "-",
            f"{r['verify_tokens_per_step']:.1f}" if r.get("verify_tokens_per_step") else "-",
            f"{r['plain_share']:.0%}" if r.get("plain_share") is not None else "-",
            {True: "yes", False: "NO"}.get(r.get("greedy_identical"), "-")))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
