"""`deepinfer conformance PATH.so [--out cert.json] [--level L0,L1,L2,L3] [--quick | --thorough]`.

add_arguments() and run() serve the `deepinfer conformance` subcommand; main() serves
`python -m deepinfer.conformance`. Exit codes: 0 certified, 1 not certified, 2 a usage error
(reported before any check runs).
"""
from __future__ import annotations

import argparse
import os
import sys

from .. import abi
from ..errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from .runner import CHECK_BUDGETS, LEVELS, REFERENCE, run_conformance, summary

DESCRIPTION = ("Certify a deepinfer backend library against the ABI and the reference backend, and write a JSON "
               "certificate. PATH may be 'reference' to self-check the suite.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("library", help="path to libdeepinfer_<name>.so, or 'reference'")
    p.add_argument("--out", "-o", help="write the certificate here (default: conformance-<name>.json); an existing "
                                       "file is only replaced with --force")
    p.add_argument("--force", action="store_true", help="replace an existing certificate file")
    p.add_argument("--no-out", action="store_true", help="do not write a certificate file")
    p.add_argument("--level", "--levels", default=",".join(LEVELS),
                   help=f"comma-separated levels to run (default: {','.join(LEVELS)})")
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="fewer shapes and formats (CI)")
    prof.add_argument("--thorough", action="store_true", help="more random shapes per op (vendors)")
    p.add_argument("--ops", help="comma-separated ops to test in L1 (default: every op the library claims)")
    p.add_argument("--seed", type=int, default=0, help="shifts every case's seed (default 0)")
    budgets = ", ".join(f"{lv} {s:g} s" for lv, s in CHECK_BUDGETS.items())
    p.add_argument("--check-timeout", type=float, metavar="SECONDS",
                   help=f"a check running longer than this is killed and recorded as an error, and the run goes on "
                        f"after it (default per level: {budgets}); not with --in-process")
    p.add_argument("--in-process", action="store_true",
                   help="run the levels in this process (faster; a crashing library then ends the run, and a hanging "
                        "op hangs it: there is no per-check timeout)")
    p.add_argument("--verbose", "-v", action="store_true")


def _usage_error(msg: str) -> int:
    print(f"deepinfer conformance: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _default_out(library: str) -> str:
    stem = "reference" if library == REFERENCE else os.path.basename(library).split(".")[0]
    return f"conformance-{stem.replace('libdeepinfer_', '')}.json"


def run(args: argparse.Namespace) -> int:
    """The parsed command line of `deepinfer conformance`; returns the exit code."""
    levels = [lv.upper() for lv in _split(args.level)]
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        return _usage_error(f"unknown level(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(LEVELS)}")
    ops = _split(args.ops or "")
    unknown = [op for op in ops if op not in abi.OP_NAMES]
    if unknown:
        return _usage_error(f"unknown op(s) {', '.join(unknown)}; the ABI's ops are {', '.join(abi.OP_NAMES)}")
    if args.check_timeout is not None and not args.check_timeout > 0:
        return _usage_error(f"--check-timeout {args.check_timeout:g}: give a positive number of seconds")
    if args.check_timeout is not None and args.in_process:
        return _usage_error("--check-timeout needs the isolated mode: --in-process has no per-check timeout")
    if args.library != REFERENCE and not os.path.exists(args.library):
        return _usage_error(f"{args.library}: no such file")
    out = None if args.no_out else args.out or _default_out(args.library)
    if out and os.path.exists(out) and not args.force:
        return _usage_error(f"{out} exists; pass --force to replace it, or --out another file")
    profile = "quick" if args.quick else "thorough" if args.thorough else "default"

    def progress(msg: str) -> None:
        if args.verbose or msg.startswith("==") or "FAIL" in msg or "TIMEOUT" in msg or "CRASH" in msg:
            print(msg, file=sys.stderr, flush=True)

    cert = run_conformance(args.library, levels=levels, out=out, profile=profile, seed=args.seed, only_ops=ops or None,
                           isolate=not args.in_process, progress=progress, check_timeout=args.check_timeout)
    print(summary(cert, verbose=args.verbose))
    return EXIT_OK if cert["passed"] else EXIT_FAILURE


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deepinfer conformance", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(sys.argv[1:] if argv is None else argv))
