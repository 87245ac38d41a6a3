"""`deepinfer conformance PATH.so [--out cert.json] [--level L0,L1,L2,L3] [--quick | --thorough]`."""
from __future__ import annotations

import argparse
import sys

from .runner import LEVELS, REFERENCE, run_conformance, summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer conformance",
        description="Certify a deepinfer backend library against the ABI and the reference backend, "
                    "and write a JSON certificate. PATH may be 'reference' to self-check the suite.")
    p.add_argument("library", help="path to libdeepinfer_<name>.so, or 'reference'")
    p.add_argument("--out", "-o", help="write the certificate here (default: conformance-<name>.json)")
    p.add_argument("--level", "--levels", default=",".join(LEVELS),
                   help=f"comma-separated levels to run (default: {','.join(LEVELS)})")
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="fewer shapes and formats (CI)")
    prof.add_argument("--thorough", action="store_true", help="more random shapes per op (vendors)")
    p.add_argument("--ops", help="comma-separated ops to test in L1 (default: every op the library claims)")
    p.add_argument("--seed", type=int, default=0, help="shifts every case's seed (default 0)")
    p.add_argument("--in-process", action="store_true",
                   help="run the levels in this process (faster; a crashing library then ends the run)")
    p.add_argument("--verbose", "-v", action="store_true")
    p.add_argument("--no-out", action="store_true", help="do not write a certificate file")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    levels = [lv.strip().upper() for lv in args.level.split(",") if lv.strip()]
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        print(f"deepinfer conformance: unknown level(s) {', '.join(bad)}; choose from {', '.join(LEVELS)}",
              file=sys.stderr)
        return 2
    if args.library != REFERENCE:
        import os

        if not os.path.exists(args.library):
            print(f"deepinfer conformance: {args.library}: no such file", file=sys.stderr)
            return 2
    profile = "quick" if args.quick else "thorough" if args.thorough else "default"
    out = None
    if not args.no_out:
        import os

        stem = "reference" if args.library == REFERENCE else os.path.basename(args.library).split(".")[0]
        out = args.out or f"conformance-{stem.replace('libdeepinfer_', '')}.json"

    def progress(msg: str) -> None:
        if args.verbose or msg.startswith("==") or "FAIL" in msg:
            print(msg, file=sys.stderr, flush=True)

    cert = run_conformance(args.library, levels=levels, out=out, profile=profile, seed=args.seed,
                           only_ops=[o for o in (args.ops or "").split(",") if o] or None,
                           isolate=not args.in_process, progress=progress)
    print(summary(cert, verbose=args.verbose))
    return 0 if cert["passed"] else 1
