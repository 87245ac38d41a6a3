"""Typed weights of a DeepSeek V4 model and their loader (names as transformers' modules have them;
DeepSeek's own layout is renamed by model.v4_names when the checkpoint is opened).

Everything reuses WeightLoader's conversions (the precision of the quantizable linears, bf16
embeddings, f32 routers); what V4 adds: hyper-connection parameters (f32, as transformers keeps
them), attention sinks and compressor position biases (f32), the hash routers' token -> expert
tables (int32 on the device), the grouped output projection split into its groups, and the MTP
layer (DeepSeek's `mtp.0`, layer num_hidden_layers once renamed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import CheckpointError
from ..tensor import Quant, Tensor
from .weights import MoEWeights, WeightLoader


@dataclass
class HCWeights:
    """A hyper-connection's mixing projection (hc_pre): fn [M, N*H], base [M], scale [3] (or [1] for
    the head), all f32."""

    fn: Tensor
    base: Tensor
    scale: Tensor


@dataclass
class CompressorWeights:
    """V4's KV compressor: values and gate logits of every token (kv_gate: kv_proj rows then
    gate_proj rows, one linear [2W, H]; kv / gate are its halves when stacking failed), a position
    bias per window slot [ratio, W] f32, the entry's RMS norm [D]. overlap: CSA's two series per
    token (W = 2D), else W = D."""

    kv: Tensor
    gate: Tensor
    position_bias: Tensor
    norm: Tensor
    ratio: int
    overlap: bool
    kv_gate: Optional[Tensor] = None

    @property
    def width(self) -> int:
        return self.kv.shape[0]

    @property
    def out_dim(self) -> int:
        return self.width // 2 if self.overlap else self.width


@dataclass
class IndexerWeights:
    """The lightning indexer of a CSA layer: its own compressor (keys of index_head_dim), the query
    projection from the attention's q LoRA, and the per-head weights projection."""

    compressor: CompressorWeights
    q_b: Tensor            # [NI * Di, q_lora_rank]
    weights_proj: Tensor   # [NI, H]


@dataclass
class V4AttentionWeights:
    q_a: Tensor            # [q_lora_rank, H]
    q_a_norm: Tensor
    q_b: Tensor            # [NH * D, q_lora_rank]
    kv: Tensor             # [D, H]: the one shared key = value head
    kv_norm: Tensor
    o_a: list              # o_groups x [o_lora_rank, NH * D / o_groups]
    o_b: Tensor            # [H, o_groups * o_lora_rank]
    sinks: Tensor          # [NH] f32
    compressor: Optional[CompressorWeights] = None
    indexer: Optional[IndexerWeights] = None


@dataclass
class V4LayerWeights:
    index: int
    attn_hc: HCWeights
    ffn_hc: HCWeights
    ln1: Tensor
    ln2: Tensor
    attn: V4AttentionWeights
    moe: MoEWeights        # hash layers: moe.hash_table [V, K] int32


@dataclass
class V4MTPWeights:
    """V4's multi-token-prediction layer (DeepSeek's `mtp.0`, model.layers.{L} once renamed): the
    next token's embedding and the main model's last streams projected apart (e_proj, h_proj), a
    V4 block (sliding window attention, top-k MoE), its own hyper-connection head, then the
    shared head's norm and the (shared) lm_head."""

    layer: V4LayerWeights
    enorm: Tensor
    hnorm: Tensor
    e_proj: Tensor         # [H, H]
    h_proj: Tensor         # [H, H]
    hc_head: HCWeights
    head_norm: Tensor
    head: Tensor
    embed: Tensor


@dataclass
class V4ModelWeights:
    embed: Tensor
    norm: Tensor
    lm_head: Tensor
    layers: list
    hc_head: HCWeights
    ones: Tensor           # [head_dim] of 1: the unweighted RMS norm of each query head
    mtp: Optional[V4MTPWeights] = None


