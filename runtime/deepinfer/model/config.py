"""The model config: one dataclass read from a hub `config.json` of the DeepSeek V2 / V3 / V3.2 / V4
family.

Accepts the keys as DeepSeek publishes them (`rope_scaling` with `type: yarn`, `rope_theta` at the
top level, `scoring_func`, `topk_method`) and as transformers 5 saves them (`rope_parameters` with
`rope_type`). Everything the graph needs is resolved here once (softmax scale, rope attention
factor, which layers are MoE), so the graph code never re-derives it.
"""
from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import quant_formats as QF
from .. import validate as V
from ..errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4")
_ARCH_TO_TYPE = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 "DeepseekV32ForCausalLM": "deepseek_v32", "DeepseekV4ForCausalLM": "deepseek_v4"}
# Later DeepSeek families and the ops they need that deepinfer does not have yet. Running them with
# V3's dense attention would load and compute a different model, so they stop at the config.
_MISSING_FEATURES: dict = {}
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
    v4: Optional["V4Config"] = None            # DeepSeek V4's attention, hyper-connections and routing
    dsa: Optional["DSAConfig"] = None          # V3.2's sparse attention: the lightning indexer
    moe_layers: Optional[list] = None          # V3.2's mlp_layer_types as booleans (None: from first_k_dense_replace)

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

    @property
    def family(self) -> str:
        """"v4" (model.deepseek_v4) or "mla" (model.deepseek: V2, V3)."""
        return "v4" if self.v4 is not None else "mla"

    def is_moe_layer(self, i: int) -> bool:
        if self.v4 is not None:
            return True
        if self.moe_layers is not None and i < len(self.moe_layers):
            return self.moe_layers[i]
        # past mlp_layer_types (the MTP layers, which are MoE in every DeepSeek release): the V3 rule
        return (self.n_routed_experts is not None and self.n_routed_experts > 0
                and i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0)

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        path = Path(path)
        d = V.read_json(path, "config.json", err=CheckpointError, fix="fix config.json or download it again")
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: must hold a JSON object ({{...}}), not {V.json_kind(d)}; fix config.json "
                                  f"or download it again")
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: a model config is a JSON object, not {V.json_kind(d)}")
        f = _Fields(d, source)
        mt = _model_type(f)
        for fam, keys in _FAMILY_KEYS.items():
            if mt in ("deepseek_v2", "deepseek_v3") and any(k in d for k in keys):
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
                f"{source}: unsupported architecture model_type={_show(shown)}; deepinfer runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if mt == "deepseek_v4":
            return _v4_from_dict(f, d, source)

        v3 = mt in ("deepseek_v3", "deepseek_v32")   # V3.2 is V3 plus the indexer
        scheme = QF.parse_quantization_config(d.get("quantization_config"), f"{source}: quantization_config")
        block = scheme.block if scheme is not None and scheme.format == "fp8" else None
        vocab = f.integer("vocab_size", required=True)
        max_pos = f.integer("max_position_embeddings", 4096)
        # 0 routed experts is a dense model, as in transformers
        n_routed = f.integer("n_routed_experts", None, lo=0) or None
        topk = f.integer("num_experts_per_tok", None)
        if n_routed and topk is None:
            raise f.missing("num_experts_per_tok")
        topk_method = f.string("topk_method", "noaux_tc" if v3 else "greedy",
                               ("greedy", "group_limited_greedy", "noaux_tc"))
        if n_routed:
            # DeepSeek's code and transformers default these differently (routed_scaling_factor 1.0 or 2.5,
            # n_group and topk_group none or 8 and 4): a MoE config must say which model it is
            for key in ("routed_scaling_factor",) + (("n_group", "topk_group") if topk_method != "greedy" else ()):
                if d.get(key) is None:
                    raise f.missing(key)
        mtp = f.integer("num_nextn_predict_layers", None, lo=0)
        cfg = cls(
            model_type=mt,
            vocab_size=vocab,
            hidden_size=f.integer("hidden_size", required=True),
            intermediate_size=f.integer("intermediate_size", required=True),
            num_hidden_layers=f.integer("num_hidden_layers", required=True),
            num_attention_heads=f.integer("num_attention_heads", required=True),
            kv_lora_rank=f.integer("kv_lora_rank", required=True),
            # 0 and null both mean no q-LoRA (a plain q_proj), as the loader reads it
            q_lora_rank=f.integer("q_lora_rank", None, lo=0) or None,
            qk_nope_head_dim=f.integer("qk_nope_head_dim", required=True),
            qk_rope_head_dim=f.integer("qk_rope_head_dim", required=True),
            v_head_dim=f.integer("v_head_dim", required=True),
            moe_intermediate_size=f.integer("moe_intermediate_size", 0, lo=0),
            n_routed_experts=n_routed,
            n_shared_experts=f.integer("n_shared_experts", 0, lo=0),
            num_experts_per_tok=topk if topk is not None else 1,
            first_k_dense_replace=f.integer("first_k_dense_replace", 0, lo=0),
            moe_layer_freq=f.integer("moe_layer_freq", 1),
            scoring_func=f.string("scoring_func", "sigmoid" if v3 else "softmax", ("softmax", "sigmoid")),
            topk_method=topk_method,
            n_group=f.integer("n_group", 1),
            topk_group=f.integer("topk_group", 1),
            norm_topk_prob=f.boolean("norm_topk_prob", v3),
            routed_scaling_factor=f.real("routed_scaling_factor", 1.0),
            rms_norm_eps=f.real("rms_norm_eps", 1e-6),
            rope=_parse_rope(f, max_pos),
            # DeepSeek's own V2 and V3 code always rotates interleaved pairs; transformers' V3 has a switch
            rope_interleave=f.boolean("rope_interleave", True) if v3 else True,
            max_position_embeddings=max_pos,
            tie_word_embeddings=f.boolean("tie_word_embeddings", False),
            num_nextn_predict_layers=mtp if mtp is not None else f.integer("num_mtp_layers", 0, lo=0),
            bos_token_id=f.integer("bos_token_id", None, lo=0, hi=vocab - 1),
            eos_token_id=_eos(f, vocab),
            torch_dtype=f.string("torch_dtype", None) or f.string("dtype", "bfloat16"),
            weight_block_size=block,
            quant_scheme=scheme,
            source=source,
        )
        if mt == "deepseek_v32":
            cfg.dsa = DSAConfig(index_n_heads=f.integer("index_n_heads", 64), index_head_dim=f.integer("index_head_dim", 128),
                                index_topk=f.integer("index_topk", 2048))
            if cfg.dsa.index_head_dim < cfg.qk_rope_head_dim:
                raise f.bad("index_head_dim", cfg.dsa.index_head_dim, f"must be at least qk_rope_head_dim="
                            f"{cfg.qk_rope_head_dim} (the indexer rotates that many of its dims)")
            if not cfg.q_lora_rank:
                raise f.missing("q_lora_rank")   # the indexer's queries come from the q LoRA
            kinds = f.get("mlp_layer_types")
            if kinds is not None:
                if not isinstance(kinds, list) or any(k not in ("dense", "sparse") for k in kinds) or \
                        len(kinds) < cfg.num_hidden_layers:
                    raise f.bad("mlp_layer_types", kinds, f"must list dense or sparse for each of the "
                                f"{cfg.num_hidden_layers} layers")
                cfg.moe_layers = [k == "sparse" for k in kinds]
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
                raise CheckpointError(f"{src}: num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                                      f"n_routed_experts={self.n_routed_experts}]; correct it in config.json")
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


