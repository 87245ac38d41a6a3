"""Probe one backend library in a process of its own; loader.probe_isolated() starts it, and reads
its answer with read_answer() below (both ends of the protocol are in this file):

    python -m deepinfer._probe_child PATH

The library's code runs here, so that its crash, hang or exit() ends this process and not the one
that asked. stdout carries the answer and nothing else: "STAGE <name>" before each step that runs
the library's code (so the parent can say where it died), then one line "VERDICT <json>" with the
candidate's facts (library.FACT_FIELDS). What the library itself prints goes to stderr. Imports stay
few (deepinfer, cffi; no numpy): every library probed pays this process's start-up.
"""
import json
import os
import signal
import sys
from pathlib import Path

from .errors import InputError
from .library import FACT_FIELDS, probe, valid_facts

PROBE_TIMEOUT_ENV = "DEEPINFER_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 30.0


def main(argv: list) -> int:
    (path,) = argv
    # the answer keeps a private copy of stdout, and fd 1 now leads to stderr: a library printing
    # from C cannot garble the verdict
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def stage(name: str) -> None:
        answer.write(f"STAGE {name}\n")
        answer.flush()

    c = probe(Path(path), stage=stage)
    answer.write("VERDICT " + json.dumps({k: getattr(c, k) for k in FACT_FIELDS}) + "\n")
    answer.flush()
    return 0


# ---------------------------------------------------------------------------- the parent's side

# where the child was when it died or hung, by the last stage it announced
STAGE_WHERE = {
    None: "before it loaded the library",
    "load": "while the library was being loaded (in its constructors)",
    "bootstrap": "in deepinfer_plugin_info() or get_api()",
    "score": "in score()",
    "self-test": "in its self-test (creating a context, reading its attributes, destroying it)",
}


def probe_timeout() -> float:
    """Seconds a probe child may take (DEEPINFER_PROBE_TIMEOUT, default 30)."""
    raw = os.environ.get(PROBE_TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_PROBE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InputError(f"{PROBE_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it for the "
                         f"default ({DEFAULT_PROBE_TIMEOUT:g} s)")
    return value



def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"



def _parse_facts(text: str):
    try:
        facts = json.loads(text)
    except ValueError:
        return None
    return facts if valid_facts(facts) else None


def read_answer(out: str, err: str, rc: int) -> dict:
    """The child's outcome: {"facts": {...}} or {"failure": why, "at_fault": is it the library's,
    "cacheable": does it hold for the file}."""
    stage, facts, garbage = None, None, []
    for line in out.splitlines():
        parsed = _parse_facts(line[len("VERDICT "):]) if line.startswith("VERDICT ") else None
        if line.startswith("STAGE "):
            stage = line[len("STAGE "):]
        elif parsed is not None:
            facts = parsed
        elif line.strip():
            garbage.append(line)
    where = STAGE_WHERE.get(stage, f"in stage {stage!r}")
    if facts is not None and rc == 0:
        return {"facts": facts}
    if stage is None and not garbage:  # it never reached the library: our installation, not its fault
        tail = err.strip().splitlines()[-1:] or [f"exit status {rc}"]
        return {"failure": f"the probe process failed before loading it: {tail[0][:300]}; this is a problem of "
                           f"the deepinfer installation, not of the library", "at_fault": False, "cacheable": False}
    if facts is not None:
        where = "after answering, when the process exited (in its destructors)"
    if rc < 0:
        failure = f"crashed with {_signal_name(-rc)} while being probed, {where}"
    elif rc == 0 and garbage:
        failure = f"answered the probe with something other than a verdict: {garbage[0][:200]!r}"
    elif stage == "load" and facts is None:
        failure = f"its constructor exited the process with status {rc} while it was being loaded"
    else:
        failure = f"exited the process with status {rc} while being probed, {where}"
    return {"failure": failure, "at_fault": True, "cacheable": True}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
