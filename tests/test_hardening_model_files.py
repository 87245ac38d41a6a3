"""Hostile model files: every malformed config.json, safetensors header and shard index is a
CheckpointError whose message names the file and what is wrong (never a traceback, never a silently
different model). Each table row is (mutation, expected message fragment)."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

import deepinfer
import safetensors_edit
from test_model_checkpoint import V3_HUB
from deepinfer.errors import CheckpointError, InputError
from deepinfer.model import Checkpoint, ModelConfig, WeightLoader

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# DeepSeek's V3 keys, shrunk, in bf16 (no quantization_config) with token ids
V3 = {**{k: v for k, v in V3_HUB.items() if k != "quantization_config"}, "bos_token_id": 0, "eos_token_id": 1}
NAN, INF = float("nan"), float("inf")


def _with(**changes):
    d = json.loads(json.dumps(V3))
    for k, v in changes.items():
        if "__" in k:
            outer, inner = k.split("__")
            if v is _DROP:
                d[outer].pop(inner)
            else:
                d[outer][inner] = v
        elif v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return d


_DROP = object()

CONFIG_VALUES = [
    (dict(hidden_size="256"), "hidden_size='256' must be a whole number, not a string"),
    (dict(hidden_size=256.7), "hidden_size=256.7 must be a whole number"),
    (dict(hidden_size=256.0), "hidden_size=256.0 must be a whole number"),   # no published config needs it
    (dict(hidden_size=True), "hidden_size=True must be a whole number, not a boolean"),
    (dict(hidden_size=[64]), "hidden_size=[64] must be a whole number, not a list"),
    (dict(hidden_size=NAN), "hidden_size=nan must be a whole number"),
    (dict(hidden_size=0), "hidden_size=0 must be in [1, 2147483647]"),
    (dict(quantization_config={"quant_method": ["fp8"]}), "quant_method=['fp8'] is not supported"),
    (dict(quantization_config=[1]), "quantization_config must be a JSON object"),
    (dict(vocab_size=-5), "vocab_size=-5 must be in [1,"),
    (dict(hidden_size=2 ** 40), "hidden_size=1099511627776 must be in [1, 2147483647]"),
    (dict(num_hidden_layers=10 ** 400), "num_hidden_layers="),
    (dict(hidden_size=None), "missing required key 'hidden_size'"),
    (dict(kv_lora_rank=_DROP), "missing required key 'kv_lora_rank'"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0 must be in [1,"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be in [1, n_routed_experts=8]"),
    (dict(num_experts_per_tok=_DROP), "missing required key 'num_experts_per_tok'"),
    # defaults that DeepSeek's code and transformers disagree on
    (dict(routed_scaling_factor=_DROP), "missing required key 'routed_scaling_factor'"),
    (dict(n_group=None), "missing required key 'n_group'"),
    (dict(topk_group=_DROP), "missing required key 'topk_group'"),
    (dict(rope_scaling__type=_DROP), "missing required key 'rope_scaling.rope_type'"),
    (dict(num_experts_per_tok=2.0), "num_experts_per_tok=2.0 must be a whole number"),
    (dict(n_routed_experts="8"), "n_routed_experts='8' must be a whole number"),
    (dict(n_shared_experts=-1), "n_shared_experts=-1 must be in [0,"),
    (dict(moe_layer_freq=0), "moe_layer_freq=0 must be in [1,"),
    (dict(n_group=0), "n_group=0 must be in [1,"),
    (dict(topk_group=False), "topk_group=False must be a whole number"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace=-1 must be in [0,"),
    (dict(q_lora_rank=-48), "q_lora_rank=-48 must be in [0,"),
    (dict(moe_intermediate_size=32.5), "moe_intermediate_size=32.5 must be a whole number"),
    (dict(max_position_embeddings="4k"), "max_position_embeddings='4k' must be a whole number"),
    (dict(num_nextn_predict_layers="1"), "num_nextn_predict_layers='1' must be a whole number"),
    (dict(num_nextn_predict_layers=_DROP, num_mtp_layers=-1), "num_mtp_layers=-1 must be in [0,"),
    (dict(bos_token_id=1000), "bos_token_id=1000 must be in [0, 999]"),
    (dict(eos_token_id=["1"]), "eos_token_id='1' must be a whole number"),
    (dict(eos_token_id=1.0), "eos_token_id=1.0 must be a whole number"),
    (dict(rms_norm_eps=NAN), "rms_norm_eps=nan must be a finite number > 0"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps=-1e-06 must be a finite number > 0"),
    (dict(rms_norm_eps=0), "rms_norm_eps=0 must be a finite number > 0"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps='1e-6' must be a number, not a string"),
    (dict(rope_theta=INF), "rope_theta=inf must be a finite number > 0"),
    (dict(rope_theta=10 ** 400), "must be a finite number > 0"),
    (dict(routed_scaling_factor=True), "routed_scaling_factor=True must be a number, not a boolean"),
    (dict(norm_topk_prob="false"), "norm_topk_prob='false' must be true or false, not a string"),
    (dict(norm_topk_prob=1), "norm_topk_prob=1 must be true or false"),
    (dict(tie_word_embeddings=None, rope_interleave=0), "rope_interleave=0 must be true or false"),
    (dict(topk_method=["noaux_tc"]), "topk_method=['noaux_tc'] must be a string"),
    (dict(scoring_func="relu"), "scoring_func='relu' is not supported (one of softmax, sigmoid)"),
    (dict(torch_dtype=16), "torch_dtype=16 must be a string"),
    (dict(model_type=["deepseek_v3"]), "model_type=['deepseek_v3'] must be a string"),
    (dict(model_type=_DROP, architectures="DeepseekV3ForCausalLM"), "architectures='DeepseekV3ForCausalLM' must be "
                                                                     "a list of class names"),
    (dict(model_type=_DROP, architectures=[{"a": 1}]), "must be a list of class names"),
    (dict(rope_scaling="yarn"), "rope_scaling='yarn' must be a JSON object, not a string"),
    (dict(rope_parameters=[1, 2]), "rope_parameters=[1, 2] must be a JSON object, not a list"),
    (dict(rope_scaling__factor="40"), "rope_scaling.factor='40' must be a number"),
    (dict(rope_scaling__factor=-2), "rope_scaling.factor=-2 must be a finite number > 0"),
    (dict(rope_scaling__type="linear"), "rope_scaling.type='linear' is not a supported rope type"),
    (dict(rope_scaling__type=7), "rope_scaling.type=7 must be a string"),
    (dict(rope_scaling__original_max_position_embeddings=0),
     "rope_scaling.original_max_position_embeddings=0 must be in [1,"),
    (dict(rope_scaling__beta_fast=0), "rope_scaling.beta_fast=0 must be a finite number > 0"),
    (dict(rope_scaling__mscale=NAN), "rope_scaling.mscale=nan must be a finite number >= 0"),
    (dict(rope_scaling__mscale_all_dim="1"), "rope_scaling.mscale_all_dim='1' must be a number"),
    (dict(rope_scaling__attention_factor=0), "rope_scaling.attention_factor=0 must be a finite number > 0"),
]


@pytest.mark.parametrize("changes,fragment", CONFIG_VALUES, ids=[repr(c)[:60] for c, _ in CONFIG_VALUES])
def test_config_values_by_type_and_range(tmp_path, changes, fragment):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_with(**changes)))     # NaN and Infinity as JSON writes them from Python
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_file(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and fragment in msg, msg
    assert isinstance(e.value, InputError) and e.value.exit_code == 2


def test_config_accepts_what_it_should():
    """ints for floats, 0 / null for "no q-LoRA", an eos list, null for defaults, zero mscale."""
    c = ModelConfig.from_dict(_with(rope_theta=10000, rms_norm_eps=1, q_lora_rank=0, eos_token_id=[1, 2],
                                    max_position_embeddings=None, rope_scaling__mscale=0))
    assert c.rope.theta == 10000.0 and c.q_lora_rank is None and c.eos_token_id == 1
    assert c.max_position_embeddings == 4096 and c.rope.mscale == 0.0
    dense = ModelConfig.from_dict(_with(n_routed_experts=None, num_experts_per_tok=None, routed_scaling_factor=None))
    assert dense.n_routed_experts is None and not dense.is_moe_layer(2)
    greedy = ModelConfig.from_dict(_with(topk_method="greedy", n_group=None, topk_group=None))
    assert (greedy.n_group, greedy.topk_group) == (1, 1)
    plain = ModelConfig.from_dict(_with(rope_scaling=None, rope_parameters={"rope_theta": 5e4}))
    assert plain.rope.type == "default" and plain.rope.theta == 5e4


CONFIG_FILES = [
    (b"\xff\xfe{}", "not UTF-8 text (byte 0"),
    (b"[" * 100000 + b"]" * 100000, "JSON nested too deeply"),
    (b'{"a": ' * 50000 + b"1" + b"}" * 50000, "JSON nested too deeply"),
    (b'{"hidden_size": ' + b"1" * 5000 + b"}", "not valid JSON"),
    (b"[1, 2]", "must hold a JSON object ({...}), not a list"),
    (b"null", "must hold a JSON object ({...}), not null"),
    (b'"config"', "must hold a JSON object ({...}), not a string"),
    (b"", "not valid JSON"),
    (b"{nope", "not valid JSON"),
]


@pytest.mark.parametrize("raw,fragment", CONFIG_FILES, ids=[r[:12].decode("latin-1") for r, _ in CONFIG_FILES])
def test_config_file_contents(tmp_path, raw, fragment):
    p = tmp_path / "config.json"
    p.write_bytes(raw)
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_file(p)
    assert str(e.value).startswith(f"{p}: ") and fragment in str(e.value), str(e.value)


def test_config_file_that_is_not_a_file(tmp_path):
    p = tmp_path / "config.json"
    p.mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not the config.json file"):
        ModelConfig.from_file(p)
    p.rmdir()
    os.mkfifo(p)     # reading a pipe would block forever
    with pytest.raises(CheckpointError, match="is not a regular file"):
        ModelConfig.from_file(p)
    p.unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        ModelConfig.from_file(p)


# ---------------------------------------------------------------------------- safetensors headers


@pytest.fixture
def v2lite(tiny_copy):
    """A copy of the tiny V2-Lite checkpoint: one model.safetensors, 3 layers, 8 experts."""
    return tiny_copy("v2lite")


NORM = "model.norm.weight"          # f32 [64]: 256 bytes
LN = "model.layers.0.input_layernorm.weight"   # the same size


def _set(field, value):
    return lambda h: h[NORM].__setitem__(field, value)


HEADER_FIELDS = [
    (_set("shape", "[64]"), "malformed shape '[64]'"),
    (_set("shape", [64.0]), "malformed shape [64.0]"),
    (_set("shape", None), "malformed shape None"),
    (_set("shape", [True] * 64), "malformed shape"),
    (_set("shape", [[64]]), "malformed shape [[64]]"),
    (_set("shape", [-64]), "malformed shape [-64]"),
    (_set("shape", [2 ** 70]), "malformed shape"),
    (_set("shape", [1] * 40), "expected a list of at most 32 integers"),
    (_set("shape", [0, 2 ** 61]), "impossible shape"),
    (_set("shape", [64, 2]), "hold 256 bytes, but F32[64, 2] needs 512"),
    (_set("data_offsets", ["0", "256"]), "malformed data_offsets ['0', '256']"),
    (_set("data_offsets", [0.0, 256.0]), "malformed data_offsets"),
    (_set("data_offsets", None), "malformed data_offsets None"),
    (_set("data_offsets", [False, 256]), "malformed data_offsets"),
    (_set("data_offsets", [[0], [256]]), "malformed data_offsets"),
    (_set("data_offsets", [-256, 0]), "malformed data_offsets"),
    (_set("data_offsets", [0]), "malformed data_offsets [0]"),
    (_set("data_offsets", [0, 256, 512]), "malformed data_offsets"),
    (_set("data_offsets", [256, 0]), "with 0 <= begin <= end"),
    (_set("data_offsets", [2 ** 64 - 256, 2 ** 64]), "malformed data_offsets"),
    (_set("data_offsets", [10 ** 12, 10 ** 12 + 256]), "truncated safetensors file: tensor 'model.norm.weight'"),
    (_set("dtype", 5), "unknown dtype 5"),
    (_set("dtype", ["F32"]), "unknown dtype ['F32']"),
    (_set("dtype", "Q7"), "unknown dtype 'Q7'"),
    (lambda h: h.__setitem__(NORM, [1, 2]), "malformed header entry [1, 2] (not an object)"),
    (lambda h: h.__setitem__(NORM, None), "malformed header entry None"),
    (lambda h: h.__setitem__("__metadata__", [1]), "__metadata__ must be an object of strings"),
    (lambda h: h.__setitem__("__metadata__", {"format": 1}), "__metadata__ must be an object of strings"),
    (lambda h: h[NORM].__setitem__("data_offsets", h[LN]["data_offsets"]),
     f"tensors '{LN}' and '{NORM}' overlap"),
    (lambda h: h[NORM].__setitem__("data_offsets", [o + 8 for o in h[LN]["data_offsets"]]), "overlap"),
]


@pytest.mark.parametrize("edit,fragment", HEADER_FIELDS, ids=[f[1][:40] for f in HEADER_FIELDS])
def test_safetensors_header_fields(v2lite, edit, fragment):
    st = v2lite / "model.safetensors"
    safetensors_edit.edit(st, edit)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(v2lite)
    assert str(e.value).startswith(f"{st}: ") and fragment in str(e.value), str(e.value)


HEADER_BYTES = [
    (lambda h, body: (b"[" * 100000, body), "JSON nested too deeply"),
    (lambda h, body: (b"[1, 2]", body), "the header is a list, not a JSON object"),
    (lambda h, body: (b'{"x": ' + b"9" * 5000 + b"}", body), "not valid JSON"),
    (lambda h, body: (b'{"x": "\xc3\x28"}', body), "not UTF-8 text"),
    (lambda h, body: (b"", body), "not valid JSON"),
]


@pytest.mark.parametrize("edit,fragment", HEADER_BYTES, ids=[f[1] for f in HEADER_BYTES])
def test_safetensors_header_bytes(v2lite, edit, fragment):
    st = v2lite / "model.safetensors"
    header, body = safetensors_edit.split(st)
    safetensors_edit.write(st, *edit(header, body))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(v2lite)
    assert str(e.value).startswith(f"{st}: ") and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("length", [2 ** 64 - 1, 2 ** 63, 10 ** 9])
def test_header_length_beyond_the_file(v2lite, length):
    st = v2lite / "model.safetensors"
    st.write_bytes(struct.pack("<Q", length) + st.read_bytes()[8:])
    with pytest.raises(CheckpointError, match=f"header length {length} does not fit"):
        Checkpoint(v2lite)


def test_zero_size_fused_experts_cannot_exhaust_memory(v2lite):
    """A fused expert tensor gets one view per expert: a header claiming billions of them is refused."""
    name = "model.layers.1.mlp.experts.down_proj"
    safetensors_edit.edit(v2lite / "model.safetensors",
          lambda h: h.__setitem__(name, {"dtype": "F32", "shape": [2 ** 40, 0, 4], "data_offsets": [0, 0]}))
    with pytest.raises(CheckpointError, match=r"1099511627776 experts is no model \(at most 65536\)"):
        Checkpoint(v2lite)


def test_weight_file_that_is_a_directory(v2lite):
    st = v2lite / "model.safetensors"
    st.unlink()
    st.mkdir()
    with pytest.raises(CheckpointError, match="not a regular file"):
        Checkpoint(v2lite)


# ---------------------------------------------------------------------------- the shard index


@pytest.fixture
def v3(tiny_copy):
    """A copy of the tiny V3 checkpoint: an index over 9 shards, MTP layer in model-mtp.safetensors."""
    return tiny_copy("v3")


INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"


def _index_edit(fn):
    def edit(d):
        idx = json.loads((d / INDEX).read_text())
        out = fn(idx, d)
        (d / INDEX).write_text(json.dumps(idx if out is None else out))
    return edit


def _entry(value):
    return _index_edit(lambda idx, d: idx["weight_map"].__setitem__(EMBED, value(d) if callable(value) else value))


def _link_outside(d):
    """A shard that is a link to a copy of itself outside the model directory."""
    shard = json.loads((d / INDEX).read_text())["weight_map"][EMBED]
    outside = d.parent / "elsewhere.safetensors"
    shutil.copy(d / shard, outside)
    (d / shard).unlink()
    (d / shard).symlink_to(outside)
    return shard


INDEX_CASES = [
    (_index_edit(lambda idx, d: [idx]), "must hold a JSON object with a weight_map, not a list"),
    (_index_edit(lambda idx, d: idx.pop("weight_map") and None),
     "weight_map must be a non-empty object of tensor name -> shard file (it is missing)"),
    (_index_edit(lambda idx, d: idx.__setitem__("weight_map", list(idx["weight_map"]))), "(not a list)"),
    (_index_edit(lambda idx, d: idx.__setitem__("weight_map", {})), "(it is empty)"),
    (_entry(5), f"weight_map['{EMBED}'] = 5 is not a file name"),
    (_entry(None), f"weight_map['{EMBED}'] = None is not a file name"),
    (_entry(["model-mtp.safetensors"]), "is not a file name"),
    (_entry("../m/model-mtp.safetensors"), "not a file name inside the model directory"),
    (_entry(lambda d: str(d / "model-mtp.safetensors")), "not a file name inside the model directory"),
    (_entry("/etc/passwd"), "not a file name inside the model directory"),
    (_entry(""), "not a file name inside the model directory"),
    (_entry("a\0b"), "not a file name inside the model directory"),
    (_entry("\ud800.safetensors"), "not a file name inside the model directory"),
    (lambda d: _link_outside(d), "elsewhere.safetensors, outside the model directory"),
    (_entry("model-00009-of-00008.safetensors"), "shard model-00009-of-00008.safetensors (holding "
                                                  f"{EMBED}) is missing"),
    (_entry("model-mtp.safetensors"), f"tensor '{EMBED}' listed in {INDEX} is not in the file"),
    (lambda d: (d / INDEX).write_bytes(b"\xff"), "not UTF-8 text"),
    (lambda d: (d / INDEX).write_text("[" * 100000), "JSON nested too deeply"),
    (lambda d: ((d / INDEX).unlink(), (d / INDEX).mkdir()), "is a directory"),
]


@pytest.mark.parametrize("edit,fragment", INDEX_CASES, ids=[f[1][:40] for f in INDEX_CASES])
def test_shard_index(v3, edit, fragment):
    edit(v3)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(v3)
    assert fragment in str(e.value), str(e.value)
    assert str(v3) in str(e.value)


def test_links_out_of_the_directory_are_refused_for_every_file(v2lite, tmp_path):
    """model.safetensors and config.json as links to files elsewhere are refused too; a link that
    stays inside the directory is fine."""
    (v2lite / "model.safetensors").rename(tmp_path / "w.safetensors")
    (v2lite / "model.safetensors").symlink_to(tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match="w.safetensors, outside the model directory"):
        Checkpoint(v2lite)
    (v2lite / "model.safetensors").unlink()
    (v2lite / "sub").mkdir()
    (tmp_path / "w.safetensors").rename(v2lite / "sub" / "w.safetensors")
    (v2lite / "model.safetensors").symlink_to(v2lite / "sub" / "w.safetensors")
    Checkpoint(v2lite)
    (v2lite / "config.json").rename(tmp_path / "c.json")
    (v2lite / "config.json").symlink_to(tmp_path / "c.json")
    with pytest.raises(CheckpointError, match="c.json, outside the model directory"):
        Checkpoint(v2lite)


def test_hugging_face_cache_links_into_blobs(v2lite, tmp_path):
    """A snapshot of the Hugging Face cache links each file to ../../blobs/<hash>: that is the model's own."""
    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in v2lite.iterdir():
        f.rename(repo / "blobs" / f.name)
        (snap / f.name).symlink_to(os.path.relpath(repo / "blobs" / f.name, snap))
    assert Checkpoint(snap).config.num_hidden_layers == 3