@dataclass
class DSAConfig:
    """DeepSeek V3.2's sparse attention (DSA): per layer a lightning indexer of index_n_heads heads of
    index_head_dim scores every cached token, and MLA attends to the index_topk best."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int


V4_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_V4_RATIO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass
class V4Config:
    """What DeepSeek V4 adds to ModelConfig (transformers' DeepseekV4Config, and DeepSeek's own keys:
    compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling).

    Attention: one shared KV head of head_dim D (key = value), rope on its last qk_rope_head_dim dims,
    q from q_a (LoRA) like V3, a learned sink per head, output through o_groups low-rank groups.
    layer_types[i] says what else layer i attends besides its sliding window: nothing (sliding),
    compressed entries of ratio tokens picked by the lightning indexer (CSA, overlapping windows) or
    all compressed entries (HCA)."""

    head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list
    compress_rates: dict             # layer type -> tokens per compressed entry
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: list            # "hash_moe" (routing by token id) or "moe"
    swiglu_limit: float
    rope_main: RopeConfig            # sliding layers
    rope_compress: RopeConfig        # CSA / HCA layers, their compressors and indexers

    def layer_type(self, i: int) -> str:
        """Layer i's attention; past the main layers (the MTP layer) a sliding window only, as
        DeepSeek's and SGLang's V4 MTP layers attend (compress ratio 0)."""
        return self.layer_types[i] if i < len(self.layer_types) else "sliding_attention"

    def mlp_type(self, i: int) -> str:
        """Layer i's routing; the MTP layer routes by score (it has the router's bias, no tid2eid)."""
        return self.mlp_layer_types[i] if i < len(self.mlp_layer_types) else "moe"

    def ratio(self, i: int) -> int:
        """Tokens per compressed entry of layer i, 0 for a sliding-only layer."""
        t = self.layer_type(i)
        return 0 if t == "sliding_attention" else int(self.compress_rates[t])

    def is_csa(self, i: int) -> bool:
        return self.layer_type(i) == "compressed_sparse_attention"

    def rope(self, i: int) -> RopeConfig:
        return self.rope_main if self.layer_type(i) == "sliding_attention" else self.rope_compress


def _v4_from_dict(f: "_Fields", d: dict, source: str) -> "ModelConfig":
    """A DeepSeek V4 config, as transformers saves it or in DeepSeek's own keys. Defaults follow
    transformers' DeepseekV4Config (V4-Flash), which is the executable description we match."""
    # V4-Flash writes expert_dtype beside quantization_config (QF.quantization_config_of folds it in)
    scheme = QF.parse_quantization_config(QF.quantization_config_of(d), f"{source}: quantization_config")
    block = scheme.block if scheme is not None and scheme.format == "fp8" else None
    vocab = f.integer("vocab_size", 129280)
    L = f.integer("num_hidden_layers", 43)
    D = f.integer("head_dim", 512)
    rope_dim = f.integer("qk_rope_head_dim", None)
    prf = f.real("partial_rotary_factor", None)
    Dr = rope_dim if rope_dim is not None else int(D * prf) if prf is not None else 64 * D // 512
    if not 0 < Dr <= D or Dr % 2:
        raise f.bad("qk_rope_head_dim" if rope_dim is not None else "partial_rotary_factor", rope_dim or prf,
                    f"must give an even number of rope dims in (0, head_dim={D}]")
    rates = dict(f.obj("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    for key, t in (("compress_rate_csa", "compressed_sparse_attention"), ("compress_rate_hca",
                                                                          "heavily_compressed_attention")):
        if d.get(key) is not None:
            rates[t] = f.integer(key)
    for t, r in rates.items():
        if t not in V4_LAYER_TYPES or t == "sliding_attention" or isinstance(r, bool) or not isinstance(r, int) \
                or r < 1 or r & (r - 1):
            raise f.bad("compress_rates", rates, "must map compressed_sparse_attention and "
                        "heavily_compressed_attention to powers of two")
    types = f.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        ratios = f.get("compress_ratios")
        if not isinstance(ratios, list) or any(r not in _V4_RATIO_TYPE for r in ratios):
            raise f.bad("compress_ratios", ratios, "must be a list of 0, 4 or 128 per layer")
        types = [_V4_RATIO_TYPE[r] for r in ratios]
    if types is None:   # transformers' default: two HCA layers, then CSA and HCA alternating
        types = ["heavily_compressed_attention"] * min(L, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(L - 2, 0))]
    if not isinstance(types, list) or any(t not in V4_LAYER_TYPES for t in types) or len(types) < L:
        raise f.bad("layer_types", types, f"must list one of {', '.join(V4_LAYER_TYPES)} for each of the {L} layers")
    mlp_types = f.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = f.integer("num_hash_layers", 3, lo=0)
        mlp_types = ["hash_moe"] * min(L, n_hash) + ["moe"] * max(0, L - n_hash)
    if not isinstance(mlp_types, list) or any(t not in ("hash_moe", "moe") for t in mlp_types) or len(mlp_types) < L:
        raise f.bad("mlp_layer_types", mlp_types, f"must list hash_moe or moe for each of the {L} layers")
    main_rope, comp_rope = _v4_ropes(f, d)
    n_routed = f.integer("n_routed_experts", 256)
    v4 = V4Config(
        head_dim=D, o_groups=f.integer("o_groups", 8), o_lora_rank=f.integer("o_lora_rank", 1024),
        sliding_window=f.integer("sliding_window", 128), layer_types=list(types[:L]), compress_rates=rates,
        index_n_heads=f.integer("index_n_heads", 64), index_head_dim=f.integer("index_head_dim", 128),
        index_topk=f.integer("index_topk", 512), hc_mult=f.integer("hc_mult", 4),
        hc_sinkhorn_iters=f.integer("hc_sinkhorn_iters", 20), hc_eps=f.real("hc_eps", 1e-6),
        mlp_layer_types=list(mlp_types[:L]), swiglu_limit=f.real("swiglu_limit", 10.0, allow_zero=True),
        rope_main=main_rope, rope_compress=comp_rope)
    NH = f.integer("num_attention_heads", 64)
    cfg = ModelConfig(
        model_type="deepseek_v4", vocab_size=vocab, hidden_size=f.integer("hidden_size", 4096),
        intermediate_size=0, num_hidden_layers=L, num_attention_heads=NH,
        kv_lora_rank=0, q_lora_rank=f.integer("q_lora_rank", 1024), qk_nope_head_dim=D - Dr, qk_rope_head_dim=Dr,
        v_head_dim=D, moe_intermediate_size=f.integer("moe_intermediate_size", 2048), n_routed_experts=n_routed,
        n_shared_experts=f.integer("n_shared_experts", 1, lo=0), num_experts_per_tok=f.integer("num_experts_per_tok", 6),
        scoring_func=f.string("scoring_func", "sqrtsoftplus", ("sqrtsoftplus", "softmax", "sigmoid")),
        topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=f.real("routed_scaling_factor", 1.5), rms_norm_eps=f.real("rms_norm_eps", 1e-6),
        rope=comp_rope, rope_interleave=True, max_position_embeddings=f.integer("max_position_embeddings", 1048576),
        tie_word_embeddings=f.boolean("tie_word_embeddings", False),
        # DeepSeek's `mtp.K` layers (transformers drops them; model.v4_names numbers them after the main ones)
        num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 1, lo=0),
        bos_token_id=f.integer("bos_token_id", None, lo=0, hi=vocab - 1), eos_token_id=_eos(f, vocab),
        torch_dtype=f.string("torch_dtype", None) or f.string("dtype", "bfloat16"),
        weight_block_size=block, quant_scheme=scheme, source=source, v4=v4)
    _v4_validate(cfg)
    return cfg


