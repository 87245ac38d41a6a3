"""What transformers itself writes for fused fp8 experts (run on a GPU machine: transformers keeps
fp8 weights quantized only on CUDA).

Loads a tiny official-fp8 DeepSeek-V3 checkpoint (hub layout, per-expert weight_scale_inv) with
transformers' fine-grained fp8 integration, saves it with save_pretrained(save_original_format=False)
(fused) and by default, and records every tensor's name, dtype and shape of both. It also loads the
fused fp8 directory tests/tiny_checkpoints.py builds by hand and compares transformers' logits on it
with the hub layout's. Output (into OUT, default ./fp8_probe): layout.json and the fused directory.

    python tools/probe_fp8_fused_layout.py [OUT]
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_checkpoints as T  # noqa: E402


def headers(d: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                out[k] = [str(t.get_dtype()), list(t.get_shape())]
    return out


def main() -> int:
    import transformers
    from transformers import AutoModelForCausalLM

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "fp8_probe")
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    hub, _, _ = T.make("v3fp8probe", work / "hub")
    ours, _, _ = T.make("v3fp8probe", work / "ours_fused", layout="fused")
    report = {"transformers": transformers.__version__, "torch": torch.__version__}
    x = torch.tensor([[5, 17, 200, 3, 99, 42, 7]], device="cuda")
    logits = {}
    for name, d in (("hub", hub), ("ours_fused", ours)):
        m = AutoModelForCausalLM.from_pretrained(str(d), device_map="cuda", dtype=torch.bfloat16).eval()
        try:   # transformers' fp8 matmul comes from the `kernels` hub package, absent on an offline machine
            with torch.no_grad():
                logits[name] = m(x).logits.float().cpu()
        except ImportError as e:
            report["forward_error"] = str(e)
        if name == "hub":
            report["in_memory"] = {k: [str(v.dtype), list(v.shape)] for k, v in m.state_dict().items()
                                   if ".layers.1.mlp.experts" in k}
            m.save_pretrained(str(out / "tf_fused"), save_original_format=False)
            m.save_pretrained(str(work / "tf_default"))
            report["saved_fused"] = headers(out / "tf_fused")
            report["saved_default"] = {k: v for k, v in headers(work / "tf_default").items()
                                       if ".layers.1.mlp.experts" in k}
        del m
    report["ours_fused"] = headers(ours)
    if len(logits) == 2:
        report["logits_max_abs_diff_hub_vs_ours_fused"] = float((logits["hub"] - logits["ours_fused"]).abs().max())
        report["logits_max_abs_hub"] = float(logits["hub"].abs().max())
    fused_names = {k for k in report["saved_fused"] if ".mlp.experts." in k}
    ours_names = {k for k in report["ours_fused"] if ".mlp.experts." in k}
    report["same_expert_names_and_shapes"] = (
        fused_names == ours_names
        and all(report["saved_fused"][k] == report["ours_fused"][k] for k in fused_names))
    (out / "layout.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(work)
    for k in sorted(fused_names):
        if ".layers.1." in k:
            print(k, report["saved_fused"][k], "ours:", report["ours_fused"].get(k))
    print("same names/shapes:", report["same_expert_names_and_shapes"], "logit diff hub vs ours fused:",
          report.get("logits_max_abs_diff_hub_vs_ours_fused", report.get("forward_error")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
