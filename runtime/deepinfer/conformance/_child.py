"""Conformance levels in a child process (see runner._run_isolated).

argv: levels(comma separated) lib_path profile seed only_ops(comma separated) previous.json results.jsonl
Each check announces itself on stdout ("START key") before it runs, appends its outcome to
results.jsonl when it ends and then says so ("DONE key"), so that the parent times each check, and
when the library crashes the process or a check runs too long, knows which check it was and can
start a new child that skips every check in previous.json.
"""
import json
import sys

from .harness import Recorder
from .runner import run_level


class AnnouncingRecorder(Recorder):
    def done(self, o) -> None:
        super().done(o)
        self.progress(f"DONE {self.level}|{self.key(o.op, o.case, o.seed)}")


def main(argv):
    level, lib_path, profile, seed, only, prev_file, sink_file = argv

    def progress(msg: str) -> None:
        print(msg, flush=True)

    with open(prev_file) as f:
        previous = json.load(f)
    rec = AnnouncingRecorder(progress, previous, sink_file)
    for lv in level.split(","):
        progress(f"== {lv}")
        run_level(lv, lib_path, profile, int(seed), [o for o in only.split(",") if o] or None, progress, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
