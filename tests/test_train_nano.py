"""tools/train_nano.py end to end on a toy config (CPU, a few seconds of training), the MTP tooling in
tools/mtp_acceptance.py, and sanity checks of the shipped deepseek-v3-nano model."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from safetensors import safe_open  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
ASSET = os.path.join(ROOT, "runtime", "deepinfer", "assets", "deepseek-v3-nano")
sys.path.insert(0, TOOLS)
import mtp_acceptance as mtpa  # noqa: E402


def _index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def _tensor_meta(d):
    """name -> (dtype, shape) without loading any data."""
    out = {}
    for shard in sorted(set(_index(d)["weight_map"].values())):
        with safe_open(os.path.join(d, shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("nano") / "m")
    cmd = [sys.executable, os.path.join(TOOLS, "train_nano.py"), "--out", out, "--tiny", "--device", "cpu",
           "--steps", "3", "--max-files", "80", "--eval-every", "1000", "--heldout-bytes", "20000"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_tiny_run_writes_hub_format(tiny):
    files = set(os.listdir(tiny))
    for f in ["config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "training.json", "heldout.txt", "unigram_counts.json"]:
        assert f in files, f
    cfg = json.load(open(os.path.join(tiny, "config.json")))
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc" and cfg["norm_topk_prob"]
    assert cfg["n_group"] > 1 and cfg["q_lora_rank"] and cfg["first_k_dense_replace"] == 1
    idx = _index(tiny)
    for shard in set(idx["weight_map"].values()):
        assert os.path.getsize(os.path.join(tiny, shard)) < 16 * 1024 * 1024


def test_tiny_mtp_layer_tensors(tiny):
    cfg = json.load(open(os.path.join(tiny, "config.json")))
    n = cfg["num_hidden_layers"]
    meta = _tensor_meta(tiny)
    p = f"model.layers.{n}."
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    assert meta[p + "enorm.weight"][1] == (h,)
    assert meta[p + "hnorm.weight"][1] == (h,)
    assert meta[p + "eh_proj.weight"][1] == (h, 2 * h)
    assert meta[p + "shared_head.norm.weight"][1] == (h,)
    assert meta[p + "shared_head.head.weight"][1] == (v, h)
    assert meta[p + "embed_tokens.weight"][1] == (v, h)
    assert p + "self_attn.kv_a_proj_with_mqa.weight" in meta
    for e in range(cfg["n_routed_experts"]):
        assert meta[f"{p}mlp.experts.{e}.gate_proj.weight"][1] == (cfg["moe_intermediate_size"], h)
    assert meta[p + "mlp.gate.e_score_correction_bias"] == ("F32", (cfg["n_routed_experts"],))
    # official per-expert names in the main layers too, bf16 everywhere but the router bias
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in meta
    assert not any(k.endswith("gate_up_proj") for k in meta)
    assert {d for k, (d, _) in meta.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}
    # nothing beyond layer n
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in meta)


def test_tiny_loads_in_transformers_and_matches_record(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert model.config.num_hidden_layers == json.load(open(os.path.join(tiny, "config.json")))["num_hidden_layers"]
    assert model.model.rotary_emb.rope_type == "yarn"
    tok = AutoTokenizer.from_pretrained(tiny)
    src = "def f(x):\n\tif x:\n        return '  spaced\\n'  # ünïcode\r\n\n\n    pass\n"
    ids = tok(src)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == src
    info = json.load(open(os.path.join(tiny, "training.json")))
    assert info["steps"] == 3 and info["tokens_seen"] > 0
    ver = info["verify"]
    assert ver["reload_max_abs_logit_diff"] < 1e-4 and ver["tokenizer_roundtrip_ok"]
    assert ver["heldout_ppl"] > 1 and ver["unigram_ppl"] > 1
    assert 0.0 <= ver["mtp_teacher_forced_acceptance"] <= 1.0
    # the aux-loss-free balancing moved the router biases away from their zero init
    biases = [b for bs in info["expert_bias"].values() for b in bs]
    assert any(abs(b) > 0 for b in biases) and max(abs(b) for b in biases) <= 3 * 1e-3 + 1e-9
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.startswith(tok.bos_token) and chat.endswith("<｜Assistant｜>")


def test_mtp_module_matches_transformers_mtp_layer(tiny):
    """Our MTP (loaded from the shards) against transformers' own MtpLayer given the same weights."""
    MtpLayer = getattr(__import__("transformers.modeling_layers", fromlist=["x"]), "MtpLayer", None)
    if MtpLayer is None:
        pytest.skip("this transformers has no MtpLayer")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    model, mtp, tok = mtpa.load_model_and_mtp(tiny)
    cfg = model.config
    ref = MtpLayer(cfg, m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, cfg.num_hidden_layers).eval()
    sd = {}
    for k, v in mtp.state_dict().items():
        k = k.replace("block.", "mtp_block.", 1) if k.startswith("block.") else k
        sd[k.replace("shared_head.norm.", "post_norm.")] = v
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    x = torch.tensor([tok("import os\n\ndef main(argv):\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        h = model.model(input_ids=x).last_hidden_state
        ours = mtpa.mtp_logits(model, mtp, h, x)
        pos = torch.arange(x.shape[1] - 1)[None]
        emb = model.model.embed_tokens(x[:, 1:])
        theirs = model.lm_head(ref(emb, h[:, :-1], position_embeddings=model.model.rotary_emb(emb, pos),
                                   attention_mask=None, position_ids=pos, cache=None))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_mtp_is_causal(tiny):
    """A change at a later position must not change earlier MTP drafts."""
    model, mtp, tok = mtpa.load_model_and_mtp(tiny)
    x = torch.tensor([tok("for i in range(10):\n    print(i, i * i)\n")["input_ids"]])
    y = x.clone()
    y[0, -1] = (y[0, -1] + 7) % model.config.vocab_size
    with torch.no_grad():
        a = mtpa.mtp_logits(model, mtp, model.model(input_ids=x).last_hidden_state, x)
        b = mtpa.mtp_logits(model, mtp, model.model(input_ids=y).last_hidden_state, y)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_hub_name_conversion_roundtrip():
    g = torch.randn(3, 2 * 5, 4)
    d = torch.randn(3, 4, 5)
    sd = {"model.layers.1.mlp.experts.gate_up_proj": g, "model.layers.1.mlp.experts.down_proj": d,
          "model.layers.1.mlp.gate.weight": torch.randn(3, 4)}
    hub = mtpa.to_hub_names(sd)
    assert torch.equal(hub["model.layers.1.mlp.experts.2.gate_proj.weight"], g[2, :5])
    assert torch.equal(hub["model.layers.1.mlp.experts.2.up_proj.weight"], g[2, 5:])
    assert torch.equal(hub["model.layers.1.mlp.experts.0.down_proj.weight"], d[0])
    back = mtpa.from_hub_names(hub, sd.keys())
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    del hub["model.layers.1.mlp.experts.1.down_proj.weight"]
    with pytest.raises(ValueError, match="experts.1: missing"):
        mtpa.from_hub_names(hub, sd.keys())


def test_load_mtp_reports_missing_layer(tiny, tmp_path):
    import shutil

    d = tmp_path / "nomtp"
    shutil.copytree(tiny, d)
    idx = _index(d)
    n = json.load(open(d / "config.json"))["num_hidden_layers"]
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.startswith(f"model.layers.{n}.")}
    # keep only shards that still hold something, so read_shards sees no MTP tensors
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    from safetensors.torch import load_file, save_file
    for shard in set(idx["weight_map"].values()):
        t = load_file(d / shard)
        save_file({k: v for k, v in t.items() if not k.startswith(f"model.layers.{n}.")}, d / shard)
    with pytest.raises(ValueError, match="no MTP tensors"):
        mtpa.load_model_and_mtp(str(d))


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    import train_nano

    for bad, msg in [(["--seq-len", "4096"], "max_position_embeddings"), (["--steps", "0"], "--steps")]:
        with pytest.raises(SystemExit) as e:
            train_nano.parse(["--out", str(tmp_path / "x"), "--tiny"] + bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err


# --------------------------------------------------------------------------------- the shipped model


needs_asset = pytest.mark.skipif(not os.path.isdir(ASSET), reason="deepseek-v3-nano asset not present")


@needs_asset
def test_shipped_model_layout():
    total = sum(os.path.getsize(os.path.join(ASSET, f)) for f in os.listdir(ASSET))
    assert total < 40 * 1024 * 1024
    cfg = json.load(open(os.path.join(ASSET, "config.json")))
    meta = _tensor_meta(ASSET)
    assert set(meta) == set(_index(ASSET)["weight_map"])
    n = cfg["num_hidden_layers"]
    for name in ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "mlp.gate.e_score_correction_bias"]:
        assert f"model.layers.{n}.{name}" in meta
    for shard in set(_index(ASSET)["weight_map"].values()):
        assert os.path.getsize(os.path.join(ASSET, shard)) < 16 * 1024 * 1024
    params = sum(torch.Size(s).numel() for k, (_, s) in meta.items()
                 if not k.startswith(f"model.layers.{n}.embed_tokens") and "shared_head.head" not in k)
    assert 3e6 < params < 16e6
    info = json.load(open(os.path.join(ASSET, "training.json")))
    ver = info["verify"]
    assert ver["heldout_ppl"] < ver["unigram_ppl"] / 10
    assert ver["mtp_greedy_decode_acceptance"] > 0.3


@needs_asset
def test_shipped_model_runs_on_cpu():
    """Re-measure a slice of the held-out text with transformers here; it must agree with the recorded run."""
    model, mtp, tok = mtpa.load_model_and_mtp(ASSET)
    text = open(os.path.join(ASSET, "heldout.txt"), encoding="utf-8").read()
    res = mtpa.evaluate(model, mtp, tok, text, seq_len=512, batch=4, max_tokens=2048)
    assert res["heldout_ppl"] < 60
    assert res["mtp_teacher_forced_acceptance"] > 0.3
    ids = tok("def fibonacci(n):", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith("def fibonacci(n):") and "\n" in text
