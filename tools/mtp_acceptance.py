#!/usr/bin/env python3
"""DeepSeek-V3 multi-token-prediction (MTP) module and its evaluation, for the nano model.

transformers' DeepseekV3ForCausalLM runs the main model only; DeepSeek-V3 checkpoints carry the MTP module as
the extra layer `model.layers.{num_hidden_layers}` (enorm, hnorm, eh_proj, one decoder block, shared_head.norm,
plus copies of the shared embedding and output head). This file holds:

  * `NanoMTP`: that module built from transformers' own decoder-layer class, so its block is bit-for-bit the
    architecture the main model uses (MLA + MoE with the sigmoid/noaux_tc router);
  * conversion between the in-memory state dicts (transformers >= 5 fuses experts into 3-D tensors) and the
    official hub names (`mlp.experts.{e}.gate_proj.weight` ...);
  * `load_model_and_mtp(dir)`: the main model through `from_pretrained` plus the MTP module from the shards;
  * the measurements recorded in training.json: held-out perplexity against a unigram baseline, and MTP
    acceptance (teacher-forced on held-out text and inside a real greedy speculative-decoding loop).

Run `python tools/mtp_acceptance.py MODEL_DIR [--update]` to re-measure a saved model (`--update` rewrites the
numbers in MODEL_DIR/training.json).

MTP semantics (same as DeepSeek-V3's inference code, vLLM and transformers' MtpLayer): at position t the module
takes h_t, the main model's final *normed* hidden state, and emb(x_{t+1}); it computes
    block(eh_proj(concat(enorm(emb(x_{t+1})), hnorm(h_t))))
causally over positions, applies shared_head.norm and the shared output head, and predicts x_{t+2}.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

from safetensors.torch import load_file


# --------------------------------------------------------------------------------------------- MTP module


class _SharedHead(nn.Module):
    """Holds only the norm: the head matrix itself is the main model's lm_head (shared, as in DeepSeek-V3)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


class NanoMTP(nn.Module):
    def __init__(self, config):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        super().__init__()
        self.config = config
        h = config.hidden_size
        self.enorm = m.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = m.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # layer_idx = num_hidden_layers makes the block a MoE block, as layer 61 of DeepSeek-V3 is.
        self.block = m.DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = _SharedHead(m.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps))

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings, position_ids):
        """hidden: [B, T, H] main-model normed hidden states at t; next_embeds: [B, T, H] embeddings of x_{t+1}.
        Returns the normed MTP hidden states [B, T, H]; apply the shared lm_head to get logits for x_{t+2}."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        impl = getattr(self.config, "_attn_implementation", "sdpa")
        mask = None
        if impl != "sdpa" and x.shape[1] > 1:
            # sdpa infers causality from a missing mask; the eager path would otherwise attend to the future.
            t = x.shape[1]
            mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        if isinstance(x, tuple):  # older transformers returned (hidden_states, ...)
            x = x[0]
        return self.shared_head.norm(x)


def mtp_logits(model, mtp: NanoMTP, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits for x_{t+2} at t = 0..T-2, from the main model's normed hidden states `hidden` [B, T, H] over
    `input_ids` [B, T]. Returns [B, T-1, V]."""
    t = input_ids.shape[1]
    pos = torch.arange(t - 1, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    nxt = model.model.embed_tokens(input_ids[:, 1:])
    pe = model.model.rotary_emb(nxt, pos)
    return model.lm_head(mtp(hidden[:, :-1], nxt, pe, pos))


# --------------------------------------------------------------------------------- hub-format conversion


_FUSED = re.compile(r"^((?:.*\.)?mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^((?:.*\.)?mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hub_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an in-memory state dict to DeepSeek-V3's official per-expert names.

    transformers 5.x stores experts as gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I];
    the hub format is one nn.Linear weight per expert and projection."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = _FUSED.match(k)
        if not m:
            out[k] = v
            continue
        base, kind = m.groups()
        if kind == "gate_up_proj":
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
        else:
            for e in range(v.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = v[e].contiguous()
    return out


def from_hub_names(hub: dict[str, torch.Tensor], target_keys) -> dict[str, torch.Tensor]:
    """Inverse of to_hub_names for the keys a module expects (fused or per-expert, whichever it uses)."""
    target_keys = set(target_keys)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in hub.items():
        m = _PER_EXPERT.match(k)
        if m and k not in target_keys:
            base, e, kind = m.groups()
            experts.setdefault(base, {}).setdefault(int(e), {})[kind] = v
        else:
            out[k] = v
    for base, per in experts.items():
        n = max(per) + 1
        if sorted(per) != list(range(n)):
            raise ValueError(f"{base}: expert indices are not contiguous 0..{n - 1}")
        for e in range(n):
            lacking = {"gate_proj", "up_proj", "down_proj"} - set(per[e])
            if lacking:
                raise ValueError(f"{base}.{e}: missing {sorted(lacking)}")
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]], dim=0) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(n)])
    return out


