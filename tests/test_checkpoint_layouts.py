"""Both layouts of routed experts load and compute the same model.

hub:   one tensor per expert (what DeepSeek publishes, transformers 5's default save);
fused: `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I], as transformers 5 writes
       with save_pretrained(..., save_original_format=False); fp8 with fused `_scale_inv` tensors
       shaped as transformers' integrations/finegrained_fp8.py allocates them (built by hand in
       tiny_checkpoints: transformers cannot make fp8 weights on the CPU).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import tiny_checkpoints
from deepinfer.errors import CheckpointError
from deepinfer.model import Checkpoint, TensorStore
from deepinfer.engine import ModelRunner, RunnerConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT = [5, 17, 200, 3, 99, 42, 7, 130, 64, 11]
_MADE: dict = {}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """layouts(family) -> (hub dir, fused dir, transformers oracle), each made once per module."""

    def get(family):
        if family not in _MADE:
            hub, hf, _ = tiny_checkpoints.make(family, tmp_path_factory.mktemp(f"hub_{family}"))
            fused, _, _ = tiny_checkpoints.make(family, tmp_path_factory.mktemp(f"fused_{family}"), layout="fused")
            _MADE[family] = hub, fused, hf
        return _MADE[family]

    return get


def _logits(path, be, mtp=False):
    model = ModelRunner(path, be, RunnerConfig(max_batch=2, max_seq_len=32, block_size=4))
    out = be.to_numpy(model.forward([(0, PROMPT, 0)], all_logits=True, keep_hidden=mtp)).copy()
    if not mtp:
        return out, None
    nxt = PROMPT[1:] + [int(out[-1].argmax())]
    return out, be.to_numpy(model.mtp_logits([(0, nxt, 0)], all_logits=True)).copy()


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("family", ["v2lite", "v3", "v3bf16", "v3fp8e128"])
def test_fused_and_hub_layouts_give_identical_logits(family, layouts, model_backend):
    hub, fused, hf = layouts(family)
    assert Checkpoint(hub).layout == "hub" and Checkpoint(fused).layout == "fused"
    stored = set(Checkpoint(fused).where)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in stored)
    assert not any(".experts.0." in n for n in stored), "the fused directory still has per-expert tensors"
    mtp = family in ("v3", "v3bf16")
    a, am = _logits(hub, model_backend, mtp)
    b, bm = _logits(fused, model_backend, mtp)
    assert np.isfinite(a).all()
    assert np.array_equal(a, b), "the fused layout computes different logits from the same weights"
    if mtp:
        assert np.array_equal(am, bm)
    if family != "v3bf16":   # the bf16 oracle is compared in test_model_oracle
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
        assert rel_err(b, ref) < 1e-4


def test_transformers_reads_the_fused_directory_we_read(layouts):
    """The fused directory is transformers' own format: it loads it back to the oracle's logits."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hub, fused, hf = layouts("v2lite")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        back = AutoModelForCausalLM.from_pretrained(str(fused), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    with torch.no_grad():
        x = torch.tensor([PROMPT])
        assert torch.equal(back(x).logits, hf(x).logits)


