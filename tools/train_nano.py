#!/usr/bin/env python3
"""Train deepseek-v3-nano: a small model with the full DeepSeek-V3 architecture, saved in the official hub format.

Architecture (all through transformers' DeepseekV3ForCausalLM, so the checkpoint is loadable there): MLA with
q-LoRA, YaRN rope, first layer dense, the rest MoE with one shared + N routed experts, sigmoid group-limited
routing (noaux_tc, n_group > 1, topk_group, norm_topk_prob, routed_scaling_factor) balanced by the
auxiliary-loss-free bias update, and one MTP module (tools/mtp_acceptance.py) stored as layer num_hidden_layers
and trained with the MTP loss (predict x_{t+2}, weight --mtp-weight).

Corpus: the .py files of the running interpreter's standard library. Files are split deterministically by their
sorted relative path: index % 20 == 0 held out (test), index % 20 == 10 validation (checkpoint selection), the
rest train. Tokenizer: byte-level BPE trained on the training split.

  python tools/train_nano.py --out DIR                         # full model (use a GPU)
  python tools/train_nano.py --out DIR --tiny --device cpu --steps 3   # smoke run (tests)
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import random
import sys
import sysconfig
import tarfile
import time
from collections import Counter

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_acceptance as mtpa  # noqa: E402

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIALS = [BOS, EOS, PAD, USER, ASSISTANT]  # ids 0..4: bos_token_id 0, eos_token_id 1 as in DeepSeek configs

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# Keyed by --tiny. Shapes mirror DeepSeek-V3's ratios at toy scale; moe_intermediate_size is chosen with
# 2*I != H so a fused [E, 2I, H] expert tensor can never be confused with its transpose.
FULL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
            num_hidden_layers=5, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
            max_position_embeddings=2048, yarn_original=512, yarn_factor=4.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
            max_position_embeddings=512, yarn_original=128, yarn_factor=4.0)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ------------------------------------------------------------------------------------------------- corpus


def stdlib_files(root: str | None = None) -> tuple[str, list[str]]:
    """Sorted relative paths of the stdlib's .py files (site-packages excluded; test suites kept when present,
    they are ordinary Python code and the largest part of the stdlib)."""
    root = root or sysconfig.get_paths()["stdlib"]
    rels = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel.split(os.sep)[0] in ("site-packages", "dist-packages", "__pycache__"):
            dirs[:] = []
            continue
        dirs.sort()
        for f in files:
            if f.endswith(".py"):
                rels.append(os.path.normpath(os.path.join(rel, f)))
    return root, sorted(rels)


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            t = f.read()
    except (UnicodeDecodeError, OSError):
        return None  # a few test files are deliberately mis-encoded; they are not useful text
    return t if t.strip() else None


def split_of(i: int) -> str:
    return "heldout" if i % 20 == 0 else ("val" if i % 20 == 10 else "train")


def heldout_text(texts: list[str], max_bytes: int, per_file: int = 6000) -> str:
    """The first `per_file` chars (cut at a line end) of each held-out file, joined by blank lines, up to
    `max_bytes`: many files rather than the alphabetically first few."""
    parts, size = [], 0
    for t in texts:
        piece = t[:per_file]
        if len(t) > per_file and "\n" in piece:
            piece = piece[:piece.rindex("\n") + 1]
        b = len(piece.encode("utf-8"))
        if size + b > max_bytes:
            break
        parts.append(piece)
        size += b + 2
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    # Byte-level with no prefix space: every byte sequence round-trips, indentation and newlines included.
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    # HF tokenizers then add BOS like DeepSeek's tokenizer does; the training stream starts files with BOS too.
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                      special_tokens=[(BOS, 0)])
    for i, s in enumerate(SPECIALS):
        if tk.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tk.token_to_id(s)}, expected {i}")
    return tk


def save_tokenizer(tk, out: str, max_len: int):
    tk.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


# ----------------------------------------------------------------------------------------- model + config


def hub_config(s: dict) -> dict:
    """config.json in the layout of deepseek-ai/DeepSeek-V3 (legacy rope_scaling/rope_theta keys, which
    transformers converts), minus auto_map and quantization_config."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "ep_size": 1,
        "first_k_dense_replace": s["first_k_dense_replace"],
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": s["intermediate_size"],
        "kv_lora_rank": s["kv_lora_rank"],
        "max_position_embeddings": s["max_position_embeddings"],
        "moe_intermediate_size": s["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": s["n_group"],
        "n_routed_experts": s["n_routed_experts"],
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s["num_attention_heads"],
        "num_experts_per_tok": s["num_experts_per_tok"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_attention_heads"],
        "num_nextn_predict_layers": 1,
        "q_lora_rank": s["q_lora_rank"],
        "qk_nope_head_dim": s["qk_nope_head_dim"],
        "qk_rope_head_dim": s["qk_rope_head_dim"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": s["yarn_factor"], "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": s["yarn_original"], "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": s["routed_scaling_factor"],
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": s["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": s["v_head_dim"],
        "vocab_size": s["vocab_size"],
    }


def build_model(cfg_dir: str, experts_impl: str = "eager"):
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    # Built from the same config.json that from_pretrained will read, so training and loading agree on rope etc.
    config = AutoConfig.from_pretrained(cfg_dir)
    config._attn_implementation = "sdpa"
    # The per-expert loop autocasts like any nn.Linear; the grouped_mm path casts inputs to the (fp32 master)
    # weight dtype, which the CUDA grouped GEMM does not take.
    config._experts_implementation = experts_impl
    model = DeepseekV3ForCausalLM(config)
    mtp = mtpa.NanoMTP(config)
    mtp.apply(model._init_weights)
    return model, mtp


class ExpertLoad:
    """Counts routed tokens per expert for every router (main layers and MTP) through forward hooks, for the
    auxiliary-loss-free balancing of DeepSeek-V3 (bias += gamma * sign(mean_load - load) after each step)."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.gates = modules
        self.counts = {n: torch.zeros(g.e_score_correction_bias.numel(), device=g.e_score_correction_bias.device)
                       for n, g in modules.items()}
        for n, g in modules.items():
            g.register_forward_hook(self._hook(n))

    def _hook(self, name):
        def hook(mod, inp, out):
            if not mod.training:
                return
            outs = out if isinstance(out, tuple) else (out,)
            # the routed indices are the one integer tensor the router returns (position differs by version)
            idx = next(o for o in outs if torch.is_tensor(o) and not o.is_floating_point())
            self.counts[name] += torch.bincount(idx.reshape(-1), minlength=self.counts[name].numel()).float()
        return hook

    @torch.no_grad()
    def update(self, gamma: float) -> float:
        """Apply the bias step; returns the worst max/mean load ratio over routers for this step."""
        worst = 0.0
        for n, g in self.gates.items():
            c = self.counts[n]
            if c.sum() == 0:
                continue
            g.e_score_correction_bias += gamma * torch.sign(c.mean() - c)
            worst = max(worst, (c.max() / c.mean()).item())
            c.zero_()
        return worst

    @torch.no_grad()
    def biases(self):
        return {n: g.e_score_correction_bias.detach().cpu().tolist() for n, g in self.gates.items()}


def find_gates(model, mtp):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gates = {n: m for n, m in model.named_modules() if isinstance(m, DeepseekV3TopkRouter)}
    gates.update({"mtp." + n: m for n, m in mtp.named_modules() if isinstance(m, DeepseekV3TopkRouter)})
    return gates


def losses(model, mtp, w: torch.Tensor, mtp_weight: float):
    """w: [B, T+1] token windows. Main loss predicts w[t+1] from w[..t]; MTP loss predicts w[t+2] from
    (h_t, emb(w[t+1])) for t = 0..T-2."""
    x = w[:, :-1]
    h = model.model(input_ids=x).last_hidden_state
    logits = model.lm_head(h)
    v = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, v), w[:, 1:].reshape(-1))
    ml = mtpa.mtp_logits(model, mtp, h, x)
    aux = F.cross_entropy(ml.float().reshape(-1, v), w[:, 2:].reshape(-1))
    return main + mtp_weight * aux, main, aux


# ------------------------------------------------------------------------------------------------- saving


def save_checkpoint(model, mtp, out: str, max_shard_bytes: int):
    from safetensors.torch import save_file

    sd = mtpa.to_hub_names({k: v for k, v in model.state_dict().items()})
    sd.update(mtpa.mtp_hub_state(model, mtp, f"model.layers.{model.config.num_hidden_layers}."))
    tensors = {}
    for k, v in sd.items():
        v = v.detach().to("cpu")
        # the bias moves in steps of gamma; bf16 would round most of them away (the official release keeps it fp32)
        tensors[k] = v.float().contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16).contiguous()

    def order(k):
        parts = k.split(".")
        layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else (-1 if "embed" in k else 10 ** 6)
        return (layer, k)

    shards, cur, cur_bytes = [], {}, 0
    for k in sorted(tensors, key=order):
        nb = tensors[k].numel() * tensors[k].element_size()
        if cur and cur_bytes + nb > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[k] = tensors[k]
        cur_bytes += nb
    if cur:
        shards.append(cur)
    for f in os.listdir(out):
        if f.startswith("model-") and f.endswith(".safetensors"):
            os.remove(os.path.join(out, f))
    wmap, total = {}, 0
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(out, name), metadata={"format": "pt"})
        for k, v in sh.items():
            wmap[k] = name
            total += v.numel() * v.element_size()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, f, indent=2)
    return len(shards), total


def pack(src: str, dest: str, part_bytes: int = 15 * 1024 * 1024):
    """Tar `src` into dest/nano.tar.NNN parts (the device tool returns few files of bounded size)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=os.path.basename(os.path.normpath(src)))
    data = buf.getvalue()
    os.makedirs(dest, exist_ok=True)
    for f in os.listdir(dest):
        if f.startswith("nano.tar."):
            os.remove(os.path.join(dest, f))
    for i in range(0, len(data), part_bytes):
        tmp = os.path.join(dest, f".part{i // part_bytes:03d}")
        with open(tmp, "wb") as f:
            f.write(data[i:i + part_bytes])
        os.replace(tmp, os.path.join(dest, f"nano.tar.{i // part_bytes:03d}"))


# -------------------------------------------------------------------------------------------------- main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="model folder to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy shapes for smoke tests")
    ap.add_argument("--steps", type=int, default=100000, help="max optimizer steps")
    ap.add_argument("--time-budget", type=float, default=0, help="seconds of training (0 = steps only)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free balancing step")
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N stdlib files (tests)")
    ap.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's stdlib)")
    ap.add_argument("--heldout-bytes", type=int, default=300_000)
    ap.add_argument("--max-shard-mb", type=float, default=8.0)
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds between validation evals")
    ap.add_argument("--ckpt-every", type=float, default=150.0, help="seconds between packed checkpoints")
    ap.add_argument("--pack-to", default=None, help="also tar the model folder into this directory")
    ap.add_argument("--eval-max-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts-impl", default="eager", help="transformers experts_implementation for training")
    a = ap.parse_args(argv)
    shapes = TINY if a.tiny else FULL
    a.batch_size = a.batch_size or (4 if a.tiny else 64)
    a.seq_len = a.seq_len or (64 if a.tiny else 512)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 100)
    if a.eval_max_tokens is None and a.tiny:
        a.eval_max_tokens = 1024
    if a.seq_len + 1 > shapes["max_position_embeddings"]:
        ap.error(f"--seq-len {a.seq_len} exceeds max_position_embeddings {shapes['max_position_embeddings']}")
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    return a, shapes


