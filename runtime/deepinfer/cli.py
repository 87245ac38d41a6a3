"""The `deepinfer` command: backends, conformance, run, eval-ppl, quantize."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Optional

from . import validate as V
from .errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, ConfigError, DeepinferError, InputError


def _cmd_backends(args) -> int:
    from .loader import candidates

    found = candidates(args.path or None)
    if args.json:
        print(json.dumps([c.__dict__ for c in found], indent=2))
        return 0
    for c in found:
        print(c.summary())
        if c.ok and args.verbose:
            for k, v in sorted(c.attributes.items()):
                print(f"    {k}: {v}")
            print(f"    ops: {', '.join(c.ops)}")
        elif c.ok:
            dev = c.attributes.get("device.name")
            extra = []
            if dev:
                extra.append(dev)
            for key, label in (("device.sm_count", "SMs"), ("device.memory_bytes", "bytes"), ("threads", "threads")):
                if key in c.attributes:
                    extra.append(f"{c.attributes[key]} {label}")
            if extra:
                print("    " + ", ".join(extra))
            print(f"    {len(c.ops)} ops")
    return 0


def _cmd_conformance(args) -> int:
    from .conformance.cli import run

    return run(args)


def _engine(args):
    from .engine import Engine

    return Engine.from_pretrained(args.model, config=args.config, **_overrides(args))


def _overrides(args) -> dict:
    """Engine config keys the command line sets (over the config file's)."""
    overrides = {}
    for key in ("tensor_parallel", "expert_parallel"):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    if getattr(args, "backend", None):
        overrides["backend"] = args.backend
    if getattr(args, "precision", None):
        overrides["precision"] = args.precision
    if getattr(args, "revision", None):
        overrides["revision"] = args.revision
    if getattr(args, "expert_cache", None) is not None:
        overrides["expert_cache"] = V.parse_json(args.expert_cache.encode(), "--expert-cache", err=ConfigError)
    if getattr(args, "speculative", None):
        from .config import EngineConfig

        spec = dict(EngineConfig.from_any(args.config).speculative) if args.config else {}
        spec["method"] = args.speculative
        if args.num_draft is not None:
            spec["num_draft"] = args.num_draft
        if args.spec_confidence is not None:
            spec["confidence"] = args.spec_confidence if args.spec_confidence == "auto" else \
                V.number("--spec-confidence", _float_or_text(args.spec_confidence), 0, 1)
        overrides["speculative"] = spec
    return overrides


def _float_or_text(s: str):
    try:
        return float(s)
    except ValueError:
        raise ConfigError(f"--spec-confidence must be auto or a number in [0, 1), not {s!r}") from None


def _cmd_run(args) -> int:
    model, prompt = _run_model_and_prompt(args.model, args.prompt)
    args.model = model
    V.utf8("the prompt", prompt)          # before loading anything: undecodable bytes in argv
    opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, stop=args.stop or None)
    eng = _engine(args)
    m = eng.runner
    # the request is checked (length, cache, options) before anything is printed
    if args.chat:
        stream = eng.chat_stream([{"role": "user", "content": prompt}], **opts)
    else:
        stream = eng.stream(prompt, **opts)
    print(f"deepinfer: {eng.model_name} on {eng.backend.name}: {getattr(m, 'precision_note', '')}"
          + (f" ({m.precision_reason})" if getattr(m, "precision_reason", "") and not eng.precision_warned else ""),
          file=sys.stderr)
    if not args.chat:
        sys.stdout.write(prompt)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        print("deepinfer: stats " + json.dumps(_round(eng.stats()), sort_keys=True), file=sys.stderr)
    eng.close()
    return 0


def _round(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def _run_model_and_prompt(first, second) -> tuple:
    """`run PROMPT`, `run MODEL PROMPT`, `run MODEL` or `run` with the prompt on stdin, `-` for stdin.
    A lone argument that is a directory is a model, never a prompt made of its path."""
    if second is None:
        if first is not None and first != "-" and not os.path.isdir(os.path.expanduser(first)):
            return None, first
        model, second = (None if first == "-" else first), "-"
    else:
        model = first
    if second != "-":
        return model, second
    if sys.stdin is None or sys.stdin.isatty():
        where = f"after the model {model!r}" if model else "as an argument"
        raise InputError(f"deepinfer run: no prompt; give it {where}, or pipe it on standard input")
    raw = sys.stdin.buffer.read(MAX_STDIN_PROMPT + 1)
    if len(raw) > MAX_STDIN_PROMPT:
        raise InputError(f"the prompt on standard input is longer than {MAX_STDIN_PROMPT} bytes")
    try:
        prompt = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"the prompt on standard input is not UTF-8 text (byte {e.start}); give text encoded "
                         f"as UTF-8") from None
    if not prompt:
        raise InputError("deepinfer run: standard input was empty; give a prompt")
    return model, prompt


MAX_STDIN_PROMPT = 64 << 20