def _v4_ropes(f: "_Fields", d: dict) -> tuple:
    """(main, compress) rope of V4. transformers saves {"main": {...}, "compress": {...}} under
    rope_parameters; DeepSeek's keys are rope_theta, compress_rope_theta and one rope_scaling (yarn)
    that applies to the compressed layers only. transformers forces the compressed yarn's
    attention_factor to 1.0 (V4 does not scale cos/sin by YaRN's mscale)."""
    rp = f.obj("rope_parameters")
    if rp and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        ropes = []
        for k in ("main", "compress"):
            sub = _Fields(rp[k], f.source, f"rope_parameters.{k}.")
            r = _parse_rope(_Fields({"rope_parameters": {kk: vv for kk, vv in rp[k].items()
                                                         if kk != "partial_rotary_factor"}}, f.source),
                            f.integer("max_position_embeddings", 1048576))
            if r.type == "yarn" and r.attention_factor is None:
                r.attention_factor = 1.0
            if sub.get("rope_theta") is None:
                raise sub.missing("rope_theta")
            ropes.append(r)
        return tuple(ropes)
    main = RopeConfig(theta=f.real("rope_theta", 10000.0))
    flat = {k: v for k, v in (rp or f.obj("rope_scaling") or {}).items() if k != "partial_rotary_factor"}
    flat["rope_theta"] = f.real("compress_rope_theta", 160000.0)
    if "rope_type" not in flat and "type" not in flat and set(flat) - {"rope_theta"}:
        flat["rope_type"] = "yarn" if "factor" in flat else "default"
    comp = _parse_rope(_Fields({"rope_parameters": flat}, f.source), f.integer("max_position_embeddings", 1048576))
    if comp.type == "yarn" and comp.attention_factor is None:
        comp.attention_factor = 1.0
    return main, comp