def test_expert_of_a_fused_tensor_is_a_view_into_the_map(layouts):
    for family in ("v2lite", "v3fp8e128"):
        _, fused, _ = layouts(family)
        ck = Checkpoint(fused)
        E, I = ck.config.n_routed_experts, ck.config.moe_intermediate_size
        full = ck.where["model.layers.1.mlp.experts.gate_up_proj"].array("model.layers.1.mlp.experts.gate_up_proj")
        for e in (0, E - 1):
            g = ck.array(f"model.layers.1.mlp.experts.{e}.gate_proj.weight")
            u = ck.array(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
            assert g.shape == u.shape == (I, ck.config.hidden_size)
            assert g.flags.c_contiguous and not g.flags.writeable
            assert np.shares_memory(g, full) and np.shares_memory(u, full)
            assert not np.shares_memory(g, u)
            assert np.array_equal(g.view(np.uint8), full[e, :I].view(np.uint8))
            assert np.array_equal(u.view(np.uint8), full[e, I:].view(np.uint8))
            base = g
            while base.base is not None and not isinstance(base, np.memmap):
                base = base.base
            assert isinstance(base, np.memmap), "an expert view must come from the file's memory map"
        if family == "v3fp8e128":
            t = ck.weight("model.layers.1.mlp.experts.3.up_proj.weight", (I, ck.config.hidden_size))
            assert t.dtype.name == "e4m3" and tuple(t.quant.scales.shape) == (1, 2)
            s = ck.where["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].array(
                "model.layers.1.mlp.experts.gate_up_proj_scale_inv")
            assert np.array_equal(ck.array("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"), s[3, 1:2])
    # the logical names are the hub names, whichever layout is stored
    hub, fused, _ = layouts("v2lite")
    assert sorted(Checkpoint(hub).names()) == sorted(Checkpoint(fused).names())
    a, b = Checkpoint(hub).entries(), Checkpoint(fused).entries()
    assert {n: tuple(s) for n, (_, s) in a.items()} == {n: tuple(s) for n, (_, s) in b.items()}


def test_fused_fp8_that_cannot_split_is_a_clear_error(tmp_path):
    """moe_intermediate_size 96: gate and up share a 128-row scale block, so no expert view exists."""
    d, _, _ = tiny_checkpoints.make("v3fp8", tmp_path / "fp8", layout="fused")
    with pytest.raises(CheckpointError, match=r"gate_up_proj.*save_original_format=True"):
        Checkpoint(d)


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint, passing its tensors {name: array} through `edit`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_malformed_fused_checkpoints_are_clear_errors(layouts, tmp_path):
    _, fused, _ = layouts("v2lite")
    key = "model.layers.1.mlp.experts.gate_up_proj"

    def both(t):   # a directory with the same expert in both layouts
        t["model.layers.1.mlp.experts.0.gate_proj.weight"] = t[key][0, :32].copy()
        return t

    with pytest.raises(CheckpointError, match="both on its own .* and inside the fused"):
        Checkpoint(_rewrite(fused, tmp_path / "both", both))

    def odd(t):
        t[key] = t[key][:, :-1].copy()
        return t

    with pytest.raises(CheckpointError, match="even count"):
        Checkpoint(_rewrite(fused, tmp_path / "odd", odd))

    def flat(t):
        t[key] = t[key].reshape(-1, t[key].shape[-1]).copy()
        return t

    with pytest.raises(CheckpointError, match=r"expected \[experts, rows, cols\]"):
        Checkpoint(_rewrite(fused, tmp_path / "flat", flat))

    def transposed(t):   # down_proj as [E, I, H] (another model family's convention) is not DeepSeek's
        down = "model.layers.1.mlp.experts.down_proj"
        t[down] = np.ascontiguousarray(t[down].transpose(0, 2, 1))
        return t

    with pytest.raises(CheckpointError, match=r"\[32, 64\], expected \[64, 32\] \(expert 0 of the fused .*down_proj"):
        ModelRunner(_rewrite(fused, tmp_path / "transposed", transposed), _reference())


def _reference():
    import deepinfer

    return deepinfer.get_backend("reference")


# ---------------------------------------------------------------------------- the embedded model fused


@pytest.fixture(scope="module")
def nano_fused(tmp_path_factory):
    """The embedded model re-saved by transformers 5 with its experts fused, used as is."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from deepinfer.engine import default_model_dir

    src = default_model_dir()
    dst = tmp_path_factory.mktemp("nano") / "fused"
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # it reports our MTP layer as unexpected: it is, for it
    try:
        m = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        m.save_pretrained(str(dst), save_original_format=False)
    finally:
        hf_logging.set_verbosity(verbosity)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "heldout.txt"):
        shutil.copy2(src / name, dst / name)
    return src, dst


def test_embedded_model_saved_fused_by_transformers(nano_fused, cpu_backend):
    src, dst = nano_fused
    ck = Checkpoint(dst)
    assert ck.layout == "fused"
    assert all(ck.array(n).dtype == ml_dtypes.bfloat16 for n in ck.names() if ".experts." in n)
    a, _ = _logits(src, cpu_backend)
    b, _ = _logits(dst, cpu_backend)
    assert np.array_equal(a, b)


def test_eval_ppl_and_quantize_read_the_fused_layout(nano_fused, tmp_path, capsys):
    from deepinfer import cli

    src, dst = nano_fused
    got = {}
    for name, d in (("hub", src), ("fused", dst)):
        assert cli.main(["eval-ppl", str(d), "--precision", "f32", "--max-tokens", "200", "--backend", "cpu"]) == 0
        got[name] = json.loads(capsys.readouterr().out)
    assert got["hub"]["tokens"] == got["fused"]["tokens"] == 199
    assert got["hub"]["ppl"] == got["fused"]["ppl"]

    qa, qb = tmp_path / "q_hub", tmp_path / "q_fused"
    assert cli.main(["quantize", str(src), str(qa), "--format", "int8"]) == 0
    assert cli.main(["quantize", str(dst), str(qb), "--format", "int8"]) == 0
    capsys.readouterr()
    a, b = TensorStore(qa), TensorStore(qb)
    assert b.layout == "hub", "deepinfer quantize writes the hub layout"
    main_names = [n for n in a.names() if not n.startswith(f"model.layers.{Checkpoint(src).config.num_hidden_layers}.")]
    assert set(b.names()) == set(main_names)
    for n in main_names:
        x, y = a.array(n), b.array(n)
        if x.dtype != y.dtype:   # transformers saves the router in f32 (it keeps it in f32 in memory)
            assert n.endswith(("mlp.gate.weight", "e_score_correction_bias")), n
            x, y = x.astype(np.float32), y.astype(np.float32)
        assert np.array_equal(x, y), n
    assert any(b.array(n).dtype == np.int8 for n in b.names() if ".experts.5." in n)


# ---------------------------------------------------------------------------- what transformers writes for fp8

TF_FP8 = Path(__file__).resolve().parent / "data" / "transformers_fp8_fused"


def _dtype_name(a) -> str:
    return {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}[a.dtype]


def test_transformers_written_fused_fp8_directory(tmp_path, model_backend):
    """tests/data/transformers_fp8_fused: the v3fp8probe checkpoint loaded by transformers 5.17 with
    its fp8 integration on an H200 and saved with save_original_format=False (made by
    tools/probe_fp8_fused_layout.py; transformers keeps fp8 quantized only on CUDA). Used as is, it
    computes what the hub-layout directory of the same weights computes."""
    from safetensors.torch import load_file, save_file

    tf = Checkpoint(TF_FP8)
    assert tf.layout == "fused" and tf.config.quant_scheme.format == "fp8"
    # our hand-built fused fp8 layout is byte for byte what transformers wrote
    ours = TensorStore(tiny_checkpoints.make("v3fp8probe", tmp_path / "ours", layout="fused")[0])
    for n in (k for k in tf.where if ".mlp.experts." in k):
        assert n in ours.where, n
        a, b = tf.where[n].array(n), ours.where[n].array(n)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), n
    # the hub twin: the same weights per expert, float tensors in the dtypes transformers saved them in
    hub, _, _ = tiny_checkpoints.make("v3fp8probe", tmp_path / "hub")
    t = load_file(str(hub / "model.safetensors"))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
    for n, a in t.items():
        want = torch_dtype[tf.array(n).dtype.name]
        if a.dtype != want:
            t[n] = a.to(want)
    save_file(t, str(hub / "model.safetensors"))
    twin = Checkpoint(hub)
    assert twin.layout == "hub" and sorted(twin.names()) == sorted(tf.names())
    for n in twin.names():
        assert np.array_equal(twin.array(n).view(np.uint8), tf.array(n).view(np.uint8)), n
    a, _ = _logits(TF_FP8, model_backend)
    b, _ = _logits(hub, model_backend)
    assert np.isfinite(a).all() and np.array_equal(a, b)


def test_transformers_default_fp8_save_squeezes_expert_scales(tmp_path, model_backend):
    """transformers 5's default save of fp8 experts (back to per-expert names) writes each scale grid
    with its size-1 dims dropped: [2] for gate_proj [128, 256] (grid [1, 2]) and for down_proj
    [256, 128] (grid [2, 1]), as recorded in layout.json. Such a directory loads to the same logits."""
    from safetensors.torch import load_file, save_file

    recorded = json.loads((TF_FP8 / "layout.json").read_text())["saved_default"]
    hub, _, _ = tiny_checkpoints.make("v3fp8probe", tmp_path / "hub")
    sq = tmp_path / "squeezed"
    shutil.copytree(hub, sq)
    t = load_file(str(sq / "model.safetensors"))
    for n in [n for n in t if ".mlp.experts." in n and n.endswith("_scale_inv")]:
        t[n] = t[n].reshape([d for d in t[n].shape if d != 1]).contiguous()
    save_file(t, str(sq / "model.safetensors"))
    written = {n: [_dtype_name(a), list(a.shape)] for n, a in t.items() if ".layers.1.mlp.experts" in n}
    assert written == recorded
    a, _ = _logits(hub, model_backend)
    b, _ = _logits(sq, model_backend)
    assert np.array_equal(a, b)
    # a scale with the wrong number of blocks is still an error
    t["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"] = torch.ones(3)
    save_file(t, str(sq / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"has shape \[3\], expected \[1, 2\]"):
        ModelRunner(sq, model_backend)