def main(argv=None):
    a, shapes = parse(argv)
    t_start = time.time()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    os.makedirs(a.out, exist_ok=True)

    # corpus ----------------------------------------------------------------------------------------------
    root, rels = stdlib_files(a.stdlib)
    if a.max_files:
        rels = rels[:a.max_files]
    texts = {"train": [], "val": [], "heldout": []}
    files = {"train": [], "val": [], "heldout": []}
    skipped = []
    for i, rel in enumerate(rels):
        t = read_text(os.path.join(root, rel))
        if t is None:
            skipped.append(rel)
            continue
        s = split_of(i)
        texts[s].append(t)
        files[s].append(rel)
    if not texts["train"] or not texts["heldout"] or not texts["val"]:
        sys.exit(f"error: corpus at {root} too small: {[len(v) for v in texts.values()]} files per split")
    pyver = platform.python_version()
    log(f"python {pyver} stdlib {root}: {len(rels)} files, split "
        f"{ {k: len(v) for k, v in files.items()} }, skipped {len(skipped)}; "
        f"train chars {sum(map(len, texts['train'])):,}")

    # tokenizer -------------------------------------------------------------------------------------------
    tk = train_tokenizer(texts["train"], shapes["vocab_size"])
    if tk.get_vocab_size() != shapes["vocab_size"]:
        log(f"note: tokenizer vocab is {tk.get_vocab_size()} (< {shapes['vocab_size']}, small corpus)")
    save_tokenizer(tk, a.out, shapes["max_position_embeddings"])

    def stream(ts):
        encs = tk.encode_batch(ts, add_special_tokens=False)
        out = []
        for e in encs:
            out.append(0)
            out.extend(e.ids)
            out.append(1)
        return torch.tensor(out, dtype=torch.long)

    train_ids, val_ids = stream(texts["train"]), stream(texts["val"])
    log(f"tokens: train {train_ids.numel():,} val {val_ids.numel():,} (tokenizer+encode {time.time() - t_start:.1f}s)")
    counts = Counter(train_ids.tolist())
    with open(os.path.join(a.out, "unigram_counts.json"), "w") as f:
        json.dump({str(k): counts[k] for k in sorted(counts)}, f)
    ho_text = heldout_text(texts["heldout"], a.heldout_bytes)
    with open(os.path.join(a.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(ho_text)

    # model -----------------------------------------------------------------------------------------------
    cfg = hub_config(shapes)
    if tk.get_vocab_size() > cfg["vocab_size"]:
        sys.exit("error: tokenizer larger than the model vocabulary")
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False}, f, indent=2)
    model, mtp = build_model(a.out, a.experts_impl)
    model.to(dev).train()
    mtp.to(dev).train()
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    cfgm = model.config
    per_expert = 3 * cfgm.hidden_size * cfgm.moe_intermediate_size
    n_moe_layers = cfgm.num_hidden_layers - cfgm.first_k_dense_replace
    n_active = n_main - n_moe_layers * per_expert * (cfgm.n_routed_experts - cfgm.num_experts_per_tok)
    log(f"params: main {n_main:,} (active/token {n_active:,}) + mtp {n_mtp:,} (embedding/head shared)")
    gates = find_gates(model, mtp)
    load = ExpertLoad(gates)

    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95),
                            fused=dev.type == "cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)

    T, B = a.seq_len, a.batch_size
    if train_ids.numel() < T + 2:
        sys.exit("error: training split shorter than one sequence")
    g = torch.Generator().manual_seed(a.seed)
    nval = max(1, min(32, (val_ids.numel() - 1) // (T + 1)))
    val_batch = torch.stack([val_ids[i * (T + 1):(i + 1) * (T + 1)] for i in range(nval)]) \
        if val_ids.numel() >= T + 1 else None

    def batch():
        off = torch.randint(0, train_ids.numel() - T - 1, (B,), generator=g)
        return torch.stack([train_ids[o:o + T + 1] for o in off]).to(dev, non_blocking=True)

    @torch.no_grad()
    def val_loss():
        if val_batch is None:
            return float("nan")
        model.eval(); mtp.eval()
        with amp:
            _, m, x = losses(model, mtp, val_batch.to(dev), a.mtp_weight)
        model.train(); mtp.train()
        return m.item(), x.item()

    def snapshot():
        return ({k: v.detach().clone() for k, v in model.state_dict().items()},
                {k: v.detach().clone() for k, v in mtp.state_dict().items()})

    info = {
        "python_version": pyver, "python_implementation": platform.python_implementation(),
        "stdlib_root": root, "corpus_files_total": len(rels), "corpus_files_skipped_empty_or_not_utf8": skipped,
        "split_rule": "sorted relative path index i: i%20==0 heldout, i%20==10 val, else train",
        "files": files, "tokens_train": train_ids.numel(), "tokens_val": val_ids.numel(),
        "tokenizer_vocab": tk.get_vocab_size(),
        "heldout_txt": "first <=6000 chars (cut at a line end) of each held-out file, joined by blank lines, "
                       f"<= {a.heldout_bytes} bytes; evaluation tokenizes it with BOS and scores non-overlapping "
                       "windows of seq_len tokens",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "params_main": n_main, "params_mtp_extra": n_mtp, "params_total": n_main + n_mtp,
        "params_active_per_token_main": n_active,
        "hyper": {"batch_size": B, "seq_len": T, "lr": a.lr, "warmup": a.warmup, "weight_decay": a.weight_decay,
                  "betas": [0.9, 0.95], "mtp_weight": a.mtp_weight, "bias_gamma": a.bias_gamma,
                  "schedule": "linear warmup then cosine to 10% over max(step/steps, elapsed/time_budget)",
                  "precision": "bf16 autocast, fp32 master weights" if dev.type == "cuda" else "fp32",
                  "experts_implementation": getattr(model.config, "_experts_implementation", None),
                  "seed": a.seed},
        "mtp": {"layer": cfgm.num_hidden_layers,
                "hidden_input": "main model final normed hidden state h_t (DeepseekV3Model.last_hidden_state)",
                "projection_input": "concat(enorm(embed(x_{t+1})), hnorm(h_t))",
                "output": "shared_head.norm then the shared lm_head; predicts x_{t+2}",
                "stored_copies": "model.layers.N.embed_tokens.weight and .shared_head.head.weight equal the "
                                 "main embedding and lm_head"},
        "balancing": "aux-loss-free: e_score_correction_bias += gamma*sign(mean_load - load) per step per router "
                     "(main MoE layers and the MTP block); no auxiliary loss",
    }

    # train ---------------------------------------------------------------------------------------------------
    def progress(step, elapsed):
        p = step / a.steps
        if a.time_budget > 0:
            p = max(p, elapsed / a.time_budget)
        return min(p, 1.0)

    t0 = time.time()
    last_eval = last_ckpt = t0
    step = tokens = 0
    hist, val_hist = [], []
    best = (float("inf"), None, 0)
    ema = None
    imbalance = 0.0
    while True:
        el = time.time() - t0
        p = progress(step, el)
        if step >= a.steps or p >= 1.0:
            break
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        for gr in opt.param_groups:
            gr["lr"] = lr
        w = batch()
        with amp:
            loss, lm, lx = losses(model, mtp, w, a.mtp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = load.update(a.bias_gamma)
        step += 1
        tokens += w[:, :-1].numel()
        if step % 10 == 0 or step <= 3:
            lm_v, lx_v = lm.item(), lx.item()
            ema = lm_v if ema is None else 0.9 * ema + 0.1 * lm_v
            hist.append({"step": step, "t": round(time.time() - t0, 1), "loss": round(lm_v, 4),
                         "mtp_loss": round(lx_v, 4), "lr": lr, "grad_norm": round(gn.item(), 3),
                         "max_over_mean_expert_load": round(imbalance, 3)})
            if step % 100 == 0 or step <= 3:
                log(f"step {step} loss {lm_v:.4f} mtp {lx_v:.4f} lr {lr:.2e} gn {gn.item():.2f} "
                    f"load max/mean {imbalance:.2f} tok/s {tokens / (time.time() - t0):,.0f}")
        now = time.time()
        if now - last_eval >= a.eval_every:
            vm, vx = val_loss()
            val_hist.append({"step": step, "t": round(now - t0, 1), "val_loss": round(vm, 4), "val_mtp_loss": round(vx, 4)})
            log(f"  val loss {vm:.4f} mtp {vx:.4f} (best {best[0]:.4f})")
            if vm < best[0]:
                best = (vm, snapshot(), step)
            last_eval = time.time()
        if a.pack_to and time.time() - last_ckpt >= a.ckpt_every:
            save_checkpoint(model, mtp, a.out, int(a.max_shard_mb * 1024 * 1024))
            info.update(partial=True, steps=step, tokens_seen=tokens, loss_history=hist, val_history=val_hist)
            with open(os.path.join(a.out, "training.json"), "w") as f:
                json.dump(info, f, indent=1)
            pack(a.out, a.pack_to)
            log(f"  packed checkpoint at step {step}")
            last_ckpt = time.time()
    train_s = time.time() - t0
    vm, vx = val_loss()
    val_hist.append({"step": step, "t": round(train_s, 1), "val_loss": round(vm, 4), "val_mtp_loss": round(vx, 4)})
    final_train = hist[-1]["loss"] if hist else float("nan")
    chosen = step
    if best[1] is not None and best[0] < vm:
        model.load_state_dict(best[1][0])
        mtp.load_state_dict(best[1][1])
        chosen = best[2]
        log(f"restored best validation checkpoint from step {chosen} (val {best[0]:.4f} < final {vm:.4f})")
    log(f"trained {step} steps, {tokens:,} tokens in {train_s:.1f}s")

    # save + verify -------------------------------------------------------------------------------------------
    n_shards, total_bytes = save_checkpoint(model, mtp, a.out, int(a.max_shard_mb * 1024 * 1024))
    info.update(partial=False, steps=step, tokens_seen=tokens, train_seconds=round(train_s, 1),
                epochs=round(tokens / train_ids.numel(), 2), final_train_loss=final_train,
                final_train_loss_ema=ema, final_val_loss=vm, checkpoint_step=chosen,
                best_val_loss=min(best[0], vm), loss_history=hist,
                train_loss_at_checkpoint=next((h["loss"] for h in reversed(hist) if h["step"] <= chosen), None), val_history=val_hist,
                expert_bias=load.biases(), shards=n_shards, checkpoint_bytes=total_bytes)
    with open(os.path.join(a.out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)

    if a.pack_to:
        pack(a.out, a.pack_to)  # the model comes back even if verification below breaks
    try:
        info["verify"] = verify(a, model, mtp, dev, counts, ho_text)
    except Exception as e:  # keep the trained model; the failure is recorded and re-raised after packing
        import traceback
        traceback.print_exc()
        info["verify_error"] = repr(e)
        with open(os.path.join(a.out, "training.json"), "w") as f:
            json.dump(info, f, indent=1)
        if a.pack_to:
            pack(a.out, a.pack_to)
        raise
    info["total_seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(a.out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
    log("verify:", json.dumps({k: v for k, v in info["verify"].items() if k != "samples"}, indent=1))
    for s in info["verify"]["samples"]:
        log("sample:\n" + s["prompt"] + s["completion"])
    if a.pack_to:
        pack(a.out, a.pack_to)
        log("packed final model")
    return info


@torch.no_grad()
def verify(a, model, mtp, dev, counts, ho_text):
    """Reload the saved folder through transformers and measure everything on the *saved* (bf16) weights."""
    from transformers import AutoTokenizer

    res = {}
    lm, lmtp, tok = mtpa.load_model_and_mtp(a.out, str(dev), experts_impl=a.experts_impl)
    # the trained model rounded to bf16 must give the same logits as the reloaded one
    ref = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    model.eval(); mtp.eval()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict({k: (v if k.endswith("e_score_correction_bias") else ref[k]) for k, v in saved.items()})
    x = torch.tensor([tok("def fibonacci(n):\n    return n")["input_ids"]], device=dev)
    res["reload_max_abs_logit_diff"] = (model(input_ids=x).logits.float() - lm(input_ids=x).logits.float()).abs().max().item()
    model.load_state_dict(saved)

    sample = ho_text[:2000]
    enc = tok(sample, verbose=False)["input_ids"]
    res["tokenizer_roundtrip_ok"] = tok.decode(enc, skip_special_tokens=True) == sample
    res["tokenizer_bos_first"] = enc[0] == tok.bos_token_id == 0

    res.update(mtpa.evaluate(lm, lmtp, tok, ho_text, seq_len=a.seq_len, max_tokens=a.eval_max_tokens,
                             unigram_counts=counts))
    res.update(mtpa.greedy_speculative_acceptance(
        lm, lmtp, tok, ho_text, n_prompts=4 if a.tiny else 32, prompt_len=16 if a.tiny else 64,
        gen_len=8 if a.tiny else 128))
    samples = []
    for prompt in ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self"]:
        ids = tok(prompt, return_tensors="pt")["input_ids"].to(dev)
        out = lm.generate(ids, max_new_tokens=16 if a.tiny else 80, do_sample=False)
        samples.append({"prompt": prompt, "completion": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)})
    res["samples"] = samples
    return res


if __name__ == "__main__":
    main()
