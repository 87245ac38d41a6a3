"""A random bf16 checkpoint shaped like DeepSeek-V2-Lite, cut to a few layers, in the hub layout.

    python benchmarks/_v2lite_random.py OUT_DIR [--layers 4] [--seed 0]

The config is the published one (tests/data/hub_configs/deepseek-v2-lite.json) with num_hidden_layers
set (first_k_dense_replace stays 1: layer 0 dense, the rest MoE with 64 routed experts, top 6, and 2
shared ones) and the vocabulary of 102400 kept, so the embedding and lm_head cost what they cost in the
real model. Weights are normal with std 0.02, norms 1, rounded to bf16 by truncation; written as one
safetensors shard per layer (plus one for embedding, final norm and lm_head) by a writer of its own, a
tensor at a time, so a ~2.3e9-parameter model takes well under a minute and little memory; --jobs N
writes N shards at once (each shard draws from its own stream, seeded by --seed and its index, so the
checkpoint is the same for any N: the 27-layer, 31 GB one is a device call's minutes otherwise). The tokenizer
is the embedded model's byte-level BPE (4096 tokens; bos 0, eos 1, and the config says so): ids above
4095 have no text, which neither deepinfer nor llama.cpp's converter minds (it pads the GGUF vocabulary
to 102400 with unused tokens). auto_map is dropped (there is no remote code here; transformers knows
deepseek_v2). A file DONE marks a complete checkpoint.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HUB_CONFIG = ROOT / "tests/data/hub_configs/deepseek-v2-lite.json"
NANO = ROOT / "runtime/deepinfer/assets/deepseek-v3-nano"
STD = 0.02
CHUNK = 1 << 24        # values drawn at a time


def config(layers: int, hub: Path = HUB_CONFIG, dense_layers: Optional[int] = None) -> dict:
    cfg = json.loads(Path(hub).read_text())
    if dense_layers is not None:
        cfg["first_k_dense_replace"] = dense_layers
    cfg.pop("auto_map", None)
    cfg.pop("quantization_config", None)    # written as bf16 (quantize at load, or `deepinfer quantize`)
    cfg["num_hidden_layers"] = layers
    cfg["bos_token_id"], cfg["eos_token_id"] = 0, 1     # the embedded tokenizer's ids
    return cfg


def tensor_shapes(cfg: dict) -> list:
    """[(shard name, [(tensor name, shape, kind)])]; kind "w" is random, "norm" is ones."""
    H, V, I, MI = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    NH, Dn, Dr, Dv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                      cfg["v_head_dim"])
    Dc, E, S = cfg["kv_lora_rank"], cfg["n_routed_experts"], cfg["n_shared_experts"]
    shards = [("model-embed-head.safetensors", [("model.embed_tokens.weight", (V, H), "w"),
                                                ("model.norm.weight", (H,), "norm"),
                                                ("lm_head.weight", (V, H), "w")])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t = [(p + "input_layernorm.weight", (H,), "norm"), (p + "post_attention_layernorm.weight", (H,), "norm")]
        if cfg.get("q_lora_rank"):
            Q = cfg["q_lora_rank"]
            t += [(p + "self_attn.q_a_proj.weight", (Q, H), "w"), (p + "self_attn.q_a_layernorm.weight", (Q,), "norm"),
                  (p + "self_attn.q_b_proj.weight", (NH * (Dn + Dr), Q), "w")]
        else:
            t += [(p + "self_attn.q_proj.weight", (NH * (Dn + Dr), H), "w")]
        t += [(p + "self_attn.kv_a_proj_with_mqa.weight", (Dc + Dr, H), "w"),
              (p + "self_attn.kv_a_layernorm.weight", (Dc,), "norm"),
              (p + "self_attn.kv_b_proj.weight", (NH * (Dn + Dv), Dc), "w"),
              (p + "self_attn.o_proj.weight", (H, NH * Dv), "w")]

        def mlp(prefix, inter):
            return [(prefix + "gate_proj.weight", (inter, H), "w"), (prefix + "up_proj.weight", (inter, H), "w"),
                    (prefix + "down_proj.weight", (H, inter), "w")]

        if i < cfg["first_k_dense_replace"] or E is None:
            t += mlp(p + "mlp.", I)
        else:
            t += [(p + "mlp.gate.weight", (E, H), "w")]
            if cfg.get("topk_method") == "noaux_tc":       # V3's selection bias (zero: plain top-k)
                t += [(p + "mlp.gate.e_score_correction_bias", (E,), "zero")]
            for e in range(E):
                t += mlp(p + f"mlp.experts.{e}.", MI)
            if S:
                t += mlp(p + "mlp.shared_experts.", MI * S)
        shards.append((f"model-layer-{i:02d}.safetensors", t))
    return shards


def write_shard(path: Path, tensors: list, seed) -> int:
    """One safetensors file (8-byte little-endian header size, JSON header, raw data); returns bytes.
    `seed`: the shard's own random stream (numpy SeedSequence entropy)."""
    rng = np.random.default_rng(seed)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, kind in tensors:
            n = int(np.prod(shape))
            if kind in ("norm", "zero"):
                f.write(np.full(n, 0x3F80 if kind == "norm" else 0, dtype="<u2").tobytes())   # bf16 1.0 / 0.0
                continue
            for s in range(0, n, CHUNK):
                x = rng.standard_normal(min(CHUNK, n - s), dtype=np.float32)
                x *= STD
                f.write((x.view(np.uint32) >> 16).astype("<u2").tobytes())   # bf16 by truncation
    tmp.rename(path)
    return 8 + len(raw) + off


def make(out: Path, layers: int = 4, seed: int = 0, hub: Path = HUB_CONFIG, dense_layers: Optional[int] = None,
         jobs: int = 1) -> Path:
    """`hub`: another published config (tests/data/hub_configs/deepseek-v3.json: a V3-shaped model).
    `jobs`: shards written at once (processes)."""
    out = Path(out)
    if (out / "DONE").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(layers, hub, dense_layers)
    shards = tensor_shapes(cfg)
    work = [(out / fname, tensors, [seed, i]) for i, (fname, tensors) in enumerate(shards)]
    if jobs > 1:
        from multiprocessing import get_context
        with get_context("spawn").Pool(min(jobs, len(work))) as pool:
            total = sum(pool.starmap(write_shard, work, chunksize=1))
    else:
        total = sum(itertools.starmap(write_shard, work))
    weight_map = {name: fname for fname, tensors in shards for name, _, _ in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(NANO / f, out / f)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (out / "DONE").write_text("")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hub-config", default=str(HUB_CONFIG), help="the published config to shape it by")
    ap.add_argument("--jobs", type=int, default=1, help="shards written at once (0: one per CPU)")
    a = ap.parse_args(argv)
    print(make(Path(a.out), a.layers, a.seed, Path(a.hub_config), jobs=a.jobs or os.cpu_count() or 1))


if __name__ == "__main__":
    sys.exit(main())
