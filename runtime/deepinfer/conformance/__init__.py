"""The backend conformance suite: `deepinfer conformance LIB.so` certifies a vendor library.

    from deepinfer.conformance import run_conformance, summary
    cert = run_conformance("libdeepinfer_x.so", levels=("L0", "L1", "L2", "L3"), out="cert.json")
    print(summary(cert))

Levels: L0 ABI behaviour (cffi, no Backend sugar), L1 op numerics against the reference on
generated shapes for every op and format the library claims (1.4's collectives on a one-rank
communicator of its own; a case that sets a field newer than the library's minor, such as 1.5's
expert_map, is "unsupported" for it), L2 bit-exact dequantization of every quantized format, L3
streams and graph capture (libraries that have them); with ranks=N (`--ranks N`) also L4, the collectives across
N ranks, run by multi_rank.py as an mpirun job. The special name "reference" runs the suite's
machinery against the reference itself (a smoke test).
"""
from .cli import main
from .levels import LEVELS, MULTI_RANK
from .tolerances import (TOLERANCES_V1, TOLERANCES_V2, TOLERANCES_V3, TOLERANCES_V4, TOLERANCES_V5,
                         TOLERANCES_V6, TOLERANCES_V7, TOLERANCES_VERSION)

_RUNNER_NAMES = ("run_conformance", "run_level", "summary")

__all__ = ["main", "run_conformance", "run_level", "summary", "LEVELS", "MULTI_RANK", "TOLERANCES_V1", "TOLERANCES_V2",
           "TOLERANCES_V3", "TOLERANCES_V4", "TOLERANCES_V5", "TOLERANCES_V6", "TOLERANCES_V7",
           "TOLERANCES_VERSION"]


def __getattr__(name: str):
    """run_conformance, run_level and summary, from runner.py on first use: `deepinfer --help` and
    `deepinfer backends` import this package for the parser (cli.py), and runner.py imports the checks
    (NumPy and ml_dtypes, 0.5-1.6 s)."""
    if name not in _RUNNER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import runner

    value = getattr(runner, name)
    globals()[name] = value
    return value