# ---------------------------------------------------------------------------- config vs checkpoint


def _load(d, load_mtp=False):
    ck = Checkpoint(d)
    return WeightLoader(ck, deepinfer.get_backend("reference"), "f32", None, 64).load(load_mtp)


def _config(d, **changes):
    p = d / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


UNUSED = [
    ("v3", dict(num_hidden_layers=2), "config.json says 2 layers (+ 1 MTP), but the checkpoint {d} holds "
                                      "model.layers.3.*"),
    ("v3", dict(num_nextn_predict_layers=0), "says 3 layers (+ 0 MTP), but the checkpoint {d} holds model.layers.3.*"),
    ("v2lite", dict(num_hidden_layers=1), "says 1 layer (+ 0 MTP), but the checkpoint {d} holds model.layers.2.*"),
    ("v2lite", dict(n_shared_experts=0), "{d}: 6 tensors of the checkpoint are not used by the model {d}/config.json "
                                         "describes (model.layers.1.mlp.shared_experts.down_proj.weight, "),
    ("v3", dict(topk_method="greedy"), "(model.layers.1.mlp.gate.e_score_correction_bias, "
                                       "model.layers.2.mlp.gate.e_score_correction_bias): config.json does not match"),
    # fewer experts or a narrower shared MLP show as a shape the config does not expect
    ("v2lite", dict(n_routed_experts=4), "'model.layers.1.mlp.gate.weight' has shape [8, 64], the config needs "
                                         "[4, 64]"),
    ("v2lite", dict(n_shared_experts=1), "shared_experts.gate_proj.weight' (weight) has shape [64, 64], expected "
                                         "[32, 64]"),
]


