"""deepinfer's CPU backend against llama.cpp on the same checkpoints, threads and token counts (issue 21).

    python benchmarks/bench_cpu_vs_llamacpp.py [--models nano v2lite] [--precisions bf16 int8 w8a8 int4 w4a8]
        [--reps 5] [--threads 2] [--prompt 128] [--gen 128] [--work-dir ~/.cache/deepinfer/llamacpp-VERSION]
        [--out-dir benchmarks/results] [--llama-bin DIR] [--llama-sdist FILE.tar.gz] [--lib libdeepinfer_cpu.so]
        [--deepinfer-root DIR] [--commit SHA] [--note TEXT]

A full default run takes about 12 minutes on 2 cores once llama.cpp is built (the first run also builds it,
about 4 minutes, writes the random V2-Lite-shaped checkpoint, ~1 minute, and converts, ~1.5 minutes; ~13 GB
under --work-dir). To measure a given commit rather than the working tree (e.g. a baseline while the
tree is being edited), export it and build its library, then point --deepinfer-root at it:

    git archive SHA | tar -x -C /tmp/di && cmake -S /tmp/di -B /tmp/di/build && cmake --build /tmp/di/build -j2
    python benchmarks/bench_cpu_vs_llamacpp.py --deepinfer-root /tmp/di --commit SHA

What it does, every step but the measurements cached under --work-dir:
  1. llama.cpp: the llama-cpp-python source distribution from PyPI (or --llama-sdist) carries llama.cpp in
     vendor/llama.cpp; only llama-bench and llama-quantize are built (GGML_NATIVE=ON, static, -j2; skipped
     when the binaries exist). --llama-bin DIR uses an existing build instead.
  2. Models: "nano" is the embedded runtime/deepinfer/assets/deepseek-v3-nano (5 layers, V3 architecture;
     the converter skips its MTP layer); "v2lite" is a random bf16 checkpoint shaped like the published
     DeepSeek-V2-Lite (tests/data/hub_configs/deepseek-v2-lite.json) cut to 4 layers, vocabulary 102400
     kept (benchmarks/_v2lite_random.py). llama.cpp's own convert_hf_to_gguf.py makes a bf16 GGUF of each
     (two in-memory workarounds, see CONVERT_WRAPPER), then llama-quantize makes Q8_0 and Q4_0 (its
     defaults: Q4_0 files keep output.weight in Q6_K).
  3. Pairs: deepinfer bf16 vs BF16; int8 (weight-only) and w8a8 vs Q8_0; int4 and w4a8 vs Q4_0 (llama.cpp's
     Q8_0/Q4_0 dot products quantize activations to 8 bit, so w8a8/w4a8 are the like-for-like rows).
     llama.cpp: `llama-bench -p P -n G -t T -r 1 -o json` per repetition; deepinfer: what a user gets
     (deepinfer.engine.Engine on the CPU backend with num_threads=T, greedy, EOS ignored): prefill of a
     P-token prompt and G decoded tokens at batch 1, after a warm-up request. Every measurement runs in a
     subprocess of its own, the engines alternate (the order reversed every other repetition), and all are
     pinned to the same T CPUs with the same OMP/BLAS thread variables. Median and best over --reps.
  4. Memory bandwidth of the machine: copy, triad and read-only sum (a C program compiled on the fly with
     gcc -O3 -fopenmp, T threads, 512 MiB arrays, bytes read + written), before and after the engines.
     For v2lite, decode is also a fraction of it: weight bytes one decode token reads as each engine
     stores them (one embedding row, attention and dense MLPs, router, shared experts, 6 of 64 routed
     experts per MoE layer, norms, lm_head) x tokens/s / bandwidth.
  5. A markdown table (printed last) and JSON in --out-dir/cpu_vs_llamacpp_YYYYMMDD_COMMIT.{md,json} (a
     suffix _2, _3, ... rather than over an earlier run's files): date, CPU
     and its flags of interest, threads, commits, the command line, deepinfer/llama.cpp ratios.

Not a test: the numbers depend on the machine, nothing here asserts on them.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "runtime/deepinfer/assets/deepseek-v3-nano"
PYPI_JSON = "https://pypi.org/pypi/llama-cpp-python/json"
LLAMA_TARGETS = ("llama-bench", "llama-quantize")
PRECISIONS = ("bf16", "int8", "w8a8", "int4", "w4a8")
GGUF_TYPE = {"bf16": "BF16", "int8": "Q8_0", "w8a8": "Q8_0", "int4": "Q4_0", "w4a8": "Q4_0"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd, logfile: Path | None = None, **kw):
    """Run cmd (checked); with logfile its output goes there and a failure shows the tail."""
    shown = ["<convert wrapper>" if c is CONVERT_WRAPPER else shlex.quote(str(c)) for c in cmd]
    log("+ " + " ".join(shown) + (f"  > {logfile}" if logfile else ""))
    if logfile is None:
        return subprocess.run([str(c) for c in cmd], check=True, **kw)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "w") as f:
        p = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, **kw)
    if p.returncode:
        raise SystemExit(f"{Path(str(cmd[0])).name} failed ({p.returncode}); the end of {logfile}:\n"
                         + logfile.read_text(errors="replace")[-3000:])
    return p


# ----------------------------------------------------------------------------------------------- llama.cpp


def fetch_sdist(work: Path, given: str | None) -> Path:
    """The llama-cpp-python sdist: --llama-sdist, else the newest one on PyPI (cached in work)."""
    if given:
        return Path(given).expanduser().resolve()
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as r:
        meta = json.load(r)
    sd = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    url = urllib.parse.urljoin(PYPI_JSON, sd["url"])   # PyPI may give a relative url
    dst = work / Path(urllib.parse.urlparse(url).path).name
    if not dst.is_file() or dst.stat().st_size != sd.get("size", dst.stat().st_size):
        log(f"downloading {url}")
        tmp = dst.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        tmp.rename(dst)
    return dst


def sdist_version(path: Path) -> str:
    """The version in the file name (name-1.2.3.tar.gz), else the Version line of its PKG-INFO."""
    m = re.search(r"-(\d[\w.+]*)\.(tar\.gz|tgz)$", path.name)
    if m:
        return m.group(1)
    with tarfile.open(path) as tf:
        for member in tf:
            if member.name.count("/") == 1 and member.name.endswith("/PKG-INFO"):
                for line in tf.extractfile(member).read().decode(errors="replace").splitlines():
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
    return "unknown"


def pypi_version() -> str | None:
    try:
        with urllib.request.urlopen(PYPI_JSON, timeout=30) as r:
            return json.load(r)["info"]["version"]
    except Exception:
        return None


def extract_llama(sdist: Path, work: Path) -> Path:
    """vendor/llama.cpp of the sdist, extracted once into work/src."""
    src = work / "src" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file() and (src / "convert_hf_to_gguf.py").is_file():
        return src
    tmp = Path(tempfile.mkdtemp(dir=work, prefix="extract_"))
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        try:
            tf.extractall(tmp, members=members, filter="data")
        except TypeError:   # Python without extraction filters
            tf.extractall(tmp, members=members)
    found = next(tmp.glob("*/vendor/llama.cpp"))
    if (found / ".git").is_file():      # a submodule pointer to a .git/modules the tree does not have here
        (found / ".git").unlink()
    with tarfile.open(sdist) as tf:     # the vendored llama.cpp commit: the submodule's HEAD in the sdist
        head = next((m for m in tf.getmembers() if m.name.endswith(".git/modules/vendor/llama.cpp/HEAD")), None)
        if head is not None:
            (work / "llama_commit.txt").write_text(tf.extractfile(head).read().decode().strip() + "\n")
    src.parent.mkdir(parents=True, exist_ok=True)
    if src.exists():
        shutil.rmtree(src)
    found.rename(src)
    shutil.rmtree(tmp)
    return src


def build_llama(src: Path, work: Path, jobs: int) -> tuple[Path, float | None]:
    """llama-bench and llama-quantize in work/build/bin; (bin dir, build seconds or None if cached)."""
    bdir = work / "build"
    bins = bdir / "bin"
    if all((bins / t).is_file() for t in LLAMA_TARGETS):
        return bins, None
    t0 = time.time()
    run(["cmake", "-S", src, "-B", bdir, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"], work / "logs" / "cmake-configure.log")
    run(["cmake", "--build", bdir, "--config", "Release", "-j", str(jobs), "--target", *LLAMA_TARGETS],
        work / "logs" / "cmake-build.log")
    secs = time.time() - t0
    (work / "build_seconds.txt").write_text(f"{secs:.0f}\n")
    return bins, secs


def llama_commit(work: Path) -> str | None:
    p = work / "llama_commit.txt"
    return p.read_text().strip() if p.is_file() else None


def find_llama_src(bins: Path) -> Path | None:
    """A llama.cpp source tree above an existing build's bin directory (for convert_hf_to_gguf.py)."""
    for d in [bins, *bins.parents][:5]:
        if (d / "convert_hf_to_gguf.py").is_file() and (d / "gguf-py").is_dir():
            return d
    return None