def row_slice(t: Tensor, lo: int, n: int, what: str) -> Tensor:
    """Rows [lo, lo + n) of a 2-D weight, quantized or not, as a view (scales sliced alike)."""
    if t.quant is None:
        return t.narrow(0, lo, n)
    q = t.quant
    br = q.block[0] or t.shape[0]
    if lo % br or n % br:
        raise CheckpointError(f"{what}: rows [{lo}, {lo + n}) do not fall on the {br}-row quantization blocks; "
                              f"load it as bf16 (precision bf16)")
    data = Tensor(t.buffer, (n, t.shape[1]), t.dtype, t.strides, t.offset + t.dtype.nbytes(lo * t.strides[0]))
    sc = q.scales.narrow(0, lo // br, n // br)
    zs = q.zeros.narrow(0, lo // br, n // br) if q.zeros is not None else None
    data.quant = Quant(sc, q.block, zs)
    return data


class V4WeightLoader(WeightLoader):
    def load(self, load_mtp: bool = False) -> V4ModelWeights:
        c = self.cfg
        self.ckpt.used.clear()
        if self.stream_experts:
            # the routed experts are read later, by the expert cache; they count as used
            self.ckpt.used.update(n for n in self.ckpt.names() if ".mlp.experts." in n)
        embed, norm, lm_head = self._embed_norm_head()
        hc_head = self._hc_head("model.hc_head.")
        layers = [self._v4_layer(i) for i in range(c.num_hidden_layers)]
        mtp = self._v4_mtp(embed, lm_head) if load_mtp else None   # the MTP head shares the stored lm_head
        if self.quantize_lm_head and lm_head.quant is None:
            lm_head = self._int8_rows(lm_head)
        ones = self.backend.upload(Tensor.from_numpy(np.ones(c.v4.head_dim, np.float32), self.dtype))
        self._check_all_used()
        return V4ModelWeights(embed=embed, norm=norm, lm_head=lm_head, layers=layers, hc_head=hc_head, ones=ones,
                              mtp=mtp)

    def _hc_head(self, p: str) -> HCWeights:
        """The hyper-connection head that collapses the streams before the final norm."""
        N, H = self.cfg.v4.hc_mult, self.cfg.hidden_size
        return HCWeights(self._f32(p + "hc_fn", (N, N * H)), self._f32(p + "hc_base", (N,)),
                         self._f32(p + "hc_scale", (1,)))

    def _v4_mtp(self, embed: Tensor, lm_head: Tensor) -> V4MTPWeights:
        H, L = self.cfg.hidden_size, self.cfg.num_hidden_layers
        p = f"model.layers.{L}."
        head, embed = self.mtp_head_embed(p, embed, lm_head)
        return V4MTPWeights(
            layer=self._v4_layer(L), enorm=self._t(p + "enorm.weight", (H,)), hnorm=self._t(p + "hnorm.weight", (H,)),
            e_proj=self._w(p + "e_proj.weight", (H, H)), h_proj=self._w(p + "h_proj.weight", (H, H)),
            hc_head=self._hc_head(p + "hc_head."), head_norm=self._t(p + "shared_head.norm.weight", (H,)),
            head=head, embed=embed)

    def _f32(self, name, shape) -> Tensor:
        return self._t(name, shape, "f32")

    def _hc(self, p: str) -> HCWeights:
        c, N = self.cfg, self.cfg.v4.hc_mult
        M = (2 + N) * N
        return HCWeights(self._f32(p + "fn", (M, N * c.hidden_size)), self._f32(p + "base", (M,)),
                         self._f32(p + "scale", (3,)))

    def _compressor(self, p: str, D: int, ratio: int, overlap: bool) -> CompressorWeights:
        H, W = self.cfg.hidden_size, (2 if overlap else 1) * D
        kv, gate = self._w(p + "kv_proj.weight", (W, H)), self._w(p + "gate_proj.weight", (W, H))
        cw = CompressorWeights(kv=kv, gate=gate, position_bias=self._f32(p + "position_bias", (ratio, W)),
                               norm=self._t(p + "kv_norm.weight", (D,)), ratio=ratio, overlap=overlap)
        fused = self.stack_rows(kv, gate)
        if fused is not None:
            cw.kv_gate, cw.kv, cw.gate = fused
        return cw

    def _v4_attention(self, i: int, a: str) -> V4AttentionWeights:
        c, H, NH, v = self.cfg, self.cfg.hidden_size, self.cfg.num_attention_heads, self.cfg.v4
        D, R, G = v.head_dim, v.o_lora_rank, v.o_groups
        o_a = self._w(a + "o_a_proj.weight", (G * R, NH * D // G))
        w = V4AttentionWeights(
            q_a=self._w(a + "q_a_proj.weight", (c.q_lora_rank, H)),
            q_a_norm=self._t(a + "q_a_norm.weight", (c.q_lora_rank,)),
            q_b=self._w(a + "q_b_proj.weight", (NH * D, c.q_lora_rank)),
            kv=self._w(a + "kv_proj.weight", (D, H)),
            kv_norm=self._t(a + "kv_norm.weight", (D,)),
            o_a=[row_slice(o_a, g * R, R, a + "o_a_proj.weight") for g in range(G)],
            o_b=self._w(a + "o_b_proj.weight", (H, G * R)),
            sinks=self._f32(a + "sinks", (NH,)))
        ratio = v.ratio(i)
        if ratio:
            p = a + "compressor."
            w.compressor = self._compressor(p, D, ratio, overlap=v.is_csa(i))
            if v.is_csa(i):
                ip = p + "indexer."
                w.indexer = IndexerWeights(
                    compressor=self._compressor(ip, v.index_head_dim, ratio, overlap=True),
                    q_b=self._w(ip + "q_b_proj.weight", (v.index_n_heads * v.index_head_dim, c.q_lora_rank)),
                    # transformers keeps the indexer's weights projection in f32; its output is f32 too
                    weights_proj=self._router_weight(ip + "scorer.weights_proj.weight", (v.index_n_heads, H)))
        return w

    def _v4_moe(self, i: int, m: str) -> MoEWeights:
        c, H = self.cfg, self.cfg.hidden_size
        E, I = c.n_routed_experts, c.moe_intermediate_size
        hashed = c.v4.mlp_type(i) == "hash_moe"
        table = None
        if hashed:
            t = self.ckpt.array(m + "gate.tid2eid", (c.vocab_size, c.num_experts_per_tok))
            ids = np.asarray(t)
            if ids.dtype.kind not in "iu":
                raise CheckpointError(f"{self.ckpt.file_of(m + 'gate.tid2eid')}: tid2eid has dtype {ids.dtype}; "
                                      f"expected integer expert ids")
            if ids.size and (ids.min() < 0 or ids.max() >= E):
                raise CheckpointError(f"{self.ckpt.file_of(m + 'gate.tid2eid')}: tid2eid holds expert ids outside "
                                      f"[0, {E}); the checkpoint is damaged or belongs to another config")
            table = self.backend.upload(Tensor.from_numpy(np.ascontiguousarray(ids, np.int32)))
        bias_name = m + "gate.e_score_correction_bias"
        stream = self.stream_experts      # the routed experts load on demand (model.expert_cache)
        if stream:
            self.check_streamed_experts(m)
        return MoEWeights(
            prefix=m,
            gate=self._router_weight(m + "gate.weight", (E, H)),
            gate_bias=None if hashed else self._t(bias_name, (E,), "f32"),
            experts_gate=None if stream else [self._w(f"{m}experts.{e}.gate_proj.weight", (I, H)) for e in range(E)],
            experts_up=None if stream else [self._w(f"{m}experts.{e}.up_proj.weight", (I, H)) for e in range(E)],
            experts_down=None if stream else [self._w(f"{m}experts.{e}.down_proj.weight", (H, I)) for e in range(E)],
            shared=self._mlp(m + "shared_experts.", I * c.n_shared_experts) if c.n_shared_experts else None,
            hash_table=table)

    def _v4_layer(self, i: int) -> V4LayerWeights:
        H = self.cfg.hidden_size
        p = f"model.layers.{i}."
        return V4LayerWeights(
            index=i, attn_hc=self._hc(p + "attn_hc."), ffn_hc=self._hc(p + "ffn_hc."),
            ln1=self._t(p + "input_layernorm.weight", (H,)), ln2=self._t(p + "post_attention_layernorm.weight", (H,)),
            attn=self._v4_attention(i, p + "self_attn."), moe=self._v4_moe(i, p + "mlp."))