@pytest.mark.parametrize("family,changes,fragment", UNUSED, ids=[repr(u[1]) for u in UNUSED])
def test_tensors_the_config_leaves_unused(tiny_checkpoint, tmp_path, family, changes, fragment):
    src, _, _ = tiny_checkpoint(family)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    _config(d, **changes)
    with pytest.raises(CheckpointError) as e:
        _load(d)
    assert fragment.format(d=d) in str(e.value), str(e.value)


def test_mtp_layer_is_a_known_extra(v3):
    w = _load(v3, load_mtp=False)
    assert w.mtp is None and len(w.layers) == 3
    assert _load(v3, load_mtp=True).mtp is not None


def test_rotary_inv_freq_is_a_known_extra(v2lite):
    """Some exports save rope's frequency buffer; rope recomputes it from the config."""
    from safetensors.numpy import load_file, save_file

    st = v2lite / "model.safetensors"
    tensors = load_file(st)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, st)
    assert len(_load(v2lite).layers) == 3


def test_embedded_model_loads():
    from deepinfer.engine.llm_engine import default_model_dir

    assert len(_load(default_model_dir(), load_mtp=True).layers) == 5


@pytest.mark.parametrize("index", ["[" * 100000, '{"weight_map": {"a": 5}}', '{"weight_map": [1]}',
                                   '{"weight_map": {"a": "' + "x" * 5000 + '"}}', '{"weight_map": {"a": "a\\u0000b"}}'])
def test_hub_snapshot_with_a_damaged_index_is_incomplete(tmp_path, index):
    """The hub cache check reads the index too: a damaged one makes the snapshot incomplete, no traceback."""
    from deepinfer.model.hub import _complete

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / INDEX).write_text(index)
    assert _complete(tmp_path) is False
