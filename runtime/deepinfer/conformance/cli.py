"""`deepinfer conformance PATH.so [--out cert.json] [--level L0,L1,L2,L3] [--quick | --thorough] [--ranks N]`.

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
from .levels import CHECK_BUDGETS, LEVELS, MULTI_RANK, REFERENCE, unavailable

DESCRIPTION = ("Certify a deepinfer backend library against the ABI and the reference backend, and write a JSON "
               "certificate. PATH may be 'reference' to self-check the suite. Levels: L0 the ABI's behaviour, L1 "
               "every claimed op against the reference, L2 bit-exact dequantization, L3 streams and graphs; with "
               "--ranks N also L4, the collectives across N ranks (every rank loads the library, a device library on "
               "the device of its local rank, and all_reduce, all_gather, all_to_all, an expert-parallel round trip, "
               "graphs and bad counts are checked against the reference under mpirun -n N).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("library", help="path to libdeepinfer_<name>.so, or 'reference'")
    p.add_argument("--out", "-o", help="write the certificate here (default: conformance-<name>.json); an existing "
                                       "file is only replaced with --force")
    p.add_argument("--force", action="store_true", help="replace an existing certificate file")
    p.add_argument("--no-out", action="store_true", help="do not write a certificate file")
    p.add_argument("--level", "--levels", default=",".join(LEVELS),
                   help=f"comma-separated levels to run (default: {','.join(LEVELS)}; {MULTI_RANK} comes with --ranks)")
    p.add_argument("--ranks", type=int, metavar="N",
                   help=f"also certify the collectives across N ranks (N >= 2): level {MULTI_RANK} runs python -m "
                        f"deepinfer.conformance.multi_rank under mpirun -n N (needs mpirun and mpi4py: pip install "
                        f"'deepinfer[mpi]'); --level {MULTI_RANK} --ranks N runs that level alone")
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="fewer shapes and formats (CI)")
    prof.add_argument("--thorough", action="store_true", help="more random shapes per op (vendors)")
    p.add_argument("--ops", help="comma-separated ops to test in L1 (default: every op the library claims)")
    p.add_argument("--seed", type=int, default=0, help="shifts every case's seed (default 0)")
    budgets = ", ".join(f"{lv} {s:g} s" for lv, s in CHECK_BUDGETS.items())
    p.add_argument("--check-timeout", type=float, metavar="SECONDS",
                   help=f"a check running longer than this is killed and recorded as an error, and the run goes on "
                        f"after it (default per level: {budgets}; {MULTI_RANK}'s is the whole multi-rank job's); "
                        f"not with --in-process")
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
    bad = [lv for lv in levels if lv not in LEVELS + (MULTI_RANK,)]
    if bad or not levels:
        return _usage_error(f"unknown level(s) {', '.join(bad) or '(none given)'}; choose from "
                            f"{', '.join(LEVELS + (MULTI_RANK,))}")
    if args.ranks is not None and args.ranks < 2:
        return _usage_error(f"--ranks {args.ranks}: the multi-rank level needs at least 2 ranks (one rank is L1's)")
    if MULTI_RANK in levels and args.ranks is None:
        return _usage_error(f"{MULTI_RANK} checks the collectives across ranks: give their number, --ranks N (N >= 2)")
    ops = _split(args.ops or "")
    unknown = [op for op in ops if op not in abi.OP_NAMES]
    if unknown:
        return _usage_error(f"unknown op(s) {', '.join(unknown)}; the ABI's ops are {', '.join(abi.OP_NAMES)}")
    if args.check_timeout is not None and not args.check_timeout > 0:
        return _usage_error(f"--check-timeout {args.check_timeout:g}: give a positive number of seconds")
    if args.check_timeout is not None and args.in_process:
        return _usage_error("--check-timeout needs the isolated mode: --in-process has no per-check timeout")
    if args.ranks is not None:
        why = unavailable()
        if why:
            return _usage_error(f"--ranks {args.ranks}: {why}")
    if args.library != REFERENCE and not os.path.exists(args.library):
        return _usage_error(f"{args.library}: no such file")
    out = None if args.no_out else args.out or _default_out(args.library)
    if out and os.path.exists(out) and not args.force:
        return _usage_error(f"{out} exists; pass --force to replace it, or --out another file")
    profile = "quick" if args.quick else "thorough" if args.thorough else "default"

    # the checks import NumPy and ml_dtypes (0.5-1.6 s): loaded when a certification runs, not when
    # `deepinfer --help` or `deepinfer backends` builds this command's parser
    from .runner import run_conformance, summary

    def progress(msg: str) -> None:
        if args.verbose or msg.startswith("==") or any(w in msg for w in ("FAIL", " ERROR ", "TIMEOUT", "CRASH")):
            print(msg, file=sys.stderr, flush=True)

    cert = run_conformance(args.library, levels=levels, out=out, profile=profile, seed=args.seed, only_ops=ops or None,
                           isolate=not args.in_process, progress=progress, check_timeout=args.check_timeout,
                           ranks=args.ranks)
    print(summary(cert, verbose=args.verbose))
    return EXIT_OK if cert["passed"] else EXIT_FAILURE


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="deepinfer conformance", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(sys.argv[1:] if argv is None else argv))