def _v4_validate(c: "ModelConfig") -> None:
    v, src = c.v4, c.source
    if c.num_attention_heads % v.o_groups:
        raise CheckpointError(f"{src}: num_attention_heads={c.num_attention_heads} is not a multiple of "
                              f"o_groups={v.o_groups}")
    if c.qk_rope_head_dim > v.index_head_dim:
        raise CheckpointError(f"{src}: the indexer's index_head_dim={v.index_head_dim} is smaller than the rope "
                              f"dims ({c.qk_rope_head_dim}) it rotates")
    if not 1 <= c.num_experts_per_tok <= c.n_routed_experts:
        raise CheckpointError(f"{src}: num_experts_per_tok={c.num_experts_per_tok} must be in [1, "
                              f"n_routed_experts={c.n_routed_experts}]")
    if v.hc_mult < 1 or v.hc_sinkhorn_iters < 1:
        raise CheckpointError(f"{src}: hc_mult and hc_sinkhorn_iters must be >= 1")


def _parse_rope(f: "_Fields", max_pos: int) -> RopeConfig:
    rp, rs = f.obj("rope_parameters"), f.obj("rope_scaling")
    if rp and all(isinstance(v, dict) for v in rp.values()):
        raise CheckpointError(f"{f.source}: per-layer-type rope_parameters are not used by DeepSeek models")
    src = dict(rp or {})
    for k, v in (rs or {}).items():
        src.setdefault(k, v)
    # a merged key is named by the object(s) it may come from
    r = _Fields(src, f.source, "/".join(n for n, o in (("rope_parameters", rp), ("rope_scaling", rs)) if o) + ".")
    theta = r.real("rope_theta", None)
    key = "rope_type" if src.get("rope_type") is not None else "type"
    if src.get(key) is None and set(src) - {"rope_theta"}:
        raise r.missing("rope_type")     # scaling parameters without their type: yarn or not is a guess
    rtype = r.string(key, "default")
    if rtype not in ("default", "yarn"):
        raise r.bad(key, rtype, "is not a supported rope type (DeepSeek uses yarn or none)")
    rope = RopeConfig(theta=theta if theta is not None else f.real("rope_theta", 10000.0), type=rtype)
    if rtype == "yarn":
        orig = r.integer("original_max_position_embeddings", max_pos)
        factor = r.real("factor", None)
        rope.factor = factor if factor is not None else max_pos / orig
        rope.original_max_position = orig
        rope.beta_fast = r.real("beta_fast", 32.0)
        rope.beta_slow = r.real("beta_slow", 1.0)
        # 0 turns an mscale off, as in DeepSeek's code
        rope.mscale = r.real("mscale", None, allow_zero=True)
        rope.mscale_all_dim = r.real("mscale_all_dim", None, allow_zero=True)
        rope.attention_factor = r.real("attention_factor", None)
    return rope


