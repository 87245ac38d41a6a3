"""Fuzzing the model-file parsers: seeded mutations of a small valid checkpoint directory (config.json,
the shard index, safetensors headers and data) must each load (config, index, headers, every array,
the weights on the reference backend) or fail with a DeepinferError: never another exception, a
signal or a hang.

Worker subprocesses each take a share of the cases and print `start N <mutation>` before a case and
`end N <outcome>` after it, so a crash or a hang names its case. A case reproduces alone with
    python tests/test_fuzz_parsers.py BASE_DIR WORK_DIR SEED N
DEEPINFER_FUZZ_CASES (default 1000, about 10 s on 2 cores) and DEEPINFER_FUZZ_SEED (default 0) pick
the cases.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path


CASES = int(os.environ.get("DEEPINFER_FUZZ_CASES", "1000"))
SEED = int(os.environ.get("DEEPINFER_FUZZ_SEED", "0"))
WORKERS = 2
INDEX = "model.safetensors.index.json"

DEEP = 100000
# wrong types and values for any JSON field; NaN and Infinity are written as JSON extensions
JUNK = ["", "x", "64", "../model.safetensors", "/etc/passwd", "\ud800", "\udcff", 1.5, -1.0, 256.0, None, True,
        False, [], {}, [1, 2], [[64]], {"a": [1]}, 0, -1, 1, 2, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 63), 10 ** 30,
        float("nan"), float("inf"), float("-inf"), "x" * 5000]
RAW_VALUES = ["[" * DEEP + "]" * DEEP, '{"a":' * 5000 + "1" + "}" * 5000, "9" * 5000, "1e999999", "-0"]


# ---------------------------------------------------------------------------- mutations


def _json_paths(v, path=()):
    """Every place in a JSON value: dict keys and list indices, recursively."""
    if isinstance(v, dict):
        items = v.items()
    elif isinstance(v, list):
        items = enumerate(v)
    else:
        return
    for k, x in items:
        yield path + (k,)
        yield from _json_paths(x, path + (k,))


def _replace(doc, path, value):
    holder = doc
    for k in path[:-1]:
        holder = holder[k]
    holder[path[-1]] = value


def _nudge(rng, v):
    """A plausible wrong value: off by one, zero, negative, doubled, or junk."""
    if isinstance(v, int) and not isinstance(v, bool):
        return rng.choice([v + 1, v - 1, 0, -v, 2 * v, v // 2, v * 4096])
    return rng.choice(JUNK)


def _mutate_json(rng, doc):
    """(description, new JSON text) for a mutation of the value `doc`."""
    paths = list(_json_paths(doc))
    kind = rng.choice(["junk", "nudge", "delete", "raw"] if paths else ["raw"])
    if kind == "raw":
        if paths and rng.random() < 0.7:
            path = rng.choice(paths)
            _replace(doc, path, "@RAW@")
        else:
            path, doc = (), "@RAW@"
        raw = rng.choice(RAW_VALUES)
        return f"raw {list(path)[-3:]} <- {raw[:12]}...", json.dumps(doc).replace('"@RAW@"', raw)
    path = rng.choice(paths)
    if kind == "delete":
        holder = doc
        for k in path[:-1]:
            holder = holder[k]
        del holder[path[-1]]
        return f"delete {list(path)[-3:]}", json.dumps(doc)
    holder = doc
    for k in path:
        holder = holder[k]
    value = _nudge(rng, holder) if kind == "nudge" else rng.choice(JUNK)
    _replace(doc, path, value)
    return f"{kind} {list(path)[-3:]} <- {ascii(value)[:20]}", json.dumps(doc)


def _flip(rng, data: bytes, lo: int, hi: int) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        b[rng.randrange(lo, max(hi, lo + 1))] ^= rng.randint(1, 255)
    return bytes(b)


def _shard_mutation(rng, data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    kind = rng.choice(["flip_header", "flip_any", "truncate", "length", "json", "json", "overlap"])
    if kind == "flip_header":
        return kind, _flip(rng, data, 8, 8 + n)
    if kind == "flip_any":
        return kind, _flip(rng, data, 0, len(data))
    if kind == "truncate":
        cut = rng.randrange(len(data))
        return f"truncate {cut}", data[:cut]
    if kind == "length":
        length = rng.choice([0, n - 1, n + 1, len(data), 2 ** 64 - 1, 2 ** 63, rng.randrange(2 ** 32)])
        return f"length {length}", struct.pack("<Q", length) + data[8:]
    if kind == "overlap":
        names = [k for k in header if k != "__metadata__"]
        a, b = rng.choice(names), rng.choice(names)
        shift = rng.choice([0, 1, 4, -4])
        header[b]["data_offsets"] = [max(0, o + shift) for o in header[a]["data_offsets"]]
        text = json.dumps(header)
        desc = f"offsets of {b} <- {a} + {shift}"
    else:
        desc, text = _mutate_json(rng, header)
    raw = text.encode()
    return desc, struct.pack("<Q", len(raw)) + raw + body


def mutation(rng: random.Random, base: Path):
    """(description, target file name, what to do to a copy of `base`)."""
    target = rng.choice(["config.json"] * 3 + [INDEX] * 2 + ["shard"] * 5)
    if target == "shard":
        target = rng.choice(sorted(p.name for p in base.glob("*.safetensors")))
    data = (base / target).read_bytes()
    r = rng.random()
    if r < 0.05:
        return f"{target}: a directory", target, lambda p: (p.unlink(), p.mkdir())
    if r < 0.10:
        # a link out of the model directory, to the same file in the base copy
        return f"{target}: a link outside", target, lambda p: (p.unlink(), p.symlink_to(base / target))
    if target.endswith(".safetensors"):
        desc, new = _shard_mutation(rng, data)
    elif r < 0.2:
        desc, new = "flip", _flip(rng, data, 0, len(data))
    elif r < 0.25:
        cut = rng.randrange(len(data))
        desc, new = f"truncate {cut}", data[:cut]
    else:
        desc, text = _mutate_json(rng, json.loads(data))
        new = text.encode()
    return f"{target}: {desc}", target, lambda p: p.write_bytes(new)


# ---------------------------------------------------------------------------- one case


def _load(d: Path, backend):
    """Everything a model load reads from the directory: config, index, headers, the weights (which
    must use every tensor), every array."""
    import numpy as np

    from deepinfer.model import Checkpoint, WeightLoader

    ck = Checkpoint(d)
    c = ck.config
    mtp = c.has_mtp and f"model.layers.{c.num_hidden_layers}.eh_proj.weight" in ck
    WeightLoader(ck, backend, "f32", None, 64).load(mtp)
    for name in ck.names():
        np.asarray(ck.array(name)).tobytes()


def _restore(base: Path, work: Path, target: str) -> None:
    for p in list(work.iterdir()):
        if p.name == target or not (base / p.name).exists():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    shutil.copy(base / target, work / target)


def run_cases(base: Path, work: Path, seed: int, cases) -> None:
    import deepinfer
    from deepinfer.errors import DeepinferError

    backend = deepinfer.get_backend("reference")
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(base, work)
    for i in cases:
        desc, target, apply = mutation(random.Random(f"{seed}:{i}"), base)
        print(f"start {i} {ascii(desc)}", flush=True)
        apply(work / target)
        try:
            _load(work, backend)
            outcome = "ok"
        except DeepinferError as e:
            outcome = f"error {type(e).__name__}"
        except BaseException as e:     # noqa: B036 -- what the test is looking for
            outcome = f"BUG {type(e).__name__}: {ascii(str(e))[:300]}"
        _restore(base, work, target)
        print(f"end {i} {outcome}", flush=True)


# ---------------------------------------------------------------------------- the test


def _outcomes(out: str):
    started, ended = {}, {}
    for line in out.splitlines():
        tag, _, rest = line.partition(" ")
        i, _, text = rest.partition(" ")
        if tag in ("start", "end") and i.isdigit():
            (started if tag == "start" else ended)[int(i)] = text
    return started, ended


def test_fuzz_model_file_parsers(tiny_checkpoint, tmp_path):
    base, _, _ = tiny_checkpoint("v3")      # config, an index over 9 shards, an MTP layer
    procs = []
    for w in range(WORKERS):
        cmd = [sys.executable, __file__, str(base), str(tmp_path / f"w{w}"), str(SEED),
               *map(str, range(w, CASES, WORKERS))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 60 + CASES // 10    # a case takes milliseconds
    problems, counts = [], {"ok": 0, "error": 0}
    for p in procs:
        hung = False
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            out, _ = p.communicate()
        started, ended = _outcomes(out)
        for i, desc in started.items():
            outcome = ended.get(i)
            if outcome is None:
                why = "hung" if hung else f"killed the worker (exit {p.returncode})"
                problems.append(f"case {i} ({desc}) {why}:\n{out[-2000:]}")
            elif outcome.startswith("BUG"):
                problems.append(f"case {i} ({desc}): {outcome}")
            else:
                counts[outcome.split()[0]] += 1
        if p.returncode != 0 and not hung and len(started) == len(ended):
            problems.append(f"worker exited {p.returncode} outside a case:\n{out[-2000:]}")
    again = f"rerun one with: python {__file__} {base} /tmp/fuzz_work {SEED} N"
    assert not problems, f"{len(problems)} fuzz cases failed ({again}):\n" + "\n".join(problems[:20])
    assert counts["ok"] + counts["error"] == CASES, counts
    # the mutations reach past the parsers: some still load, most are refused
    assert counts["ok"] > 0 and counts["error"] > CASES // 2, counts


if __name__ == "__main__":
    run_cases(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), [int(i) for i in sys.argv[4:]])
