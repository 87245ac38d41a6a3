"""The 1.3 reference ops against transformers' DeepSeek V4 and V3.2 modules.

Each test builds a small module from transformers (random weights, float64) or transcribes the few
lines of a module's forward that have no module of their own (the decoder layer's hyper-connection
mixing, the attention mask of V4's compressors), runs it, and composes the reference ops the way the
runtime does (kv_compress -> rmsnorm -> rope; indexer_topk; sparse_attention; ...) on f32 copies of
the same inputs. They agree to f32 rounding. Every output starts as NaN and the inputs are random,
so an op that leaves something unwritten, reads the wrong cache row or drops a term fails.
"""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers.models.deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as V4  # noqa: E402

from deepinfer.reference import ReferenceBackend  # noqa: E402
from deepinfer.tensor import Tensor  # noqa: E402

ref = ReferenceBackend()
F32_RTOL = 2e-5     # a chain of a few f32 roundings (the transformers modules run in float64)


def cfg_v4(**kw) -> DeepseekV4Config:
    base = dict(vocab_size=50, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                head_dim=16, partial_rotary_factor=0.5, q_lora_rank=24, num_experts_per_tok=3, n_routed_experts=8,
                hc_mult=4, hc_sinkhorn_iters=20, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=4,
                index_head_dim=16, index_topk=5, swiglu_limit=0.6,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    base.update(kw)
    c = DeepseekV4Config(**base)
    c._experts_implementation = "eager"
    return c


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """float64 parameters of unit-ish scale (matrices scaled by 1/sqrt(fan-in))."""
    g = torch.Generator().manual_seed(seed)
    module.double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            v = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.ndim >= 2:
                v /= p.shape[-1] ** 0.5
            p.copy_(v)
    return module


def f32(a) -> Tensor:
    if isinstance(a, torch.Tensor):
        a = a.detach().numpy()
    return Tensor.from_numpy(np.ascontiguousarray(np.asarray(a, np.float64).astype(np.float32)))


def bf16(a) -> Tensor:
    if isinstance(a, torch.Tensor):
        a = a.detach().numpy()
    return Tensor.from_numpy(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16))


def i32(a) -> Tensor:
    return Tensor.from_numpy(np.asarray(a, np.int32))


def empty(shape, dtype="f32") -> Tensor:
    return Tensor.empty(shape, dtype, fill=np.nan)   # poison: an element left unwritten fails


def np64(t) -> np.ndarray:
    if isinstance(t, Tensor):
        return np.asarray(t.numpy(), np.float64)
    if isinstance(t, torch.Tensor):
        return t.detach().double().numpy()
    return np.asarray(t, np.float64)


def close(got, want, rtol=F32_RTOL, atol=None):
    got, want = np64(got), np64(want)
    assert not np.isnan(got).any(), "NaN in the reference's output (an element was never written?)"
    atol = rtol * max(float(np.sqrt(np.mean(want ** 2))), 1e-30) if atol is None else atol
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- paged layouts