def _model_type(f: "_Fields") -> Optional[str]:
    """model_type, or the family of a known `architectures` entry when it is absent."""
    mt = f.string("model_type", None)
    if mt is not None:
        return mt
    archs = f.get("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise f.bad("architectures", archs, "must be a list of class names")
    return next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)


def _eos(f: "_Fields", vocab: int) -> Optional[int]:
    """eos_token_id: one id, or the first of a list (the one generation stops at)."""
    eos = f.get("eos_token_id")
    if not isinstance(eos, list):
        return f.integer("eos_token_id", None, lo=0, hi=vocab - 1)
    ids = _Fields({"eos_token_id": eos[0] if eos else None}, f.source)
    return ids.integer("eos_token_id", None, lo=0, hi=vocab - 1)


# Backends index tensors with 32-bit ints: a size or count beyond that is a corrupt config, not a model.
_INT_MAX = 2 ** 31 - 1


def _show(v) -> str:
    """A bad value, short whatever it is (a long string, a deeply nested list)."""
    return reprlib.repr(v)


class _Fields:
    """Typed reads of one JSON object of config.json. int(), float() and bool() would accept what
    JSON says loosely (256.7 -> 256, "false" -> True, true -> 1), so every key is checked for its
    kind and range, and a bad value is a CheckpointError naming the key. null is the default."""

    def __init__(self, d: dict, source: str, prefix: str = ""):
        self.d, self.source, self.prefix = d, source, prefix

    def bad(self, key: str, v, want: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {self.prefix}{key}={_show(v)} {want}; correct it in config.json "
                               f"(the published config.json of the model has the right value)")

    def missing(self, key: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: missing required key '{self.prefix}{key}'; config.json is incomplete "
                               f"(use the one published with the model)")

    def get(self, key: str, default=None):
        v = self.d.get(key)
        return default if v is None else v

    def obj(self, key: str) -> Optional[dict]:
        v = self.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.bad(key, v, f"must be a JSON object, not {V.json_kind(v)}")
        return v

    def integer(self, key: str, default=None, lo: int = 1, hi: int = _INT_MAX, required: bool = False):
        v = self.d.get(key)
        if v is None:
            if required:
                raise self.missing(key)
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.bad(key, v, f"must be a whole number, not {V.json_kind(v)}")
        if not lo <= v <= hi:
            raise self.bad(key, v, f"must be in [{lo}, {hi}]")
        return v

    def real(self, key: str, default=None, allow_zero: bool = False):
        v = self.d.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.bad(key, v, f"must be a number, not {V.json_kind(v)}")
        try:
            x = float(v)
        except OverflowError:        # an integer too large for a float
            x = math.inf
        if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
            raise self.bad(key, v, "must be a finite number >= 0" if allow_zero else "must be a finite number > 0")
        return x

    def boolean(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self.bad(key, v, f"must be true or false, not {V.json_kind(v)}")
        return v

    def string(self, key: str, default: Optional[str], choices: Optional[tuple] = None) -> Optional[str]:
        v = self.get(key, default)
        if v is not None and not isinstance(v, str):
            raise self.bad(key, v, f"must be a string, not {V.json_kind(v)}")
        if choices is not None and v not in choices:
            raise self.bad(key, v, f"is not supported (one of {', '.join(choices)})")
        return v