# ------------------------------------------------------------------------------------------- models


# run by `python -c`: llama.cpp's converter, unchanged but for two things patched in memory:
#  - a BPE pre-tokenizer whose hash it does not know (the embedded model's own byte-level BPE, GPT-2's split
#    regex) is called "gpt-2" instead of an error; llama-bench never tokenizes text, so this only labels it;
#  - a DeepSeek-V2 model without q_lora_rank (V2-Lite's q_proj) gets q_lora_rank = 0 written: llama.cpp
#    knows a "lite" model by its layer count (26 or 27) and otherwise requires the key, so the 4-layer
#    V2-Lite shape would not load; 0 is what it assumes for the real V2-Lite.
CONVERT_WRAPPER = r"""
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import conversion.deepseek as deepseek
_sgp = deepseek.DeepseekV2Model.set_gguf_parameters
def _set_gguf_parameters(self):
    _sgp(self)
    if self.hparams.get("q_lora_rank") is None and self.hparams["num_hidden_layers"] not in (26, 27):
        print("bench: no q_lora_rank; writing q_lora_rank = 0 (llama.cpp only infers it for 26/27 layers)",
              file=sys.stderr)
        self.gguf_writer.add_q_lora_rank(0)
deepseek.DeepseekV2Model.set_gguf_parameters = _set_gguf_parameters
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        print("bench: unknown BPE pre-tokenizer hash; labelling it gpt-2 (byte-level BPE, GPT-2 regex)",
              file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def model_dir(name: str, work: Path) -> Path:
    if name == "nano":
        return NANO
    if name == "v2lite":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import _v2lite_random

        t0 = time.time()
        d = _v2lite_random.make(work / "models" / "v2lite-4l", layers=4)
        log(f"v2lite checkpoint ready in {time.time() - t0:.0f} s: {d}")
        return d
    raise SystemExit(f"unknown model {name!r} (nano, v2lite)")


def ggufs(name: str, mdir: Path, src: Path | None, bins: Path, work: Path, types: list, threads: int) -> dict:
    """{"BF16": path, "Q8_0": path, "Q4_0": path} (those in types), converted and quantized once."""
    out = work / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    bf16 = out / f"{name}-BF16.gguf"
    res = {}
    if not bf16.is_file():
        if src is None:
            raise SystemExit("no llama.cpp source tree for convert_hf_to_gguf.py: give --llama-sdist or a --llama-bin "
                             "inside a llama.cpp checkout")
        tmp = bf16.with_suffix(".part")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
        t0 = time.time()
        run([sys.executable, "-c", CONVERT_WRAPPER, src, mdir, "--outtype", "bf16", "--outfile", tmp],
            work / "logs" / f"convert-{name}.log", env=env)
        tmp.rename(bf16)
        log(f"{name}: converted to {bf16.name} in {time.time() - t0:.0f} s")
    for t in types:
        if t == "BF16":
            res[t] = bf16
            continue
        q = out / f"{name}-{t}.gguf"
        if not q.is_file():
            tmp = q.with_suffix(".part")
            run([bins / "llama-quantize", bf16, tmp, t, str(threads)], work / "logs" / f"quantize-{name}-{t}.log")
            tmp.rename(q)
        res[t] = q
    return res


def gguf_bytes_per_token(path: Path, src: Path | None) -> dict | None:
    """Weight bytes one decode token reads from a GGUF (as stored): one embedding row, top-k of the routed
    experts' rows, every other tensor whole."""
    if src is None:
        return None
    sys.path.insert(0, str(src / "gguf-py"))
    try:
        from gguf import GGUFReader
    except Exception as e:     # noqa: BLE001
        log(f"gguf-py unavailable ({e}); no llama.cpp bytes per token")
        return None
    r = GGUFReader(str(path))

    def field(suffix):
        for k, f in r.fields.items():
            if k.endswith(suffix):
                return int(f.parts[f.data[0]][0])
        return None

    E, K = field(".expert_count"), field(".expert_used_count")
    parts = {"embedding_row": 0, "routed_experts": 0, "lm_head": 0, "other": 0}
    for t in r.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            parts["embedding_row"] += n // int(t.shape[-1])     # gguf shapes are [ne0 = H, ne1 = V]
        elif "_exps" in t.name and E and K:
            parts["routed_experts"] += n * K // E
        elif t.name == "output.weight":
            parts["lm_head"] += n
        else:
            parts["other"] += n
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------- bandwidth

TRIAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(int argc, char **argv) {
    long n = atol(argv[1]); int reps = atoi(argv[2]);
    double *a = malloc(n * 8), *b = malloc(n * 8), *c = malloc(n * 8);
    const double q = 3.0;
    double tc = 1e30, tt = 1e30, tr = 1e30;
    unsigned long sum = 0;
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) { a[i] = 1.0; b[i] = 2.0; c[i] = 0.5; }
    for (int r = 0; r < reps; r++) {
        double t = omp_get_wtime();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) c[i] = a[i];
        t = omp_get_wtime() - t; if (t < tc) tc = t;
        t = omp_get_wtime();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) a[i] = b[i] + q * c[i];
        t = omp_get_wtime() - t; if (t < tt) tt = t;
        const unsigned long *u = (const unsigned long *)b;
        unsigned long acc = 0;
        t = omp_get_wtime();
        #pragma omp parallel for schedule(static) reduction(+:acc)
        for (long i = 0; i < n; i++) acc += u[i];
        t = omp_get_wtime() - t; if (t < tr) tr = t;
        sum += acc;
    }
    printf("{\"copy_gbs\": %.2f, \"triad_gbs\": %.2f, \"read_gbs\": %.2f, \"threads\": %d, \"array_bytes\": %ld, "
           "\"check\": %lu}\n", 16.0 * n / tc / 1e9, 24.0 * n / tt / 1e9, 8.0 * n / tr / 1e9,
           omp_get_max_threads(), n * 8, sum & 1);
    return 0;
}
"""


def bandwidth(work: Path, threads: int, cpus: list) -> dict:
    """STREAM-like copy (16 B/element: read + write), triad (24 B) and read-only sum (8 B) over 512 MiB
    arrays on `threads` OpenMP threads pinned like the engines; best of 10."""
    exe = work / "triad"
    c = work / "triad.c"
    if not exe.is_file() or not c.is_file() or c.read_text() != TRIAD_C:
        c.write_text(TRIAD_C)
        run(["gcc", "-O3", "-march=native", "-fopenmp", "-o", exe, c])
    out = subprocess.run([str(exe), str(1 << 26), "10"], check=True, capture_output=True, text=True,
                         env=child_env(threads), preexec_fn=pin(cpus)).stdout
    bw = json.loads(out)
    bw.pop("check", None)
    bw["bound_gbs"] = max(bw["copy_gbs"], bw["triad_gbs"], bw["read_gbs"])
    return bw


# ------------------------------------------------------------------------------------------ engines


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = str(threads)
    return env


def pin(cpus: list):
    return lambda: os.sched_setaffinity(0, cpus)


def run_llama(bins: Path, gguf: Path, a, cpus: list) -> dict:
    """One llama-bench repetition (its own warm-up run first): prompt and generation tokens/s."""
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-p", str(a.prompt), "-n", str(a.gen), "-t", str(a.threads),
           "-r", "1", "-o", "json", "--load-mode", a.llama_load_mode]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(a.threads), preexec_fn=pin(cpus))
    if p.returncode:
        raise RuntimeError(f"llama-bench failed ({p.returncode}): {p.stderr[-2000:]}")
    res = {"cmd": " ".join(cmd)}
    for e in json.loads(p.stdout):
        key = "prefill_tok_s" if e["n_prompt"] and not e["n_gen"] else "decode_tok_s"
        res[key] = float(e["avg_ts"])
        for k in ("build_commit", "build_number", "cpu_info", "model_type", "model_size", "model_n_params",
                  "flash_attn", "n_batch", "n_ubatch", "type_k", "type_v"):
            if k in e:
                res[k] = e[k]
    return res


def run_deepinfer(mdir: Path, prec: str, a, cpus: list) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(mdir), prec, "--threads", str(a.threads),
           "--prompt", str(a.prompt), "--gen", str(a.gen), "--deepinfer-root", str(a.deepinfer_root),
           "--lm-head", a.lm_head]
    if a.lib:
        cmd += ["--lib", a.lib]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(a.threads), preexec_fn=pin(cpus))
    if p.returncode:
        raise RuntimeError(f"deepinfer child failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def deepinfer_bytes_per_token(runner) -> dict:
    """Weight bytes one batch-1 decode token reads in deepinfer's own storage (as loaded), by
    _decode_bytes.step_bytes (the GPU benchmark's accounting): the embedding row, the top-k routed
    experts, lm_head, and everything else (attention with kv_b's dense copy, dense and shared MLPs,
    router, norms)."""
    from _decode_bytes import step_bytes

    p = step_bytes(runner.weights, runner.cfg, 1, 0)
    parts = {"embedding_row": p["embedding_rows"], "routed_experts": p["routed_experts"], "lm_head": p["lm_head"],
             "other": p["attention"] + p["dense_mlp"] + p["shared_experts"] + p["router"] + p["norms"]}
    parts["total"] = sum(parts.values())
    return parts


def child(a) -> None:
    """One deepinfer measurement in this process: the engine a user gets (CPU backend, num_threads), a
    warm-up request, then one timed request of a.prompt random tokens + a.gen greedy tokens, EOS ignored."""
    import importlib.util
    import random

    runtime = (Path(a.deepinfer_root) / "runtime").resolve()
    sys.path.insert(0, str(runtime))
    # an editable install's import hook (scikit-build-core's redirecting finder) would import the installed
    # tree whatever sys.path says: drop any finder that resolves deepinfer outside --deepinfer-root
    for f in list(sys.meta_path):
        try:
            spec = f.find_spec("deepinfer", None) if hasattr(f, "find_spec") else None
        except Exception:     # noqa: BLE001
            spec = None
        if spec is not None and spec.origin and not Path(spec.origin).resolve().is_relative_to(runtime):
            sys.meta_path.remove(f)
    assert Path(importlib.util.find_spec("deepinfer").origin).resolve().is_relative_to(runtime)
    import deepinfer
    from deepinfer.engine import Engine, SamplingParams

    mdir, prec = Path(a.child[0]), a.child[1]
    P, G = a.prompt, a.gen
    cfg = {"backend": a.lib or "cpu", "precision": prec, "max_batch": 1, "max_seq_len": P + G + 16,
           "kv_cache_tokens": P + G + 32, "max_num_batched_tokens": max(512, P), "enable_prefix_cache": False,
           "num_threads": a.threads, "speculative": {"mtp": False}}
    if a.lm_head == "int8" and prec != "bf16":
        cfg["quantize_lm_head"] = True      # llama.cpp's Q8_0 / Q4_0 files quantize output.weight too
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(str(mdir), config=cfg)
    load_s = time.perf_counter() - t0
    V = eng.runner.cfg.vocab_size
    rng = random.Random(1234)

    def request(n_prompt, n_new):
        ids = [rng.randrange(3, V) for _ in range(n_prompt)]
        eng.add_request(ids, SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True))
        times, n = [time.perf_counter()], 0
        while eng.has_unfinished():
            outs = eng.step()
            times.append(time.perf_counter())
            n += sum(len(o.token_ids) for o in outs)
        return times, n

    request(P, 3)                      # warm-up: traces and binds the prefill and decode plans
    times, n = request(P, G + 1)       # the first token comes from prefill, then G decode steps
    assert n == G + 1, (n, G)
    prefill_s = times[1] - times[0]
    decode_s = times[-1] - times[1]
    try:
        bpt = deepinfer_bytes_per_token(eng.runner)
    except Exception as e:     # noqa: BLE001  (the weights' layout is internal and may change)
        bpt = {"error": repr(e)}
    print(json.dumps({"prefill_tok_s": P / prefill_s, "decode_tok_s": G / decode_s, "load_s": load_s,
                      "backend": eng.backend.name, "precision_note": getattr(eng.runner, "precision_note", None),
                      "deepinfer_file": deepinfer.__file__, "bytes_per_token": bpt}))


# ----------------------------------------------------------------------------------------------- report


def summarize_bandwidth(bws: list) -> dict:
    """Medians of the measurements; the bound is the median of each measurement's best kernel."""
    bw = {k: statistics.median(b[k] for b in bws) for k in ("copy_gbs", "triad_gbs", "read_gbs", "bound_gbs")}
    bw["bound_min_gbs"] = min(b["bound_gbs"] for b in bws)
    bw["bound_max_gbs"] = max(b["bound_gbs"] for b in bws)
    bw["samples"] = bws
    return bw


def bandwidth_fractions(rows: list, bound_gbs: float) -> None:
    """Decode weight bytes per token x median decode tokens/s over the bandwidth bound, per engine."""
    for row in rows:
        bpt = row.get("bytes_per_token")
        if not bpt:
            continue
        for eng, key in (("deepinfer", "deepinfer"), ("llama", "llama")):
            tps = row[eng]["decode"]["median"]
            if bpt.get(key) and tps:
                row[f"bw_fraction_{eng}"] = bpt[key] * tps / (bound_gbs * 1e9)


def cpu_times() -> list | None:
    """The aggregate cpu line of /proc/stat (user nice system idle iowait irq softirq steal ...)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None


def cpu_info() -> dict:
    model, flags, ident = platform.processor() or platform.machine(), [], []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "model name":
                model = v.strip()
            elif k.strip() in ("cpu family", "model"):
                ident.append(f"{k.strip()} {v.strip()}")
            elif k.strip() == "flags":
                flags = v.split()
                break
    except OSError:
        pass
    want = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512bw", "avx_vnni")
            or f.startswith("amx")]
    if ident:
        model += f" ({', '.join(ident)})"
    return {"model": model, "flags": want, "logical_cpus": os.cpu_count()}


def git_info(root: Path, given: str | None) -> dict:
    def g(*args):
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    commit = given or g("rev-parse", "HEAD")
    dirty = g("status", "--porcelain", "--", "runtime", "backends", "abi")
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else None}


def stats(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "best": None, "worst": None, "samples": []}
    return {"median": statistics.median(xs), "best": max(xs), "worst": min(xs), "samples": xs}


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def cell(st: dict) -> str:
    """median (worst-best)"""
    if st["median"] is None:
        return "-"
    nd = 0 if st["median"] >= 1000 else 1
    return f"{fmt(st['median'], nd)} ({fmt(st['worst'], nd)}-{fmt(st['best'], nd)})"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def markdown(res: dict) -> str:
    m = res["meta"]
    L = [f"# deepinfer CPU vs llama.cpp ({m['date']})", ""]
    if m.get("note"):
        L += [m["note"], ""]
    bw = m["bandwidth"]
    L += [f"- CPU: {m['cpu']['model']} ({m['cpu']['logical_cpus']} logical CPUs); flags: "
          f"{', '.join(m['cpu']['flags']) or 'none of interest'}",
          f"- threads: {m['threads']} (both engines pinned to CPUs {m['cpus']}); prompt {m['prompt']} tokens, "
          f"generation {m['gen']} tokens, batch 1, {m['reps']} repetitions: tokens/s as median (worst-best)",
          f"- deepinfer: commit {m['git']['commit']}{' (+ uncommitted changes)' if m['git']['dirty'] else ''}, "
          f"backend {m.get('deepinfer_backend')}",
          f"- llama.cpp: vendored in the llama-cpp-python {m['llama']['version']} sdist, commit "
          f"{m['llama'].get('commit') or m['llama'].get('build_commit')}; built with GGML_NATIVE=ON, static; "
          f"GGUFs by its convert_hf_to_gguf.py (bf16) and llama-quantize",
          f"- memory bandwidth ({m['threads']} threads, 512 MiB arrays, bytes read + written; medians of "
          f"{len(bw['samples'])} measurements spread over the run): copy {bw['copy_gbs']:.1f}, triad "
          f"{bw['triad_gbs']:.1f}, read {bw['read_gbs']:.1f} GB/s. The bound used below is the median of each "
          f"measurement's best kernel, {bw['bound_gbs']:.1f} GB/s; it ranged {bw['bound_min_gbs']:.1f}-"
          f"{bw['bound_max_gbs']:.1f} GB/s during the run, so the % columns are approximate",
          f"- load average (1 min) before / after: {m['loadavg_before_after'][0]} / {m['loadavg_before_after'][1]}; "
          f"CPU time stolen by the hypervisor during the run: "
          f"{'-' if m.get('steal_fraction') is None else format(m['steal_fraction'], '.1%')}",
          f"- command: `{m['command']}`", ""]
    hdr = ("| model | deepinfer | llama.cpp | prefill tok/s deepinfer | prefill tok/s llama.cpp | prefill ratio "
           "| decode tok/s deepinfer | decode tok/s llama.cpp | decode ratio | weights MB/token di / llama "
           "| % of bandwidth di / llama |")
    L += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in res["rows"]:
        d, l = r["deepinfer"], r["llama"]
        bw_cols = ["-", "-"]
        if r.get("bytes_per_token"):
            bd, bl = r["bytes_per_token"].get("deepinfer"), r["bytes_per_token"].get("llama")
            bw_cols = [f"{fmt(bd and bd / 1e6, 0)} / {fmt(bl and bl / 1e6, 0)}",
                       f"{fmt(r.get('bw_fraction_deepinfer') and 100 * r['bw_fraction_deepinfer'], 0)} / "
                       f"{fmt(r.get('bw_fraction_llama') and 100 * r['bw_fraction_llama'], 0)}"]
        L.append("| " + " | ".join([
            r["model"], r["precision"], r["gguf"],
            cell(d["prefill"]), cell(l["prefill"]), fmt(r["prefill_ratio"], 2),
            cell(d["decode"]), cell(l["decode"]), fmt(r["decode_ratio"], 2), *bw_cols]) + " |")
    L += ["", "Ratios are deepinfer / llama.cpp of the medians (> 1: deepinfer faster). "
          "deepinfer: deepinfer.engine.Engine, CPU backend, f32 activations, greedy, EOS ignored; prefill = the "
          "step that "
          "computes the whole prompt and samples the first token, decode = the next "
          f"{m['gen']} steps (each with its sampling), one subprocess per measurement after a warm-up request. "
          f"llama.cpp: llama-bench pp/tg (--load-mode {m.get('llama_load_mode')}), its own warm-up, one subprocess per "
          "repetition; its tg test generates from an "
          "empty context (deepinfer's decode attends to the prompt too, a small extra cost at this length). "
          "int8/int4 are weight-only (f32 activations); w8a8/w4a8 quantize activations to int8 like Q8_0/Q4_0's dot "
          f"products; deepinfer's lm_head in those rows: {m.get('lm_head', 'stored')} (llama.cpp quantizes "
          "output.weight: Q8_0 in its Q8_0 files, Q6_K in its Q4_0 ones). Weights per token: bytes one decode token reads as each engine stores them (embedding row, "
          "attention, dense and shared MLPs, router, 6 of 64 routed experts per MoE layer, norms, lm_head); % of "
          "bandwidth = that x decode tok/s / the bound above.", ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["nano", "v2lite"], choices=["nano", "v2lite"])
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--work-dir", help="cache for llama.cpp's build and the models (default "
                                       "~/.cache/deepinfer/llamacpp-VERSION)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--llama-bin", help="directory with llama-bench and llama-quantize already built")
    ap.add_argument("--llama-sdist", help="a llama-cpp-python .tar.gz instead of downloading it from PyPI")
    ap.add_argument("--lib", help="libdeepinfer_cpu.so to use (default: the one deepinfer finds)")
    ap.add_argument("--deepinfer-root", default=str(ROOT),
                    help="deepinfer source tree whose runtime/ the measurements import (default: this one)")
    ap.add_argument("--commit", help="deepinfer commit to record (default: git rev-parse HEAD of --deepinfer-root)")
    ap.add_argument("--note", help="a line for the top of the markdown")
    ap.add_argument("--lm-head", choices=["stored", "int8"], default="int8",
                    help="deepinfer's output layer in the int8/int4/w8a8/w4a8 rows: int8 per channel "
                         "(quantize_lm_head, like llama.cpp's Q8_0 / Q6_K output.weight; the default here) or as "
                         "stored (the engine's default)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    ap.add_argument("--llama-load-mode", default="none",
                    help="llama-bench --load-mode (default none: weights read into memory at load, like deepinfer; "
                         "mmap'ed weights can be evicted by the other engine's memory and read back from disk "
                         "inside the timed run)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "PRECISION"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.lib is None and Path(a.deepinfer_root).resolve() != ROOT:
        built = Path(a.deepinfer_root) / "build" / "backends" / "cpu" / "libdeepinfer_cpu.so"
        if built.is_file():     # another tree's library, not the installed one
            a.lib = str(built.resolve())
    if a.child:
        child(a)
        return 0
    cmdline = " ".join(shlex.quote(x) for x in ["python", "benchmarks/bench_cpu_vs_llamacpp.py",
                                                *(argv or sys.argv[1:])])
    t_start = time.time()
    cpus = sorted(os.sched_getaffinity(0))[: a.threads]
    if len(cpus) < a.threads:
        log(f"warning: {a.threads} threads on {len(cpus)} CPUs")

    # llama.cpp
    version = sdist_version(Path(a.llama_sdist)) if a.llama_sdist else (pypi_version() or "unknown")
    work = Path(a.work_dir or f"~/.cache/deepinfer/llamacpp-{version}").expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    build_s = None
    src = work / "src" / "llama.cpp"
    if a.llama_bin:
        bins = Path(a.llama_bin).expanduser().resolve()
        found = find_llama_src(bins)
        src = found or (src if src.is_dir() else None)
        if src is None and (a.llama_sdist or pypi_version()):
            src = extract_llama(fetch_sdist(work, a.llama_sdist), work)
    else:
        if not (src / "CMakeLists.txt").is_file():
            src = extract_llama(fetch_sdist(work, a.llama_sdist), work)
        bins, build_s = build_llama(src, work, a.jobs)
        if build_s is None and (work / "build_seconds.txt").is_file():
            took = (work / "build_seconds.txt").read_text().strip()
            log(f"llama.cpp already built in {work / 'build'} (it took {took} s)")
    if build_s is not None:
        log(f"llama.cpp built in {build_s:.0f} s")

    types = sorted({GGUF_TYPE[p] for p in a.precisions}, key=["BF16", "Q8_0", "Q4_0"].index)
    models = {}
    for name in a.models:
        mdir = model_dir(name, work)
        models[name] = (mdir, ggufs(name, mdir, src, bins, work, types, a.threads))

    load_before, stat_before = os.getloadavg(), cpu_times()
    bws = [bandwidth(work, a.threads, cpus)]     # measured again after every repetition: it varies on a VM
    log(f"bandwidth: {bws[-1]}")

    # measurements: per model, per repetition, alternate llama.cpp and deepinfer (order reversed every other rep)
    samples = {}
    for name, (mdir, gg) in models.items():
        for rep in range(a.reps):
            order = []
            for t in types:
                order.append(("llama", t))
                order += [("deepinfer", p) for p in a.precisions if GGUF_TYPE[p] == t]
            if rep % 2:
                order.reverse()
            for eng, what in order:
                t0 = time.time()
                r = run_llama(bins, gg[what], a, cpus) if eng == "llama" else run_deepinfer(mdir, what, a, cpus)
                samples.setdefault((name, eng, what), []).append(r)
                log(f"[{name} rep {rep + 1}/{a.reps}] {eng} {what}: prefill {r.get('prefill_tok_s', 0):.1f} tok/s, "
                    f"decode {r.get('decode_tok_s', 0):.2f} tok/s ({time.time() - t0:.0f} s)")
            bws.append(bandwidth(work, a.threads, cpus))
            log(f"bandwidth: {bws[-1]}")

    bw = summarize_bandwidth(bws)
    load_after, stat_after = os.getloadavg(), cpu_times()
    d = [y - x for x, y in zip(stat_before, stat_after)] if stat_before and stat_after else None
    steal = d[7] / sum(d) if d and len(d) > 7 and sum(d) else None

    first_llama = next((s[0] for k, s in samples.items() if k[1] == "llama"), {})
    first_di = next((s[0] for k, s in samples.items() if k[1] == "deepinfer"), {})
    rows = []
    for name, (mdir, gg) in models.items():
        for p in a.precisions:
            t = GGUF_TYPE[p]
            ds, ls = samples[(name, "deepinfer", p)], samples[(name, "llama", t)]
            d = {"prefill": stats([s["prefill_tok_s"] for s in ds]), "decode": stats([s["decode_tok_s"] for s in ds]),
                 "load_s": stats([s["load_s"] for s in ds])["median"], "precision_note": ds[0].get("precision_note")}
            l = {"prefill": stats([s.get("prefill_tok_s") for s in ls]),
                 "decode": stats([s.get("decode_tok_s") for s in ls]),
                 "model_size": ls[0].get("model_size"), "gguf": str(gg[t])}
            row = {"model": name, "precision": p, "gguf": t, "deepinfer": d, "llama": l,
                   "prefill_ratio": ratio(d["prefill"]["median"], l["prefill"]["median"]),
                   "decode_ratio": ratio(d["decode"]["median"], l["decode"]["median"])}
            if name == "v2lite":
                bd = ds[0].get("bytes_per_token") or {}
                bl = gguf_bytes_per_token(gg[t], src) or {}
                row["bytes_per_token"] = {"deepinfer": bd.get("total"), "llama": bl.get("total"),
                                          "deepinfer_parts": bd, "llama_parts": bl}
            rows.append(row)
    bandwidth_fractions(rows, bw["bound_gbs"])

    today = _dt.date.today()
    res = {"meta": {"date": today.isoformat(), "cpu": cpu_info(), "threads": a.threads, "cpus": cpus,
                    "prompt": a.prompt, "gen": a.gen, "reps": a.reps, "git": git_info(Path(a.deepinfer_root), a.commit),
                    "command": cmdline, "note": a.note, "bandwidth": bw,
                    "loadavg_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
                    "steal_fraction": steal, "llama_load_mode": a.llama_load_mode, "lm_head": a.lm_head,
                    "deepinfer_backend": first_di.get("backend"),
                    "deepinfer_file": first_di.get("deepinfer_file"), "lib": a.lib,
                    "llama": {"version": version, "work_dir": str(work), "bin": str(bins), "build_s": build_s,
                              "commit": llama_commit(work), "build_commit": first_llama.get("build_commit"),
                              "build_number": first_llama.get("build_number"),
                              "cpu_info": first_llama.get("cpu_info")},
                    "models": {n: str(m) for n, (m, _) in models.items()},
                    "wall_s": round(time.time() - t_start)},
           "rows": rows}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # date and commit in the name, and never over an earlier run's files
    stem = out / f"cpu_vs_llamacpp_{today.strftime('%Y%m%d')}_{str(res['meta']['git'].get('commit') or 'unknown')[:7]}"
    base, n = stem, 1
    while stem.with_suffix(".md").exists() or stem.with_suffix(".json").exists():
        n += 1
        stem = base.with_name(f"{base.name}_{n}")
    md = markdown(res)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    stem.with_suffix(".md").write_text(md)
    log(f"wrote {stem}.md and .json in {res['meta']['wall_s']} s")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