def paged_rows(rows: np.ndarray, BS: int, rng, spare: int = 2):
    """One sequence's per-position rows [L, D] in a paged cache: (cache [NB, BS, D] f32 with NaN in
    every row the sequence does not own, block_table [1, MB] of scattered block ids)."""
    L, D = rows.shape
    MB = max(1, -(-L // BS))
    NB = MB + spare
    table = rng.permutation(NB)[:MB]
    cache = np.full((NB, BS, D), np.nan, np.float32)
    for p in range(L):
        cache[table[p // BS], p % BS] = rows[p]
    return cache, table[None, :]


def entry_cache(entries: np.ndarray, table: np.ndarray, ratio: int, BS: int) -> np.ndarray:
    """Compressed entries [n, D] at their slots (README: the block of the window's last token)."""
    n, D = entries.shape
    CB = max(1, BS // ratio)
    cache = np.full((table.max() + 1, CB, D), np.nan, np.float32)
    for e in range(n):
        pe = (e + 1) * ratio - 1
        cache[table[0, pe // BS], (pe % BS) // ratio] = entries[e]
    return cache


def rope_tail(x: Tensor, positions, rd: int, theta: float) -> None:
    """V4's partial rope in place: the trailing rd channels, interleaved pairs (the reference's rope on
    a column view of x, out = x)."""
    view = x.narrow(x.ndim - 1, x.shape[-1] - rd, rd)
    ref.rope(x=view, positions=i32(positions), out=view, interleaved=1, scaling=0, theta=theta, factor=1.0,
             original_max_position=0, beta_fast=0.0, beta_slow=0.0, attn_factor=1.0)


# ---------------------------------------------------------------------------- hyper-connections


@pytest.mark.parametrize("N,iters,dtype,hc_eps", [(4, 20, "f32", 1e-6), (2, 1, "f32", 0.1), (1, 3, "f32", 1e-6),
                                                   (4, 20, "bf16", 1e-6), (4, 5, "f32", 0.05)])
def test_hc_pre_is_the_hyper_connection(N, iters, dtype, hc_eps):
    """hc_eps as large as 0.1 too: at V4's 1e-6 its terms are below f32 resolution."""
    cfg = cfg_v4(hc_mult=N, hc_sinkhorn_iters=iters, hc_eps=hc_eps)
    hc = randomize(V4.DeepseekV4HyperConnection(cfg), seed=N)
    with torch.no_grad():
        hc.scale.copy_(torch.tensor([0.7, 1.3, 1.9]))
    rng = np.random.default_rng(N + iters)
    T, H = 5, cfg.hidden_size
    x = rng.standard_normal((T, N, H)).astype(np.float32)
    xt = f32(x) if dtype == "f32" else bf16(x)
    post, comb, collapsed = hc(torch.from_numpy(np64(xt))[None])
    out, p, c = empty((T, H), dtype), empty((T, N)), empty((T, N, N))
    ref.hc_pre(x=xt, fn=f32(hc.fn), base=f32(hc.base), scale=f32(hc.scale), out=out, post=p, comb=c,
               eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=iters)
    close(p, post[0])
    close(c, comb[0])
    if dtype == "f32":
        close(out, collapsed[0])
    else:   # one rounding to bf16 of the same f32-exact sum: at most one bf16 step apart
        close(out, collapsed[0], rtol=2 ** -7)
    # the mixing weights are what Sinkhorn promises: rows and columns sum to about 1
    np.testing.assert_allclose(np64(c).sum(axis=-2), 1.0, atol=1e-5 + 2 * N * hc_eps)


def test_hc_pre_head_is_the_hyper_head():
    cfg = cfg_v4(hc_eps=0.1)
    head = randomize(V4.DeepseekV4HyperHead(cfg), seed=7)
    rng = np.random.default_rng(7)
    T, N, H = 4, cfg.hc_mult, cfg.hidden_size
    x = rng.standard_normal((T, N, H))
    want = head(torch.from_numpy(np64(f32(x)))[None])[0]
    out = empty((T, H))
    ref.hc_pre(x=f32(x), fn=f32(head.hc_fn), base=f32(head.hc_base), scale=f32(head.hc_scale), out=out,
               eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    close(out, want)


def test_hc_pre_then_hc_post_is_the_decoder_layers_mixing():
    """DeepseekV4DecoderLayer: post, comb, collapsed = hc(streams); y = block(collapsed);
    streams = post * y + comb^T @ streams (the layer's own two lines, transcribed)."""
    cfg = cfg_v4()
    hc = randomize(V4.DeepseekV4HyperConnection(cfg), seed=11)
    rng = np.random.default_rng(11)
    T, N, H = 6, cfg.hc_mult, cfg.hidden_size
    x = f32(rng.standard_normal((T, N, H)))
    block = rng.standard_normal((H, H)) / np.sqrt(H)          # stands in for attention or the MLP
    streams = torch.from_numpy(np64(x))[None]
    post, comb, collapsed = hc(streams)
    y = collapsed @ torch.from_numpy(block).T
    want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)

    out, p, c = empty((T, H)), empty((T, N)), empty((T, N, N))
    ref.hc_pre(x=x, fn=f32(hc.fn), base=f32(hc.base), scale=f32(hc.scale), out=out, post=p, comb=c,
               eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    yb = empty((T, H))
    ref.linear(x=out, w=f32(block), out=yb)
    mixed = empty((T, N, H))
    ref.hc_post(x=x, y=yb, post=p, comb=c, out=mixed)
    close(mixed, want[0])
    # comb is applied transposed: the plain product is a different (wrong) answer
    wrong = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb, streams)
    assert not np.allclose(np64(mixed), np64(wrong[0]), rtol=1e-3)


def test_hc_post_refuses_an_output_overlapping_x():
    x = f32(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="out overlaps x"):
        ref.hc_post(x=x, y=f32(np.ones((2, 4))), post=f32(np.ones((2, 3))), comb=f32(np.ones((2, 3, 3))), out=x)


# ---------------------------------------------------------------------------- compressors


def _compress_chain(kv, gate, position_bias, norm_weight, ratio, overlap, BS, rd, theta, eps, rng, dtype="f32"):
    """The runtime's composition for a compressor: stage (kv, gate) per token in a paged cache, then
    kv_compress at every position, rmsnorm and rope of the closing rows. Returns (entries, out)."""
    staged_rows = np.concatenate([np64(kv)[0], np64(gate)[0]], axis=-1)          # [S, 2W]
    S = staged_rows.shape[0]
    cache, table = paged_rows(staged_rows, BS, rng)
    staged = f32(cache) if dtype == "f32" else bf16(cache)
    W = staged_rows.shape[1] // 2
    D = W // 2 if overlap else W
    out = empty((S, D), dtype)
    ref.kv_compress(staged=staged, position_bias=f32(position_bias), block_table=i32(table),
                    token_seq=i32(np.zeros(S)), positions=i32(np.arange(S)), out=out, ratio=ratio, overlap=overlap)
    got = np64(out)
    closing = np.arange(ratio - 1, S, ratio)
    others = np.setdiff1d(np.arange(S), closing)
    assert np.all(got[others] == 0), "rows that close no window must be zero"
    n = len(closing)
    normed = empty((n, D))
    ref.rmsnorm(x=f32(got[closing]), weight=f32(norm_weight), out=normed, eps=eps)
    rope_tail(normed, np.arange(n) * ratio, rd, theta)
    return np64(normed), table


@pytest.mark.parametrize("BS", [2, 16])
def test_kv_compress_is_the_hca_compressor(BS):
    cfg = cfg_v4()
    comp = randomize(V4.DeepseekV4HCACompressor(cfg), seed=BS)
    ratio = cfg.compress_rates["heavily_compressed_attention"]
    S = 3 * ratio + 5
    h = torch.from_numpy(np.random.default_rng(BS).standard_normal((1, S, cfg.hidden_size)))
    want, _ = comp(h, None, torch.arange(S)[None], None, 0)                     # [1, 1, n, head_dim]
    got, _ = _compress_chain(comp.kv_proj(h), comp.gate_proj(h), comp.position_bias, comp.kv_norm.weight, ratio, 0,
                             BS, cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rms_norm_eps,
                             np.random.default_rng(1))
    assert got.shape == want.shape[2:] == (3, cfg.head_dim)
    close(got, want[0, 0])


@pytest.mark.parametrize("BS", [2, 8])
def test_kv_compress_overlap_is_the_csa_compressor(BS):
    """CSA pools the first halves of window w - 1 with the second halves of window w; window 0 has no
    previous window (those slots are absent: weight 0, not a zero value with weight)."""
    cfg = cfg_v4()
    comp = randomize(V4.DeepseekV4CSACompressor(cfg), seed=20 + BS)
    ratio = cfg.compress_rates["compressed_sparse_attention"]
    S = 4 * ratio + 3
    rng = np.random.default_rng(BS)
    h = torch.from_numpy(rng.standard_normal((1, S, cfg.hidden_size)))
    q_res = torch.from_numpy(rng.standard_normal((1, S, cfg.q_lora_rank)))
    want, _ = comp(h, q_res, torch.arange(S)[None], None, 0)
    got, _ = _compress_chain(comp.kv_proj(h), comp.gate_proj(h), comp.position_bias, comp.kv_norm.weight, ratio, 1,
                             BS, cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rms_norm_eps,
                             np.random.default_rng(2))
    close(got, want[0, 0])


def test_kv_compress_in_bf16_rounds_once():
    cfg = cfg_v4()
    comp = randomize(V4.DeepseekV4HCACompressor(cfg), seed=3)
    ratio = cfg.compress_rates["heavily_compressed_attention"]
    S = 2 * ratio
    h = torch.from_numpy(np.random.default_rng(3).standard_normal((1, S, cfg.hidden_size)))
    kv, gate = comp.kv_proj(h), comp.gate_proj(h)
    # the module on the bf16 values the staged cache holds, in float64
    kvb = torch.from_numpy(np64(bf16(kv)))
    gb = torch.from_numpy(np64(bf16(gate)))
    win = kvb.view(1, 2, ratio, -1) * (gb.view(1, 2, ratio, -1) + comp.position_bias).softmax(dim=2)
    want = np64(bf16(win.sum(dim=2)[0]))
    staged_rows = np.concatenate([np64(kvb)[0], np64(gb)[0]], axis=-1)
    cache, table = paged_rows(staged_rows, 4, np.random.default_rng(0))
    out = empty((S, cfg.head_dim), "bf16")
    ref.kv_compress(staged=bf16(cache), position_bias=f32(comp.position_bias), block_table=i32(table),
                    token_seq=i32(np.zeros(S)), positions=i32(np.arange(S)), out=out, ratio=ratio, overlap=0)
    got = np64(out)[[ratio - 1, 2 * ratio - 1]]
    assert np.array_equal(got, want) or np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()


# ---------------------------------------------------------------------------- the lightning indexer


@pytest.mark.parametrize("BS", [2, 16])
def test_indexer_topk_is_the_v4_indexer(BS):
    """DeepseekV4Indexer (cache=None): its compressor (kv_compress overlap 1, rmsnorm, rope), the query
    (q_b_proj, rope at the token's position), the scorer's weights, then top-k over the entries each
    query may see; -1 where fewer are visible than index_topk."""
    cfg = cfg_v4(index_topk=3)
    ix = randomize(V4.DeepseekV4Indexer(cfg), seed=30 + BS)
    ratio = ix.compress_rate
    S = 7 * ratio + 2
    rng = np.random.default_rng(BS)
    h = torch.from_numpy(rng.standard_normal((1, S, cfg.hidden_size)))
    q_res = torch.from_numpy(rng.standard_normal((1, S, cfg.q_lora_rank)))
    want = ix(h, q_res, torch.arange(S)[None], None, 0)[0].numpy()             # [S, k]
    rd, theta = cfg.qk_rope_head_dim, cfg.compress_rope_theta
    keys, _ = _compress_chain(ix.kv_proj(h), ix.gate_proj(h), ix.position_bias, ix.kv_norm.weight, ratio, 1, BS, rd,
                              theta, cfg.rms_norm_eps, np.random.default_rng(3))
    _, table = paged_rows(np.zeros((S, 1)), BS, np.random.default_rng(3))    # the same table as the chain's
    kc = entry_cache(keys, table, ratio, BS)
    NI, Di = ix.num_heads, ix.head_dim
    q = f32(ix.q_b_proj(q_res)[0].reshape(S, NI, Di))
    rope_tail(q, np.arange(S), rd, theta)
    weights = f32(ix.scorer.weights_proj(h)[0] * ix.scorer.weights_scaling)
    K = 5                                                    # more than index_topk: -1 past min(K, visible)
    out = Tensor.empty((S, K), "int32", fill=0x7F7F7F7F)
    ref.indexer_topk(q=q, weights=weights, keys=f32(kc), block_table=i32(table), token_seq=i32(np.zeros(S)),
                     kv_len=i32(np.arange(1, S + 1)), out=out, scale=ix.scorer.softmax_scale, ratio=ratio,
                     block_size=BS)
    got = out.numpy()
    for t in range(S):
        visible = (t + 1) // ratio
        assert np.all(got[t, min(K, visible):] == -1), (t, got[t])
        # transformers keeps index_topk; ours K >= that: the first index_topk are the same entries
        # (descending scores, no ties among random values)
        k = min(cfg.index_topk, visible)
        assert sorted(got[t, :k].tolist()) == sorted(want[t][want[t] >= 0].tolist()), (t, got[t], want[t])
        assert got[t, :k].tolist() == want[t, :k].tolist()   # both in descending score order


# ---------------------------------------------------------------------------- V4 attention


def _v4_attention(kind: str, window: int, sinks: bool, BS: int, seed: int):
    cfg = cfg_v4(sliding_window=window or 10**6)
    rng = np.random.default_rng(seed)
    layer = {"hca": "heavily_compressed_attention", "csa": "compressed_sparse_attention"}.get(kind)
    S, NH, D = 21, cfg.num_attention_heads, cfg.head_dim
    h = torch.from_numpy(rng.standard_normal((1, S, cfg.hidden_size)))
    q_res = torch.from_numpy(rng.standard_normal((1, S, cfg.q_lora_rank)))
    pos = torch.arange(S)[None]
    q = torch.from_numpy(rng.standard_normal((1, NH, S, D)))
    kv = torch.from_numpy(rng.standard_normal((1, 1, S, D)))
    # V4's sliding-window causal mask: key j is visible to query i when i - window < j <= i
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & (j > i - window) if window else (j <= i)
    mask = torch.zeros(S, S, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]
    keys, idx, ratio = kv, None, 0
    if layer:
        comp = randomize(V4.COMPRESSOR_CLASSES[layer](cfg), seed=seed)
        ratio = comp.compress_rate
        compressed, block_bias = comp(h, q_res, pos, None, 0)
        keys = torch.cat([kv, compressed], dim=2)
        mask = torch.cat([mask, block_bias], dim=-1)
        if kind == "csa":
            idx = comp.indexer(h, q_res, pos, None, 0)[0].numpy()
    sink = torch.from_numpy(rng.standard_normal(NH) * 2) if sinks else torch.full((NH,), float("-inf"),
                                                                                   dtype=torch.float64)
    module = SimpleNamespace(num_key_value_groups=NH, sinks=sink, training=False)
    want, _ = V4.eager_attention_forward(module, q, keys, keys, mask, scaling=D ** -0.5)   # [1, S, NH, D]

    cache, table = paged_rows(np64(kv)[0, 0], BS, rng)
    args = dict(q=f32(np64(q)[0].transpose(1, 0, 2)), kv_cache=f32(cache), block_table=i32(table),
                token_seq=i32(np.zeros(S)), kv_len=i32(np.arange(1, S + 1)), scale=D ** -0.5, window=window,
                ratio=ratio)
    if layer:
        args["comp_cache"] = f32(entry_cache(np64(compressed)[0, 0], table, ratio, BS))
    if idx is not None:
        args["indices"] = i32(idx)
    if sinks:
        args["sinks"] = f32(sink)
    out = empty((S, NH, D))
    ref.sparse_attention(out=out, **args)
    close(out, want[0])
    if idx is not None:
        # the spec's safety rules (transformers' indexer never produces these): entries not yet visible,
        # past the cache or listed twice change nothing
        visible = np.arange(1, S + 1) // ratio
        extra = np.stack([visible, visible + 3, np.full(S, 10**6), idx[:, 0], np.full(S, -7)], axis=1)
        again = empty((S, NH, D))
        ref.sparse_attention(out=again, **{**args, "indices": i32(np.concatenate([idx, extra], axis=1))})
        np.testing.assert_array_equal(np64(again), np64(out))


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("sinks", [True, False])
def test_sparse_attention_is_sliding_window_attention_with_sinks(window, sinks):
    _v4_attention("sliding", window, sinks, BS=4, seed=40 + window)


@pytest.mark.parametrize("BS", [4, 16])
def test_sparse_attention_is_hca_attention(BS):
    """Every visible compressed entry (e < kv_len / ratio) joins the window's keys."""
    _v4_attention("hca", 6, True, BS=BS, seed=50 + BS)


@pytest.mark.parametrize("BS", [2, 8])
def test_sparse_attention_is_csa_attention(BS):
    """Only the indexer's entries join (its -1 entries skipped), as the CSA compressor's block bias says."""
    _v4_attention("csa", 6, True, BS=BS, seed=60 + BS)


def test_rope_at_minus_p_undoes_v4s_output_rotation():
    """V4 rotates its attention output back with apply_rotary_pos_emb(o, cos, -sin): rope at -p."""
    cfg = cfg_v4()
    rot = V4.DeepseekV4RotaryEmbedding(cfg)
    rng = np.random.default_rng(8)
    T, NH, rd = 6, 3, cfg.qk_rope_head_dim
    x = rng.standard_normal((1, T, NH, rd))
    pos = torch.tensor([[0, 1, 5, 17, 300, 4095]])
    cos, sin = rot(torch.from_numpy(x), pos, layer_type="main")
    want = V4.apply_rotary_pos_emb(torch.from_numpy(x), cos, -sin, unsqueeze_dim=2)
    got = f32(x[0])
    ref.rope(x=got, positions=i32(-pos[0].numpy()), out=got, interleaved=1, scaling=0, theta=cfg.rope_theta,
             factor=1.0, original_max_position=0, beta_fast=0.0, beta_slow=0.0, attn_factor=1.0)
    close(got, want[0], rtol=1e-5, atol=5e-6)       # transformers' angles are f32: pos * 2^-24 radians


# ---------------------------------------------------------------------------- routing and experts


def test_moe_router_sqrtsoftplus_is_the_v4_topk_router():
    cfg = cfg_v4()
    router = randomize(V4.DeepseekV4TopKRouter(cfg), seed=70)
    rng = np.random.default_rng(70)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.from_numpy(rng.standard_normal(cfg.n_routed_experts) * 0.3))
    T, K, E = 9, cfg.num_experts_per_tok, cfg.n_routed_experts
    h = torch.from_numpy(rng.standard_normal((T, cfg.hidden_size)) * 20)    # logits past softplus's threshold too
    logits, weights, ids = router(h)
    got_ids, got_w = Tensor.empty((T, K), "int32", fill=-1), empty((T, K))
    ref.moe_router(logits=f32(logits), bias=f32(router.e_score_correction_bias), topk_ids=got_ids,
                   topk_weights=got_w, scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                   routed_scaling_factor=cfg.routed_scaling_factor)
    gi = got_ids.numpy()
    for t in range(T):   # transformers' top-k is unsorted: compare by expert
        assert sorted(gi[t].tolist()) == sorted(ids[t].tolist())
        want = dict(zip(ids[t].tolist(), np64(weights[t])))
        close(np64(got_w)[t], np.array([want[e] for e in gi[t]]), rtol=1e-5)
    assert np64(logits).max() > 20


def test_moe_router_hash_is_the_v4_hash_router():
    cfg = cfg_v4()
    router = randomize(V4.DeepseekV4HashRouter(cfg), seed=71)
    rng = np.random.default_rng(71)
    E, K, V = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size
    table = np.stack([rng.permutation(E)[:K] for _ in range(V)])
    with torch.no_grad():
        router.tid2eid.copy_(torch.from_numpy(table))
    T = 8
    h = torch.from_numpy(rng.standard_normal((T, cfg.hidden_size)))
    tok = rng.integers(0, V, T)
    logits, weights, ids = router(h, torch.from_numpy(tok))
    got_ids, got_w = Tensor.empty((T, K), "int32", fill=-1), empty((T, K))
    # a correction bias is passed, as the model has one: hash routing must not use it
    ref.moe_router(logits=f32(logits), bias=f32(rng.standard_normal(E) * 5), topk_ids=got_ids, topk_weights=got_w,
                   scoring=2, n_group=1, topk_group=1, group_score=0, norm_topk_prob=1,
                   routed_scaling_factor=cfg.routed_scaling_factor, token_ids=i32(tok), hash_table=i32(table))
    np.testing.assert_array_equal(got_ids.numpy(), ids.numpy())                # table order, exactly
    close(got_w, weights, rtol=1e-5)
    with pytest.raises(ValueError, match="token_ids and hash_table together"):
        ref.moe_router(logits=f32(logits), topk_ids=got_ids, topk_weights=got_w, scoring=2, token_ids=i32(tok))
    bad = table.copy()
    bad[tok[3], 1] = E
    with pytest.raises(ValueError, match=r"hash_table\[.*is not an expert"):
        ref.moe_router(logits=f32(logits), topk_ids=got_ids, topk_weights=got_w, scoring=2, token_ids=i32(tok),
                       hash_table=i32(bad))


def test_moe_experts_swiglu_limit_is_the_v4_experts():
    cfg = cfg_v4(swiglu_limit=0.6)
    experts = randomize(V4.DeepseekV4Experts(cfg), seed=72)
    rng = np.random.default_rng(72)
    T, K, E, H, I = 7, 3, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.from_numpy(rng.standard_normal((T, H)) * 2)
    ids = np.stack([rng.permutation(E + 1)[:K] for _ in range(T)])            # E: transformers' "no expert"
    w = rng.uniform(0.1, 1.0, (T, K))
    want = experts(x, torch.from_numpy(ids), torch.from_numpy(w))
    gu, down = np64(experts.gate_up_proj), np64(experts.down_proj)
    out = empty((T, H))
    ref.moe_experts(x=f32(x), topk_ids=i32(ids), topk_weights=f32(w), num_experts=E, accumulate=0,
                    w_gate=[f32(gu[e, :I]) for e in range(E)], w_up=[f32(gu[e, I:]) for e in range(E)],
                    w_down=[f32(down[e]) for e in range(E)], out=out, swiglu_limit=cfg.swiglu_limit)
    close(out, want)
    unclipped = empty((T, H))
    ref.moe_experts(x=f32(x), topk_ids=i32(ids), topk_weights=f32(w), num_experts=E, accumulate=0,
                    w_gate=[f32(gu[e, :I]) for e in range(E)], w_up=[f32(gu[e, I:]) for e in range(E)],
                    w_down=[f32(down[e]) for e in range(E)], out=unclipped)
    assert not np.allclose(np64(unclipped), np64(want), rtol=1e-2), "the limit must matter at this scale"


def test_silu_mul_limit_is_the_v4_mlp():
    cfg = cfg_v4(swiglu_limit=0.8)
    mlp = randomize(V4.DeepseekV4MLP(cfg), seed=73)
    x = torch.from_numpy(np.random.default_rng(73).standard_normal((6, cfg.hidden_size)) * 3)
    want = mlp(x)
    T, I = 6, cfg.moe_intermediate_size
    g, u, hmid, out = empty((T, I)), empty((T, I)), empty((T, I)), empty((T, cfg.hidden_size))
    ref.linear(x=f32(x), w=f32(mlp.gate_proj.weight), out=g)
    ref.linear(x=f32(x), w=f32(mlp.up_proj.weight), out=u)
    ref.silu_mul(gate=g, up=u, out=hmid, limit=cfg.swiglu_limit)
    ref.linear(x=hmid, w=f32(mlp.down_proj.weight), out=out)
    close(out, want)
    with pytest.raises(ValueError, match="limit"):
        ref.silu_mul(gate=g, up=u, out=hmid, limit=-1.0)


# ---------------------------------------------------------------------------- V3.2: layernorm, DSA


def _v32():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as V32

    cfg = DeepseekV32Config(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                            index_n_heads=16, index_head_dim=16, index_topk=4, rope_parameters={
                                "rope_type": "default", "rope_theta": 10000.0})
    return cfg, V32


def test_layernorm_is_the_v32_indexers_k_norm():
    cfg, V32 = _v32()
    ix = randomize(V32.DeepseekV32Indexer(cfg, 0), seed=80)
    rng = np.random.default_rng(80)
    for offset in (0.0, 6.0):   # a mean far from zero: the variance is of the centred values
        x = torch.from_numpy(rng.standard_normal((5, cfg.index_head_dim)) + offset)
        want = ix.k_norm(x)
        out = empty((5, cfg.index_head_dim))
        ref.layernorm(x=f32(x), weight=f32(ix.k_norm.weight), bias=f32(ix.k_norm.bias), out=out, eps=ix.k_norm.eps)
        close(out, want)
    nobias = empty((5, cfg.index_head_dim))
    ref.layernorm(x=f32(x), weight=f32(ix.k_norm.weight), out=nobias, eps=1e-6)
    close(nobias, F.layer_norm(x, (cfg.index_head_dim,), ix.k_norm.weight, None, 1e-6))


def test_v32_sparse_attention_is_the_indexer_then_masked_mla():
    """DeepseekV32Indexer (its keys: layernorm and half-split rope of the first qk_rope_head_dim
    channels) is indexer_topk with ratio 1; its raw top-k (which holds future positions where fewer
    are visible than index_topk) goes straight into mla_decode's indices, which skips them, as the
    causal mask does in transformers' eager attention."""
    cfg, V32 = _v32()
    ix = randomize(V32.DeepseekV32Indexer(cfg, 0), seed=81)
    rng = np.random.default_rng(81)
    S, H = 10, cfg.hidden_size
    h = torch.from_numpy(rng.standard_normal((1, S, H)))
    q_res = torch.from_numpy(rng.standard_normal((1, S, cfg.q_lora_rank)))
    pos = torch.arange(S)[None]
    cos, sin = V32.DeepseekV32RotaryEmbedding(cfg)(h, pos)
    causal = (torch.arange(S)[None, :] <= torch.arange(S)[:, None])[None]
    topk = ix(h, q_res, (cos, sin), causal, pos).numpy()[0]                     # [S, index_topk]

    rd, NI, Di, BS = cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim, 4
    theta = cfg.rope_parameters["rope_theta"]
    k = empty((S, Di))
    ref.layernorm(x=f32(ix.wk(h)[0]), weight=f32(ix.k_norm.weight), bias=f32(ix.k_norm.bias), out=k,
                  eps=ix.k_norm.eps)
    q = f32(ix.wq_b(q_res)[0].reshape(S, NI, Di))
    for t in (k, q):   # the indexer's rope: half-split pairs on the first rd channels
        view = t.narrow(t.ndim - 1, 0, rd)
        ref.rope(x=view, positions=i32(np.arange(S)), out=view, interleaved=0, scaling=0, theta=theta, factor=1.0,
                 original_max_position=0, beta_fast=0.0, beta_slow=0.0, attn_factor=1.0)
    cache, table = paged_rows(np64(k), BS, rng)
    K = cfg.index_topk
    got = Tensor.empty((S, K), "int32", fill=0x7F7F7F7F)
    ref.indexer_topk(q=q, weights=f32(ix.weights_proj(h)[0] * NI ** -0.5), keys=f32(cache), block_table=i32(table),
                     token_seq=i32(np.zeros(S)), kv_len=i32(np.arange(1, S + 1)), out=got, scale=ix.softmax_scale,
                     ratio=1, block_size=BS)
    for t in range(S):   # 16 heads: an all-ReLU-zero score (a tie whose order is torch's whim) is unlikely
        n = min(K, t + 1)
        assert got.numpy()[t, :n].tolist() == topk[t, :n].tolist(), (t, got.numpy()[t], topk[t])
        assert np.all(got.numpy()[t, n:] == -1)

    # MLA over the positions the indexer chose, absorbed (mla_decode) and un-absorbed (transformers' way)
    Hh, Dn, Dr, Dv, Dc = 2, cfg.qk_nope_head_dim, rd, cfg.v_head_dim, cfg.kv_lora_rank
    qm = rng.standard_normal((S, Hh, Dn + Dr))
    latent = rng.standard_normal((S, Dc + Dr))
    wkv_b = rng.standard_normal((Hh * (Dn + Dv), Dc)) / np.sqrt(Dc)
    lc, ltable = paged_rows(latent, BS, rng)
    out = empty((S, Hh, Dv))
    ref.mla_decode(q=f32(qm), wkv_b=f32(wkv_b), cache=f32(lc), block_table=i32(ltable), token_seq=i32(np.zeros(S)),
                   kv_len=i32(np.arange(1, S + 1)), out=out, scale=0.3, indices=i32(topk))
    W = np64(f32(wkv_b)).reshape(Hh, Dn + Dv, Dc)
    lat = np64(f32(latent))
    k_nope = np.einsum("hnc,sc->shn", W[:, :Dn], lat[:, :Dc])
    v = np.einsum("hvc,sc->shv", W[:, Dn:], lat[:, :Dc])
    scores = 0.3 * (np.einsum("thn,shn->hts", np64(f32(qm))[..., :Dn], k_nope)
                    + np.einsum("thr,sr->hts", np64(f32(qm))[..., Dn:], lat[:, Dc:]))
    selected = np.zeros((S, S), bool)
    np.put_along_axis(selected, topk.astype(np.int64), True, axis=1)
    allowed = selected & np.tri(S, dtype=bool)                      # transformers: causal & ~index_mask
    scores = torch.from_numpy(scores).masked_fill(~torch.from_numpy(allowed)[None], float("-inf"))
    want = torch.einsum("hts,shv->thv", scores.softmax(-1), torch.from_numpy(v))
    close(out, want)
    # what transformers never produces but the spec defines: -1, far positions and repeats change nothing
    extra = np.stack([np.full(S, -1), np.full(S, 10**6), topk[:, 0], topk[:, 0], np.arange(S) + 1], axis=1)
    again = empty((S, Hh, Dv))
    ref.mla_decode(q=f32(qm), wkv_b=f32(wkv_b), cache=f32(lc), block_table=i32(ltable), token_seq=i32(np.zeros(S)),
                   kv_len=i32(np.arange(1, S + 1)), out=again, scale=0.3,
                   indices=i32(np.concatenate([topk, extra], axis=1)))
    np.testing.assert_array_equal(np64(again), np64(out))
