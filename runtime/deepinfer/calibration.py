"""Activation statistics for `deepinfer quantize --calibration FILE`: the source model run on a
text file (transformers' implementation, loaded only here), recording each quantized linear's input."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import quant_formats as QF
from . import validate as V
from .errors import CheckpointError, ConfigError
from .weight_quant import ActivationStats


def collect_activation_stats(src: Path, text_file: Path, max_tokens: int = 512, sample_rows: int = 128,
                             seq_len: int = 256) -> dict:
    """Runs `text_file` through the source model and records, for each linear we quantize, the
    mean |x| of its input channels and a subsample of input rows ({weight name: ActivationStats}).

    The forward pass is transformers' implementation of the same checkpoint (an independent
    implementation that loads DeepSeek V2/V3 hub directories on the CPU). Routed experts, which
    transformers 5 stores fused, are measured on the tokens actually routed to each expert.
    """
    text = V.read_text_file(text_file, "calibration file", err=ConfigError)
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError(f"--calibration needs torch and transformers to run the source model ({e})") from None
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{src}: calibration needs tokenizer.json")
    ids = Tokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids[:max_tokens]
    if not ids:
        raise ConfigError(f"calibration file {text_file} gives no tokens")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report lists our MTP layer as "unexpected": it is, for it
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    except Exception as e:  # transformers raises many types for checkpoints it cannot read
        raise CheckpointError(f"calibration: transformers cannot load {src} ({type(e).__name__}: {e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    acc: dict[str, list] = {}
    rng = np.random.default_rng(0)

    def record(name: str, x) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().numpy()
        if x.shape[0] == 0:
            return
        e = acc.setdefault(name, [np.zeros(x.shape[1]), 0, []])
        e[0] += np.abs(x).sum(0)
        e[1] += x.shape[0]
        e[2].append(x[rng.permutation(x.shape[0])[:sample_rows]])

    hooks = []
    for mod_name, mod in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf in QF.QUANTIZED_LINEARS:
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, n=mod_name + ".weight": record(n, args[0])))
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and not isinstance(mod, torch.nn.Linear):
            def experts_hook(m, args, prefix=mod_name):
                hidden, top_idx = args[0], args[1]
                for e in range(m.gate_up_proj.shape[0]):
                    rows = (top_idx == e).any(-1).nonzero().flatten()
                    if rows.numel() == 0:
                        continue
                    x = hidden[rows]
                    record(f"{prefix}.{e}.gate_proj.weight", x)
                    record(f"{prefix}.{e}.up_proj.weight", x)
                    gate, up = torch.nn.functional.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
                    record(f"{prefix}.{e}.down_proj.weight", m.act_fn(gate) * up)
            hooks.append(mod.register_forward_pre_hook(experts_hook))
    try:
        with torch.no_grad():
            for s in range(0, len(ids), seq_len):
                model(torch.tensor([ids[s:s + seq_len]]))
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, (sum_abs, count, samples) in acc.items():
        sample = np.concatenate(samples)
        sample = sample[rng.permutation(sample.shape[0])[:sample_rows]]
        out[name] = ActivationStats((sum_abs / count).astype(np.float32), sample.astype(np.float32), count)
    return out
