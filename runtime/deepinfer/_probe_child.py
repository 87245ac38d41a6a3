"""Probe one backend library in a process of its own; loader.probe_isolated() starts it:

    python -m deepinfer._probe_child PATH

The library's code runs here, so that its crash, hang or exit() ends this process and not the one
that asked. stdout carries the answer and nothing else: "STAGE <name>" before each step that runs
the library's code (so the parent can say where it died), then one line "VERDICT <json>" with the
candidate's facts (loader.FACT_FIELDS). What the library itself prints goes to stderr. Imports stay
few (deepinfer, cffi; no numpy): every library probed pays this process's start-up.
"""
import json
import os
import sys
from pathlib import Path


def main(argv: list) -> int:
    (path,) = argv
    # the answer keeps a private copy of stdout, and fd 1 now leads to stderr: a library printing
    # from C cannot garble the verdict
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def stage(name: str) -> None:
        answer.write(f"STAGE {name}\n")
        answer.flush()

    from .loader import FACT_FIELDS, probe

    c = probe(Path(path), stage=stage)
    answer.write("VERDICT " + json.dumps({k: getattr(c, k) for k in FACT_FIELDS}) + "\n")
    answer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