def _cmd_serve(args) -> int:
    from .serve import serve
    from .serve.app import ServerLimits

    from .config import EngineConfig

    cfg = EngineConfig.from_any(args.config, **_serve_overrides(args))
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens=args.max_tokens)
    print(f"deepinfer: serving {args.model or 'the embedded model'} on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    try:
        serve(args.model, cfg, host=args.host, port=args.port, limits=limits, served_model_name=args.served_model_name,
              drain_timeout=args.drain_timeout, log_level="info" if args.verbose else "warning")
    except SystemExit as e:      # uvicorn exits 3 when it cannot start (the port is taken, ...); it said why
        if e.code in (0, None):
            return EXIT_OK
        raise DeepinferError(f"the server could not start on {args.host}:{args.port} (see the error above)") from None
    return EXIT_OK


def _serve_overrides(args) -> dict:
    return {k: v for k, v in dict(backend=args.backend, precision=args.precision, revision=args.revision,
                                  max_batch=args.max_batch, max_seq_len=args.max_seq_len, max_queue=args.max_queue,
                                  scheduling_policy=args.scheduling_policy, tensor_parallel=args.tensor_parallel,
                                  expert_parallel=args.expert_parallel).items() if v is not None}


def _cmd_eval_ppl(args) -> int:
    from .evaluate import main as eval_main

    return eval_main(args)


def _cmd_quantize(args) -> int:
    from .quantizer import main as quantize_main

    return quantize_main(args)


def _parallel_args(p) -> None:
    p.add_argument("--tensor-parallel", type=_int_in(1, 4096), metavar="N",
                   help="split attention heads and dense MLPs over N ranks (started with mpirun)")
    p.add_argument("--expert-parallel", type=_int_in(1, 4096), metavar="N",
                   help="spread the routed experts over N ranks (1 or the same N as --tensor-parallel)")


def _world_size(args) -> int:
    """The ranks a run / serve command asks for (its options, else its config file's)."""
    tp, ep = getattr(args, "tensor_parallel", None), getattr(args, "expert_parallel", None)
    if (tp is None or ep is None) and getattr(args, "config", None):
        from .config import EngineConfig

        cfg = EngineConfig.from_any(args.config)
        tp = cfg.tensor_parallel if tp is None else tp
        ep = cfg.expert_parallel if ep is None else ep
    return max(tp or 1, ep or 1)


def _parallel_main(args, argv) -> Optional[int]:
    """Several ranks: outside an MPI job, start this same command under mpirun; inside one, rank 0
    goes on as usual and the other ranks serve its steps. None: one rank, nothing to do here."""
    from .parallel.launch import handle_stop_signal, launch, world_from_env
    from .parallel.worker import guard, run_worker

    world = _world_size(args)
    if world == 1:
        return None
    rank, size = world_from_env()
    if size == 1:
        return launch(world, [sys.executable, "-m", "deepinfer.cli"] + list(argv))
    handle_stop_signal(rank == 0)
    if rank == 0:
        return guard(args.fn, args) or EXIT_OK
    from .config import EngineConfig
    from .engine.llm_engine import resolve_model_dir

    model = args.model
    if args.cmd == "run" and args.prompt is None and not (model and os.path.isdir(os.path.expanduser(model))):
        model = None       # `run PROMPT`: the embedded model (the prompt itself is rank 0's business)
    overrides = _overrides(args) if args.cmd == "run" else _serve_overrides(args)
    cfg = EngineConfig.from_any(args.config, **overrides)
    guard(run_worker, resolve_model_dir(model, cfg.revision), cfg)
    return EXIT_OK


def _speculative_args(p) -> None:
    p.add_argument("--speculative", choices=["mtp"], help="speculative decoding with the model's MTP module "
                   "(overrides the config file's speculative.method)")
    p.add_argument("--num-draft", type=_int_in(1, 8), help="drafts per sequence and step with --speculative (default 2)")
    p.add_argument("--spec-confidence", metavar="auto|P", help="auto (default): the throughput scheduler; P in "
                   "[0, 1): verify the drafts whose survival probability is at least P (0: always num-draft)")


def _int_in(lo: int, hi: Optional[int] = None):
    """An argparse type: an int in [lo, hi] (a usage error, exit 2, otherwise)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be at least {lo}, not {v}" if hi is None else
                                             f"must be between {lo} and {hi}, not {v}")
        return v
    return parse


def _seconds(s: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of seconds") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {s}")
    return v


EXIT_CODES = f"""exit status: {EXIT_OK} success; {EXIT_FAILURE} the work failed (a backend, a library, a failed
certification); {EXIT_USAGE} bad input (arguments, options, config, model files, prompt); {EXIT_INTERRUPTED}
interrupted; 141 the reader of the output went away (a closed pipe)"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek inference through a vendor-neutral kernel ABI",
                                epilog=EXIT_CODES)
    p.add_argument("-v", "--verbose", action="store_true", help="more output (also accepted after the command)")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("backends", help="list every backend found, with scores and the reasons for rejections")
    b.add_argument("path", nargs="*", help="extra libraries or folders to consider")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_cmd_backends)

    from .conformance import cli as conformance_cli

    c = sub.add_parser("conformance", help="certify a backend library (writes a JSON certificate)",
                       description=conformance_cli.DESCRIPTION)
    conformance_cli.add_arguments(c)
    c.set_defaults(fn=_cmd_conformance)

    r = sub.add_parser("run", help="generate text: deepinfer run [MODEL] PROMPT")
    r.add_argument("model", nargs="?", help="model directory or hub id org/name (default: the embedded model)")
    r.add_argument("prompt", nargs="?", help="the prompt; '-' or none (with a MODEL directory) reads standard input")
    r.add_argument("--config", help="engine config JSON file")
    r.add_argument("--backend")
    r.add_argument("--precision", help="auto (default: the checkpoint's own precision when it fits), fastest, "
                                        "or a format: f32 bf16 fp8 int8 int4 w8a8 w4a8")
    r.add_argument("--revision", help="branch, tag or commit of a hub id")
    r.add_argument("--max-new-tokens", type=_int_in(0), default=64)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _speculative_args(r)
    _parallel_args(r)
    r.add_argument("--expert-cache", metavar="JSON", help='routed experts on demand, e.g. \'{"capacity": 0.5, '
                   '"source": "disk"}\' (overrides the config file\'s expert_cache)')
    r.set_defaults(fn=_cmd_run)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: deepinfer serve [MODEL]")
    s.add_argument("model", nargs="?", help="model directory or hub id org/name (default: the embedded model)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_int_in(0, 65535), default=8000)
    s.add_argument("--config", help="engine config JSON file")
    s.add_argument("--backend")
    s.add_argument("--precision")
    s.add_argument("--revision", help="branch, tag or commit of a hub id")
    _speculative_args(s)
    _parallel_args(s)
    s.add_argument("--served-model-name", help="the model id clients send (default: MODEL as given)")
    s.add_argument("--max-batch", type=_int_in(1), help="sequences running together")
    s.add_argument("--max-seq-len", type=_int_in(1), help="longest prompt + completion")
    s.add_argument("--max-queue", type=_int_in(0), help="requests waiting before new ones get 503 (default 1024)")
    s.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                   help="fcfs (default): arrival order; priority: requests' `priority` (lower first), then arrival")
    s.add_argument("--max-body-bytes", type=_int_in(1), default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--max-prompt-tokens", type=_int_in(1), help="longer prompts get 400 (default max_seq_len - 1)")
    s.add_argument("--max-tokens", type=_int_in(1), help="largest max_tokens a request may ask (default max_seq_len)")
    s.add_argument("--drain-timeout", type=_seconds, default=30.0, help="seconds SIGINT/SIGTERM waits for requests")
    s.set_defaults(fn=_cmd_serve)

    e = sub.add_parser("eval-ppl", help="held-out perplexity and top-1 agreement against bf16")
    e.add_argument("model", nargs="?", help="model directory or hub id (default: the embedded model)")
    e.add_argument("--precision", default="bf16")
    e.add_argument("--revision", help="branch, tag or commit of a hub id")
    e.add_argument("--backend")
    e.add_argument("--config")
    e.add_argument("--max-tokens", type=_int_in(2), default=1 << 30, help="score at most this many tokens")
    e.add_argument("--window", type=_int_in(2), default=512,
                   help="tokens per window (the training run used 512; every token but a window's first is scored)")
    e.add_argument("--text", help="evaluate this file instead of the model's heldout.txt")
    e.set_defaults(fn=_cmd_eval_ppl)

    q = sub.add_parser("quantize", help="write a quantized copy of a model directory")
    q.add_argument("src", help="model directory or hub id")
    q.add_argument("dst")
    q.add_argument("--revision", help="branch, tag or commit of a hub id")
    q.add_argument("--format", required=True, choices=["int4", "int8", "fp8"])
    q.add_argument("--group", type=int, default=64)
    q.add_argument("--asym", action="store_true", help="int4 with zero points")
    q.add_argument("--calibration", help="text file for activation-aware scaling and clip search")
    q.set_defaults(fn=_cmd_quantize)
    for sp in sub.choices.values():
        # -v after the command too; a default of SUPPRESS keeps a -v given before it
        mine = [a for a in sp._actions if a.dest == "verbose"]
        if mine:
            mine[0].default = argparse.SUPPRESS
        else:
            sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="more output")
        sp.epilog = sp.epilog or EXIT_CODES
    return p


def main(argv=None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="deepinfer: %(message)s")
        if args.cmd in ("run", "serve"):
            rc = _parallel_main(args, argv)
            if rc is not None:
                return rc
        return args.fn(args) or EXIT_OK
    except DeepinferError as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`deepinfer run ... | head`): stop quietly, as Unix tools do; stdout
        # goes to /dev/null so that the interpreter's final flush does not complain either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
