"""A model argument may be a Hugging Face hub id, resolved through huggingface_hub against the
local cache (HF_HUB_CACHE / HF_HOME, refs, snapshots, revisions); offline, an uncached id is a clear
error. Each case runs in a fresh interpreter: huggingface_hub reads its environment at import."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

import tiny_checkpoints

pytestmark = pytest.mark.usefixtures("torch_one_thread")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def hub_cache(tiny_checkpoint, tmp_path_factory):
    """A Hugging Face cache laid out as huggingface_hub writes it, holding tiny/deepseek-v3 at two
    commits: main (bf16 weights) and tag v0 (an older snapshot whose config says 2 layers)."""
    path, _, _ = tiny_checkpoint("v3bf16")
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--tiny--deepseek-v3"
    for commit in (COMMIT, OLD):
        snap = repo / "snapshots" / commit
        shutil.copytree(path, snap)
        tiny_checkpoints.add_tokenizer(snap)
    # the older commit: a different model (2 layers), so the revision is observable
    _drop_layer_2(repo / "snapshots" / OLD)
    cfg = json.loads((repo / "snapshots" / OLD / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (repo / "snapshots" / OLD / "config.json").write_text(json.dumps(cfg))
    # main's files live in blobs/ with relative symlinks from the snapshot, as huggingface_hub stores them
    (repo / "blobs").mkdir()
    for f in sorted((repo / "snapshots" / COMMIT).iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blob)
        f.symlink_to(os.path.relpath(blob, f.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v0").write_text(OLD)
    return home


def _drop_layer_2(snap):
    """The checkpoint in `snap` one layer shorter: layer 2 dropped and the MTP layer (3) renumbered 2,
    so that a config saying 2 layers matches it (a config with fewer layers than the weights is refused)."""
    from safetensors.torch import load_file, save_file

    index = snap / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    weight_map = {}
    for shard in sorted(set(idx["weight_map"].values())):
        kept = {}
        for name, t in load_file(snap / shard).items():
            if name.startswith("model.layers.2."):
                continue
            if name.startswith("model.layers.3."):
                name = "model.layers.2." + name[len("model.layers.3."):]
            kept[name] = t
            weight_map[name] = shard
        save_file(kept, snap / shard, metadata={"format": "pt"})
    idx["weight_map"] = weight_map
    index.write_text(json.dumps(idx))


def _run(code: str, home, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)


LOAD = """
import deepinfer, sys
eng = deepinfer.load("tiny/deepseek-v3", config={{"backend": "reference", "max_batch": 1, "max_seq_len": 32{extra}}})
print(eng.model_dir)
print(eng.runner.cfg.num_hidden_layers, eng.runner.precision)
print(eng.generate("t5 t17 t200", max_new_tokens=4))
"""


def test_cached_hub_id_runs_offline(hub_cache):
    r = _run(LOAD.format(extra=""), hub_cache)
    assert r.returncode == 0, r.stderr
    d, layers, text = r.stdout.strip().splitlines()
    assert d.endswith(f"models--tiny--deepseek-v3/snapshots/{COMMIT}")
    assert layers == "3 bf16" and text.strip()
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    r = _run(LOAD.format(extra=""), hub_cache / "elsewhere", HF_HUB_CACHE=str(hub_cache / "hub"))
    assert r.returncode == 0, r.stderr


def test_revision_picks_the_snapshot(hub_cache):
    for rev, layers in (("v0", "2"), (OLD, "2"), ("main", "3")):
        r = _run(LOAD.format(extra=f', "revision": "{rev}"'), hub_cache)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[1].split()[0] == layers, rev


def test_cli_runs_a_hub_id(hub_cache):
    r = _run("from deepinfer import cli; raise SystemExit(cli.main(['run', 'tiny/deepseek-v3', 't5 t17', "
             "'--max-new-tokens', '3', '--backend', 'reference']))", hub_cache)
    assert r.returncode == 0, r.stderr
    assert "deepinfer: tiny/deepseek-v3 on reference" in r.stderr and "own precision (bf16)" in r.stderr
    assert r.stdout.startswith("t5 t17")


def test_uncached_hub_id_offline_is_a_clear_error(hub_cache):
    r = _run(LOAD.format(extra="").replace("tiny/deepseek-v3", "deepseek-ai/DeepSeek-V2-Lite"), hub_cache)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert "CheckpointError" in err and "'deepseek-ai/DeepSeek-V2-Lite' is not in the Hugging Face cache" in err
    assert str(hub_cache / "hub") in err and "HF_HUB_OFFLINE=1" in err and "hf download deepseek-ai/DeepSeek-V2-Lite" in err
    r = _run(LOAD.format(extra=', "revision": "nope"'), hub_cache)
    assert r.returncode != 0 and "at revision 'nope' is not in the Hugging Face cache" in r.stderr


def test_partial_snapshot_offline_is_a_clear_error(hub_cache, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(hub_cache, home, symlinks=True)
    snap = home / "hub" / "models--tiny--deepseek-v3" / "snapshots" / COMMIT
    shard = next(snap.glob("model-*.safetensors"))
    shard.unlink()   # an interrupted download
    assert not shard.exists()
    r = _run(LOAD.format(extra=""), home)
    assert r.returncode != 0 and "is only partly in the Hugging Face cache" in r.stderr


def test_paths_and_ids_are_told_apart(tmp_path):
    from deepinfer.errors import CheckpointError
    from deepinfer.model.hub import looks_like_hub_id, resolve_model

    assert looks_like_hub_id("deepseek-ai/DeepSeek-V2-Lite")
    assert not looks_like_hub_id("/abs/path") and not looks_like_hub_id("a/b/c") and not looks_like_hub_id("../x")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve_model("org/name") == tmp_path / "org" / "name" or resolve_model("org/name").name == "name"
        assert not looks_like_hub_id("org/name")   # an existing local folder wins
    finally:
        os.chdir(cwd)
    with pytest.raises(CheckpointError, match="does not exist .*not a hub id"):
        resolve_model(str(tmp_path / "missing" / "x" / "y"))
    with pytest.raises(CheckpointError, match="local directory, not a hub id"):
        resolve_model(tmp_path, revision="main")


def test_quantize_reads_a_hub_id(hub_cache, tmp_path):
    dst = tmp_path / "q"
    r = _run(f"from deepinfer import cli; raise SystemExit(cli.main(['quantize', 'tiny/deepseek-v3', {str(dst)!r}, "
             f"'--format', 'int8', '--revision', 'v0']))", hub_cache)
    assert r.returncode == 0, r.stderr
    assert json.loads((dst / "config.json").read_text())["num_hidden_layers"] == 2   # the v0 snapshot
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["format"] == "int8"