def mtp_hub_state(model, mtp: NanoMTP, prefix: str) -> dict[str, torch.Tensor]:
    """The MTP tensors under DeepSeek-V3's names, including the copies of the shared embedding and head that
    the official checkpoint also stores in the MTP layer (engines that load a layer on its own expect them)."""
    sd = {}
    for k, v in mtp.state_dict().items():
        if k.startswith("block."):
            k = k[len("block."):]
        sd[prefix + k] = v
    sd[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight
    sd[prefix + "shared_head.head.weight"] = model.lm_head.weight
    return to_hub_names(sd)


def read_shards(model_dir: str, prefix: str | None = None) -> dict[str, torch.Tensor]:
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(wmap.values())):
        for k, v in load_file(os.path.join(model_dir, shard)).items():
            if prefix is None or k.startswith(prefix):
                out[k] = v
    return out


def load_mtp(model_dir: str, model, dtype=torch.float32) -> NanoMTP:
    """Build NanoMTP for `model` (a loaded DeepseekV3ForCausalLM) and fill it from the checkpoint's MTP layer."""
    cfg = model.config
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    hub = read_shards(model_dir, prefix)
    if not hub:
        raise ValueError(f"{model_dir}: no MTP tensors under '{prefix}*' in the checkpoint")
    mtp = NanoMTP(cfg)
    local = {k[len(prefix):]: v for k, v in hub.items()}
    shared = {"embed_tokens.weight": model.model.embed_tokens.weight,
              "shared_head.head.weight": model.lm_head.weight}
    for name, ref in shared.items():
        if name in local and not torch.equal(local.pop(name).to(ref.dtype).cpu(), ref.detach().cpu()):
            # The copies must match the shared tensors, or an engine reading either would disagree.
            raise ValueError(f"{model_dir}: MTP copy {prefix}{name} differs from the main model's tensor")
    block_keys = {k[len("block."):] for k in mtp.state_dict() if k.startswith("block.")}
    renamed = {}
    for k, v in from_hub_names(local, block_keys).items():
        renamed[("block." + k) if k.split(".")[0] in {"self_attn", "mlp", "input_layernorm",
                                                       "post_attention_layernorm"} else k] = v
    missing, unexpected = mtp.load_state_dict(renamed, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: MTP layer mismatch: missing={missing} unexpected={unexpected}")
    dev = next(model.parameters()).device
    return mtp.to(device=dev, dtype=dtype).eval()


def load_model_and_mtp(model_dir: str, device: str = "cpu", dtype=torch.float32, experts_impl: str = "eager"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                 experts_implementation=experts_impl)
    model = model.to(device).eval()
    mtp = load_mtp(model_dir, model, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return model, mtp, tok


# ------------------------------------------------------------------------------------------- measurements


def heldout_windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """Non-overlapping windows; a short tail still counts if it has at least one target."""
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 2]


@torch.no_grad()
def evaluate(model, mtp, tok, text: str, seq_len: int = 512, batch: int = 16, max_tokens: int | None = None,
             unigram_counts: dict | None = None) -> dict:
    """Held-out perplexity (token level, every token except each window's first is a target) and teacher-forced
    MTP acceptance: at t, does argmax MTP(h_t, emb(x_{t+1})) equal the main model's greedy token at t+1?"""
    dev = next(model.parameters()).device
    ids = tok(text, verbose=False)["input_ids"]  # long on purpose: windowed below
    if max_tokens:
        ids = ids[:max_tokens]
    wins = heldout_windows(ids, seq_len)
    if not wins:
        raise ValueError("held-out text is too short to evaluate")
    nll = 0.0
    n = 0
    acc_main = acc_mtp = accept = n_mtp = 0
    for i in range(0, len(wins), batch):
        group = wins[i:i + batch]
        # equal lengths within a call: evaluate the ragged tail window on its own
        for same in ([w for w in group if len(w) == len(group[0])], [w for w in group if len(w) != len(group[0])]):
            if not same:
                continue
            x = torch.tensor(same, device=dev)
            out = model.model(input_ids=x)
            h = out.last_hidden_state
            logits = model.lm_head(h).float()
            nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum").item()
            n += x[:, 1:].numel()
            greedy = logits.argmax(-1)  # greedy[t] predicts x[t+1]
            acc_main += (greedy[:, :-1] == x[:, 1:]).sum().item()
            if x.shape[1] >= 3:
                draft = mtp_logits(model, mtp, h, x).float().argmax(-1)  # draft[t] predicts x[t+2]
                accept += (draft[:, :-1] == greedy[:, 1:-1]).sum().item()
                acc_mtp += (draft[:, :-1] == x[:, 2:]).sum().item()
                n_mtp += draft[:, :-1].numel()
    res = {
        "heldout_tokens_scored": n,
        "heldout_ppl": math.exp(nll / n),
        "heldout_loss": nll / n,
        "main_top1_accuracy": acc_main / n,
        "mtp_teacher_forced_acceptance": accept / max(n_mtp, 1),
        "mtp_top1_accuracy_vs_text": acc_mtp / max(n_mtp, 1),
        "mtp_positions": n_mtp,
        "seq_len": seq_len,
    }
    if unigram_counts is not None:
        res["unigram_ppl"] = unigram_ppl(unigram_counts, [w[1:] for w in wins], model.config.vocab_size)
    return res


def unigram_ppl(counts: dict, target_windows, vocab_size: int) -> float:
    """Add-one smoothed unigram model from training-split token counts."""
    total = sum(counts.values())
    denom = total + vocab_size
    nll = 0.0
    n = 0
    for w in target_windows:
        for t in w:
            nll -= math.log((counts.get(int(t), counts.get(str(t), 0)) + 1) / denom)
            n += 1
    return math.exp(nll / n)


@torch.no_grad()
def greedy_speculative_acceptance(model, mtp, tok, text: str, n_prompts: int = 32, prompt_len: int = 64,
                                  gen_len: int = 128) -> dict:
    """Acceptance of the MTP draft inside a real greedy 1-token speculative decoding loop.

    Prompts are token windows of the held-out text; continuations are the main model's greedy output. On such a
    sequence s, every s_{t+2} after the prompt is the main model's greedy choice, so [argmax MTP(h_t, emb(s_{t+1}))
    == s_{t+2}] is exactly whether the draft would be accepted when decoding."""
    dev = next(model.parameters()).device
    ids = tok(text, verbose=False)["input_ids"]  # long on purpose: windowed below
    stride = max(prompt_len, (len(ids) - prompt_len) // max(n_prompts, 1))
    prompts = [ids[i:i + prompt_len] for i in range(0, len(ids) - prompt_len, stride)][:n_prompts]
    if not prompts:
        raise ValueError("held-out text is too short for the speculative-decoding measurement")
    x = torch.tensor(prompts, device=dev)
    from transformers import DynamicCache

    # greedy decoding with a KV cache; the whole sequence is re-scored in one pass afterwards
    cache = DynamicCache(config=model.config)
    # transformers renamed past_key_values to cache (5.2x); pass whichever this version's forward takes
    ckw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = model(input_ids=x, use_cache=True, **{ckw: cache}).logits[:, -1]
    seq = x
    for _ in range(gen_len):
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        logits = model(input_ids=nxt, use_cache=True, **{ckw: cache}).logits[:, -1]
    h = model.model(input_ids=seq).last_hidden_state
    greedy = model.lm_head(h).float().argmax(-1)
    draft = mtp_logits(model, mtp, h, seq).float().argmax(-1)
    p = prompt_len
    # positions t whose t+1 and t+2 are both generated: t = p-1 .. L-3
    consistent = (greedy[:, p - 1:-1] == seq[:, p:]).float().mean().item()
    hits = (draft[:, p - 1:-1] == seq[:, p + 1:])
    return {
        "mtp_greedy_decode_acceptance": hits.float().mean().item(),
        "greedy_decode_positions": hits.numel(),
        "greedy_recompute_consistency": consistent,
        "n_prompts": len(prompts), "prompt_len": prompt_len, "gen_len": gen_len,
    }


def measure(model_dir: str, device: str = "cpu", max_tokens: int | None = None, seq_len: int = 512,
            n_prompts: int = 32, gen_len: int = 128) -> dict:
    model, mtp, tok = load_model_and_mtp(model_dir, device)
    with open(os.path.join(model_dir, "heldout.txt"), encoding="utf-8") as f:
        text = f.read()
    counts = None
    p = os.path.join(model_dir, "unigram_counts.json")
    if os.path.exists(p):
        with open(p) as f:
            counts = {int(k): v for k, v in json.load(f).items()}
    t0 = time.time()
    res = evaluate(model, mtp, tok, text, seq_len=seq_len, max_tokens=max_tokens, unigram_counts=counts)
    res.update(greedy_speculative_acceptance(model, mtp, tok, text, n_prompts=n_prompts, gen_len=gen_len))
    res["eval_seconds"] = round(time.time() - t0, 2)
    res["eval_device"] = device
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--update", action="store_true", help="write the results into MODEL_DIR/training.json")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.model_dir):
        sys.exit(f"error: {a.model_dir} is not a directory")
    res = measure(a.model_dir, a.device, a.max_tokens, n_prompts=a.n_prompts, gen_len=a.gen_len)
    print(json.dumps(res, indent=2))
    if a.update:
        p = os.path.join(a.model_dir, "training.json")
        info = json.load(open(p)) if os.path.exists(p) else {}
        info["eval"] = res
        with open(p, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
