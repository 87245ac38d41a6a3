"""The model config: one dataclass read from a hub `config.json` of the DeepSeek V2 / V3 family.

Accepts the keys as DeepSeek publishes them (`rope_scaling` with `type: yarn`, `rope_theta` at the
top level, `scoring_func`, `topk_method`) and as transformers 5 saves them (`rope_parameters` with
`rope_type`). Everything the graph needs is resolved here once (softmax scale, rope attention
factor, which layers are MoE), so the graph code never re-derives it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_ARCH_TO_TYPE = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 "DeepseekV32ForCausalLM": "deepseek_v32", "DeepseekV4ForCausalLM": "deepseek_v4"}
# Later DeepSeek families and the ops they need that deepinfer does not have yet. Running them with
# V3's dense attention would load and compute a different model, so they stop at the config.
_MISSING_FEATURES = {
    "deepseek_v32": "DeepSeek Sparse Attention (DSA): the lightning indexer (index_n_heads, index_head_dim) and "
                    "top-k sparse MLA over index_topk selected tokens",
    "deepseek_v4": "V4's compressed sparse / heavily compressed attention (CSA/HCA, compress_ratios) with the "
                   "sliding window, hyper-connections (hc_mult), hash routing of the first num_hash_layers, "
                   "sqrtsoftplus expert scoring, grouped low-rank output (o_lora_rank) and fp4 experts",
}
# keys that only those families have: a config that carries them under another model_type is one of them
_FAMILY_KEYS = {"deepseek_v32": ("index_topk", "index_n_heads"),
                "deepseek_v4": ("hc_mult", "compress_ratios", "num_hash_layers", "o_lora_rank")}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"            # "default" or "yarn"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None   # an explicit value wins over mscale / mscale_all_dim

    @property
    def attn_factor(self) -> float:
        """What multiplies cos and sin (transformers' `attention_scaling` for yarn)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: Optional[int]
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: Optional[int] = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    torch_dtype: str = "bfloat16"
    # fp8 block quantization of the checkpoint: (block_rows, block_cols), None when not quantized
    weight_block_size: Optional[tuple[int, int]] = None
    quant_scheme: Optional[object] = None      # quant_formats.QuantScheme of the checkpoint, None if float
    source: str = ""

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token and layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        # transformers' yarn_apply_mscale: only mscale_all_dim enters the softmax scale
        s = self.qk_head_dim ** -0.5
        if self.rope.type != "default" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            s = s * m * m
        return s

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts is not None and self.n_routed_experts > 0
                and i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0)

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no config.json in the model directory") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: must hold a JSON object")
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        mt = d.get("model_type")
        if mt is None:
            archs = d.get("architectures") or []
            mt = next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)
        for fam, keys in _FAMILY_KEYS.items():
            if mt != fam and mt in SUPPORTED_MODEL_TYPES and any(k in d for k in keys):
                found = [k for k in keys if k in d]
                raise CheckpointError(f"{source}: model_type={mt!r}, but the config has {', '.join(found)}, which "
                                      f"only {fam} models have; refusing to run it as {mt}")
        if mt in _MISSING_FEATURES:
            raise CheckpointError(
                f"{source}: model_type={mt!r} is not supported yet: it needs {_MISSING_FEATURES[mt]}, which "
                f"deepinfer does not implement. deepinfer runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                f"(DeepSeek V2, V2-Lite, V2.5, V3, V3-0324, R1, V3.1)")
        if mt not in SUPPORTED_MODEL_TYPES:
            shown = mt if mt is not None else d.get("architectures")
            raise CheckpointError(
                f"{source}: unsupported architecture model_type={shown!r}; deepinfer runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")

        def need(key):
            if key not in d or d[key] is None:
                raise CheckpointError(f"{source}: missing required key {key!r}")
            return d[key]

        def num(key, default, typ=int):
            v = d.get(key, default)
            if v is None:
                return default
            try:
                return typ(v)
            except (TypeError, ValueError):
                raise CheckpointError(f"{source}: {key}={v!r} is not a number") from None

        v3 = mt == "deepseek_v3"
        n_group = num("n_group", 1) or 1
        topk_method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise CheckpointError(f"{source}: unsupported topk_method {topk_method!r}")
        scoring = d.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise CheckpointError(f"{source}: unsupported scoring_func {scoring!r}")

        rope = _parse_rope(d, source)
        q_lora = d.get("q_lora_rank")
        from .. import quant_formats as QF

        scheme = QF.parse_quantization_config(d.get("quantization_config"), f"{source}: quantization_config")
        block = scheme.block if scheme is not None and scheme.format == "fp8" else None
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        n_routed = d.get("n_routed_experts")
        cfg = cls(
            model_type=mt,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            kv_lora_rank=int(need("kv_lora_rank")),
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            moe_intermediate_size=num("moe_intermediate_size", 0),
            n_routed_experts=int(n_routed) if n_routed else None,
            n_shared_experts=num("n_shared_experts", 0) or 0,
            num_experts_per_tok=num("num_experts_per_tok", 1) or 1,
            first_k_dense_replace=num("first_k_dense_replace", 0) or 0,
            moe_layer_freq=num("moe_layer_freq", 1) or 1,
            scoring_func=scoring,
            topk_method=topk_method,
            n_group=n_group,
            topk_group=num("topk_group", 1) or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
            routed_scaling_factor=num("routed_scaling_factor", 1.0, float),
            rms_norm_eps=num("rms_norm_eps", 1e-6, float),
            rope=rope,
            # DeepSeek's own V2 and V3 code always rotates interleaved pairs; transformers' V3 has a switch
            rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
            max_position_embeddings=num("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=num("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            weight_block_size=block,
            quant_scheme=scheme,
            source=source,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        src = self.source
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise CheckpointError(f"{src}: n_routed_experts={self.n_routed_experts} is not a multiple of "
                                      f"n_group={self.n_group}")
            if self.topk_method != "greedy" and not 1 <= self.topk_group <= self.n_group:
                raise CheckpointError(f"{src}: topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise CheckpointError(f"{src}: num_experts_per_tok={self.num_experts_per_tok} out of range")
            kept = self.topk_group * (self.n_routed_experts // self.n_group)
            if self.topk_method != "greedy" and self.n_group > 1 and self.num_experts_per_tok > kept:
                # top-k would have to pick masked experts, where masking with -inf (DeepSeek, the ABI)
                # and with 0.0 (transformers' V2) give different answers: refuse the config
                raise CheckpointError(f"{src}: num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                                      f"{kept} experts of the topk_group={self.topk_group} kept groups")
            if self.moe_intermediate_size <= 0:
                raise CheckpointError(f"{src}: moe_intermediate_size must be set for a MoE model")
        if self.qk_rope_head_dim % 2:
            raise CheckpointError(f"{src}: qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank"):
            if getattr(self, k) <= 0:
                raise CheckpointError(f"{src}: {k} must be positive")


def _parse_rope(d: dict, source: str) -> RopeConfig:
    rp = d.get("rope_parameters")
    rs = d.get("rope_scaling")
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        raise CheckpointError(f"{source}: per-layer-type rope_parameters are not used by DeepSeek models")
    src = dict(rp or {})
    if isinstance(rs, dict):
        for k, v in rs.items():
            src.setdefault(k, v)
    theta = src.get("rope_theta", d.get("rope_theta", 10000.0))
    rtype = src.get("rope_type") or src.get("type") or "default"
    if rtype not in ("default", "yarn"):
        raise CheckpointError(f"{source}: unsupported rope type {rtype!r} (DeepSeek uses yarn or none)")
    r = RopeConfig(theta=float(theta), type=rtype)
    if rtype == "yarn":
        mpe = d.get("max_position_embeddings", 4096)
        orig = src.get("original_max_position_embeddings", mpe)
        factor = src.get("factor")
        if factor is None:
            factor = mpe / orig
        r.factor = float(factor)
        r.original_max_position = int(orig)
        r.beta_fast = float(src.get("beta_fast") or 32)
        r.beta_slow = float(src.get("beta_slow") or 1)
        r.mscale = src.get("mscale")
        r.mscale_all_dim = src.get("mscale_all_dim")
        r.attention_factor = src.get("attention_factor")
    return r
