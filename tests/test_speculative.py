"""MTP speculative decoding (engine.speculative): lossless greedy and sampled output, the cache after
rollback, the scheduler's decisions, config and CLI."""
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import deepinfer
from deepinfer.engine import Engine, default_model_dir
from deepinfer.engine.sampling import SamplingParams
from deepinfer.config import SpecConfig
from deepinfer.engine.spec_schedule import Calibration, StepCosts, admit, survival
from deepinfer.engine.model_runner import bucket
from deepinfer.errors import ConfigError

MODEL = default_model_dir()


def _backends():
    out = [pytest.param("reference", id="reference")]
    cpu = [c for c in deepinfer.candidates() if c.ok and c.name == "cpu"]
    out.append(pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not cpu, reason="libdeepinfer_cpu.so not built")))
    if os.environ.get("DEEPINFER_CUDA_LIB"):           # backends/cuda/device.sh speculative on the GPU
        out.append(pytest.param("cuda", id="cuda"))
    return out


def _engine(backend, spec=None, model=MODEL, **kw):
    if backend in ("cpu", "cuda") and os.environ.get(f"DEEPINFER_{backend.upper()}_LIB"):
        backend = os.environ[f"DEEPINFER_{backend.upper()}_LIB"]   # the library under test (conftest's rule)
    cfg = {"backend": backend, "precision": "f32", "max_batch": 8, "max_seq_len": 512, **kw}
    # what the host backends hold anyway; a device would otherwise give each engine 90% of its free memory
    cfg.setdefault("kv_cache_tokens", cfg["max_batch"] * cfg["max_seq_len"])
    if spec is not None:
        cfg["speculative"] = spec
    return Engine.from_pretrained(model, config=cfg)


def _prompts(n: int) -> list:
    """n prompts cut from the embedded model's held-out text (different lengths and content)."""
    text = (MODEL / "heldout.txt").read_text()
    lines = [l for l in text.splitlines() if len(l.strip()) > 12]
    step = max(len(lines) // n, 1)
    return [lines[i * step][:20 + (i * 7) % 60] for i in range(n)]


# ---------------------------------------------------------------------------- lossless greedy
# A device's kernels give a row a rounding that depends on the rows around it (the CUDA library
# picks a GEMV, a tiled or a tensor-core GEMM by the row count, and its activations and cache are
# bf16), so there a verify step of several rows per sequence, or a batch of other sequences, can
# turn the argmax at a near-tie. On such a backend a sequence may leave plain decoding only at a
# token where plain decoding itself was tied within that rounding: the plain model's logits of its
# token and of the other differ there by at most NEAR_TIE of the row's range (a wrong draft kept
# would differ by about the range itself). Host backends (reference, cpu) round a row the same in
# any batch: their output must be identical.
NEAR_TIE = 0.02


def _assert_same_greedy(backend, off: Engine, ids: list, ref: list, got: list, what) -> None:
    diff = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
    if backend in ("reference", "cpu"):
        assert not diff, f"{what}: {len(diff)} of {len(ref)} prompts differ, first {diff[0]}: " \
                         f"{ref[diff[0]]} != {got[diff[0]]}" if diff else ""
        return
    r = off.runner
    for i in diff:
        a, b = ref[i], got[i]
        assert len(a) == len(b), (what, i, a, b)
        j = next(k for k in range(len(a)) if a[k] != b[k])
        sid = r.new_sequence()
        row = r.backend.to_numpy(r.forward([(sid, list(ids[i]) + list(a[:j]), 0)]))[0].astype(np.float64)
        r.free(sid)
        gap, span = abs(row[a[j]] - row[b[j]]), row.max() - row.min()
        assert np.isfinite(row).all() and gap <= NEAR_TIE * span, \
            f"{what}: prompt {i} leaves plain decoding at token {j} ({a[j]} -> {b[j]}) where their logits " \
            f"differ by {gap:.4g} of a range {span:.4g}: not a tie"
    if diff:
        warnings.warn(f"{backend} {what}: {len(diff)} of {len(ref)} prompts turned at a near-tie: {diff}")


@pytest.fixture(scope="module", params=_backends())
def greedy_runs(request):
    """The same 50 prompts, 16 greedy tokens each: speculation off, and on with fixed K=2 and with
    the confidence scheduler; each alone (batch 1) and all together (mixed batches of 8). A run is
    compared with speculation off in the same arrangement: a device's kernels may round a prompt's
    prefill differently when it is batched with others (the CUDA library's do), which changes a
    near-tie's argmax with or without speculation."""
    be = request.param
    prompts = _prompts(50)
    off = _engine(be)
    ids = [off.tokenizer.encode(p) for p in prompts]
    ref = {"mixed": off.generate_ids(ids, max_new_tokens=16),
           "alone": [off.generate_ids([i], max_new_tokens=16)[0] for i in ids]}
    # speculation off, batched or alone: on a device, the batch's rounding alone (see NEAR_TIE)
    _assert_same_greedy(be, off, ids, ref["alone"], ref["mixed"], "off: alone vs mixed")
    runs = {}
    for name, spec in (("fixed2", {"method": "mtp", "num_draft": 2, "confidence": 0.0}),
                       ("fixed3", {"method": "mtp", "num_draft": 3, "confidence": 0.0}),
                       ("auto", {"method": "mtp", "num_draft": 2, "confidence": "auto"})):
        eng = _engine(be, spec)
        runs[(name, "mixed")] = (eng.generate_ids(ids, max_new_tokens=16), eng.stats())
        if name == "fixed2":
            runs[(name, "alone")] = ([eng.generate_ids([i], max_new_tokens=16)[0] for i in ids], eng.stats())
    return be, off, ids, ref, runs


@pytest.mark.parametrize("run", [("fixed2", "mixed"), ("fixed2", "alone"), ("fixed3", "mixed"), ("auto", "mixed")],
                         ids=lambda r: "-".join(r))
def test_greedy_output_is_identical_with_speculation(greedy_runs, run):
    be, off, ids, refs, runs = greedy_runs
    got, stats = runs[run]
    _assert_same_greedy(be, off, ids, refs[run[1]], got, run)
    assert all(len(t) == 16 for t in got)
    if run[0].startswith("fixed"):
        # the drafts were really verified, and most of them accepted (the embedded model's MTP
        # predicts the next-next token ~75% of the time)
        assert stats["spec_steps"] > 0 and stats["spec_drafts_verified"] > 100
        assert stats["spec_acceptance_per_position"][0] > 0.5
        assert stats["spec_mean_accepted_length"] > 1.5


# ---------------------------------------------------------------------------- lossless sampling
def _kept(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.argsort(-p, kind="stable")[:top_k]
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("backend", _backends())
def test_sampling_with_speculation_keeps_the_distribution(backend, tiny_checkpoint, tmp_path):
    """Seeded sampling (temperature 1, top_k 8) on the tiny V3 model, 2 tokens per request: the
    second token, drawn by spec_verify from the MTP's sampled draft (exact rejection sampling),
    follows the model's own two-step distribution (chi-square against the exact probabilities)."""
    import shutil
    import tiny_checkpoints

    src, _, _ = tiny_checkpoint("v3")
    model = tmp_path / "v3"
    shutil.copytree(src, model)
    tiny_checkpoints.add_tokenizer(model)
    eng = _engine(backend, {"method": "mtp", "num_draft": 1, "confidence": 0.0}, model=model, max_batch=64,
                  max_seq_len=64, max_queue=100000)
    prompt = [5, 17, 42, 99, 7]
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=8, seed=1234, ignore_eos=True)
    N = 3000
    rid = eng.add_request(prompt, params, n=N)
    pairs = {}
    while eng.has_unfinished():
        for o in eng.step():
            pairs.setdefault(o.index, []).extend(o.token_ids)
    st = eng.stats()
    assert st["spec_drafts_verified"] >= N * 0.9, st          # the second tokens came through verification
    assert 0 < st["spec_drafts_accepted"] < st["spec_drafts_verified"]   # both branches ran
    # the exact law of the second token: sum over first tokens t of p(t) p(. | t)
    r = eng.runner
    sid = r.new_sequence()
    p1 = _kept(r.backend.to_numpy(r.forward([(sid, prompt, 0)]))[0], 1.0, 8)
    p2 = np.zeros_like(p1)
    for t in np.flatnonzero(p1):
        row = r.backend.to_numpy(r.forward([(sid, [int(t)], len(prompt))]))[0]
        p2 += p1[t] * _kept(row, 1.0, 8)
    r.free(sid)
    firsts = np.array([v[0] for v in pairs.values()])
    seconds = np.array([v[1] for v in pairs.values()])
    assert len(seconds) == N
    for name, draws, law in (("first", firsts, p1), ("second", seconds, p2)):
        support = np.flatnonzero(law > 0)
        assert set(np.unique(draws)) <= set(support), name
        cells = [c for c in support if law[c] * N >= 5]
        obs = np.array([(draws == c).sum() for c in cells] + [np.isin(draws, cells, invert=True).sum()])
        exp = np.array([law[c] * N for c in cells] + [N - sum(law[c] * N for c in cells)])
        keep = exp > 0
        obs, exp = obs[keep], exp[keep]
        stat = float(((obs - exp) ** 2 / exp).sum())
        assert stat < _chi2_critical(len(obs) - 1), (name, stat, obs, exp)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 0.999 (z = its normal quantile), Wilson-Hilferty."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


# ---------------------------------------------------------------------------- rollback and the MTP cache
def _cached_rows(runner, slots: np.ndarray, n: int) -> list:
    """(pool, rows) of every cache pool of every layer that a sequence's first n positions wrote:
    per-token pools at their slots (V2 / V3: one latent per layer); V4's compressed pools at the
    entries of the windows those positions closed."""
    bs = runner.block_manager.block_size
    out = []
    for i, layer in enumerate(runner.kv.layers):
        for name, t in (layer.items() if isinstance(layer, dict) else [("latent", layer)]):
            a = runner.backend.to_numpy(t)
            if t.shape[1] == bs:
                rows = a[slots // bs, slots % bs]
            else:
                r = runner.cfg.v4.ratio(i)
                p = np.array([q for q in range(n) if (q + 1) % r == 0], np.int64)
                rows = a[slots[p] // bs, (p % bs) // r]
            out.append((f"layer {i} {name}", rows))
    return out


def _check_rollback(backend, model, prompt: list, steps: int, **cfg) -> None:
    """Speculative steps on one request until drafts were both accepted and rejected; then every
    cache pool of every layer (the MTP layer's included) holds at the sequence's positions what a
    plain recomputation of the accepted tokens writes there (the main model over them, then the MTP
    layer with the tokens that follow them, on a fresh sequence), and the prefix cache registered
    only blocks of accepted tokens."""
    eng = _engine(backend, {"method": "mtp", "num_draft": 3, "confidence": 0.0}, model=model, kv_block_size=4, **cfg)
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    seq = eng._requests[rid][0]
    for _ in range(steps):
        eng.step()
    st = eng.stats()
    assert st["spec_drafts_verified"] > st["spec_drafts_accepted"] > 0, st    # rejections happened
    bm = eng.block_manager
    n, toks = seq.num_computed, list(seq.token_ids)
    assert n == len(toks) - 1 and not seq.is_finished
    got = _cached_rows(eng.runner, np.array(bm.slots(seq, 0, n)), n)
    pr = _engine(backend, model=model, kv_block_size=4, **cfg).runner
    sid = pr.new_sequence()
    pr.forward([(sid, toks[:n], 0)], keep_hidden=True)
    pr.mtp_logits([(sid, toks[1:n + 1], 0)])
    want = _cached_rows(pr, np.array(pr.block_manager.slots(pr.offline.seqs[sid], 0, n)), n)
    L = pr.cfg.num_hidden_layers
    assert {w.split()[1] for w, _ in want} == set(map(str, range(L + 1)))     # the MTP layer's pools too
    # f32 caches: the same arithmetic, every element within 1e-4 of the largest. bf16 caches (a
    # device's): the recomputation's prefill runs other kernels than the verify steps did, and the
    # rounding of the layers below adds up (on the H100: up to 0.10 of a row's norm by the embedded
    # model's layer 3), so each row must be within ROW_TOL of its recomputation. What tells a stale
    # row (a rejected draft's) from rounding is layer 0, whose rows depend on their own token (and
    # position) only: there the rows must be at least 3 x closer to the recomputation than the rows
    # a recomputation with every token replaced writes (a stale row is such a row)
    ROW_TOL = 0.25
    if pr.dtype != "f32":
        V = pr.cfg.vocab_size
        alt = [(t + 1 + i % 7) % V for i, t in enumerate(toks)]
        pa = _engine(backend, model=model, kv_block_size=4, **cfg).runner
        sa = pa.new_sequence()
        pa.forward([(sa, alt[:n], 0)], keep_hidden=True)
        pa.mtp_logits([(sa, alt[1:n + 1], 0)])
        stale = dict(_cached_rows(pa, np.array(pa.block_manager.slots(pa.offline.seqs[sa], 0, n)), n))

    def row_err(x, ref):
        x2, r2 = (v.reshape(v.shape[0], -1).astype(np.float64) for v in (x, ref))
        return np.linalg.norm(x2 - r2, axis=1) / np.maximum(np.linalg.norm(r2, axis=1), 1e-30)

    for (name, a), (_, b) in zip(got, want):
        assert np.isfinite(a).all() and a.shape == b.shape
        if not b.size:
            continue
        if pr.dtype == "f32":
            err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
            assert err < 1e-4, f"{name}: {err}"
            continue
        err = row_err(a, b)
        assert err.max() < ROW_TOL, f"{name}: rows {np.flatnonzero(err >= ROW_TOL).tolist()} differ by {err.max():.3f}"
        if name.startswith("layer 0 "):
            far = row_err(stale[name], b)
            assert far.min() > 3 * err.max(), (f"{name}: a row closer to another token's ({far.min():.3f}) than 3x "
                                               f"its rounding ({err.max():.3f}): the check could not see a stale row")
    # the prefix cache holds only blocks of accepted positions, with their tokens
    for i, h in enumerate(seq.block_hashes):
        b = bm.blocks[seq.block_table[i]]
        assert b.tokens == tuple(toks[i * bm.block_size:(i + 1) * bm.block_size])
    assert len(seq.block_hashes) == n // bm.block_size


@pytest.mark.parametrize("backend", _backends())
def test_rollback_leaves_no_stale_cache_entries(backend):
    """The embedded model: after speculative steps that rejected drafts, every cached position of the
    sequence -- the main layers and the MTP layer -- holds what a plain recomputation of the accepted
    tokens writes there, and the prefix cache registered only blocks of accepted tokens."""
    _check_rollback(backend, MODEL, _prompts(3)[1], steps=12)


def test_rollback_check_with_bf16_caches():
    """The same check with bf16 activations and caches (a device's), on the CPU library: the
    row-wise tolerance a device needs still tells every accepted row from another token's."""
    _check_rollback("cpu", MODEL, _prompts(3)[1], steps=12, activation_dtype="bf16")


@pytest.mark.parametrize("family", ["v32", "v4"])
def test_family_rollback_check_with_bf16_caches(family, spec_model):
    _check_rollback("cpu", spec_model(family), _spec_prompts()[1], steps=10, activation_dtype="bf16")


def test_engine_runs_speculation_through_preemption_and_abort():
    """A cache too small for every sequence's drafts: drafts shrink to what fits, sequences get
    preempted and recomputed, and the output still equals plain decoding."""
    prompts = _prompts(6)
    off = _engine("reference", kv_cache_tokens=160, kv_block_size=4, max_batch=6)
    ids = [off.tokenizer.encode(p) for p in prompts]
    ref = off.generate_ids(ids, max_new_tokens=14)
    on = _engine("reference", {"method": "mtp", "num_draft": 3, "confidence": 0.0}, kv_cache_tokens=160,
                 kv_block_size=4, max_batch=6)
    assert on.generate_ids(ids, max_new_tokens=14) == ref
    rid = on.add_request(prompts[0], SamplingParams(max_new_tokens=30))
    on.step()
    on.step()
    assert on.abort(rid)
    assert on.block_manager.num_used_blocks == 0


def test_speculation_with_an_expert_cache():
    """Speculative steps pause at every MoE layer (the MTP layer's too) for the expert cache; the
    output is still plain decoding's."""
    prompts = _prompts(6)
    off = _engine("reference", max_batch=4)
    ids = [off.tokenizer.encode(p) for p in prompts]
    on = _engine("reference", {"method": "mtp", "num_draft": 2, "confidence": 0.0}, max_batch=4,
                 expert_cache={"capacity": 0.5})
    assert on.generate_ids(ids, max_new_tokens=12) == off.generate_ids(ids, max_new_tokens=12)
    st = on.stats()
    assert st["spec_drafts_accepted"] > 0 and st["expert_misses"] > 0


# ---------------------------------------------------------------------------- DeepSeek V3.2 and V4
_SPEC_MODELS: dict = {}


@pytest.fixture(scope="module")
def spec_model(tiny_checkpoint, tmp_path_factory):
    """spec_model("v32" | "v4"): a tiny checkpoint of that family with its MTP layer, made
    predictable enough for drafts to be accepted. V3.2 (tests/tiny_checkpoints.py): the DSA indexer
    in every layer, the MTP layer's included. V4 (tests/tiny_v4.py, DeepSeek's layout with `mtp.0`):
    sliding, CSA and HCA layers, hash routing, hyper-connections. Attention and MLP outputs are scaled
    by 0.1, so each layer's residual is mostly its input, and the MTP layer's projection passes only
    the next token's embedding (V3.2's eh_proj = [I 0]; V4's e_proj = I, h_proj = 0). The main model
    then mostly predicts f(token) and the MTP layer f(next token), the next-next token: about 60% of
    first drafts are accepted, the rest rejected."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    import tiny_checkpoints
    import tiny_v4

    def get(family: str):
        if family in _SPEC_MODELS:
            return _SPEC_MODELS[family]
        out = tmp_path_factory.mktemp(f"{family}_spec") / "model"
        if family == "v32":
            shutil.copytree(tiny_checkpoint("v32")[0], out)
        else:
            tiny_v4.make(out, seed=3, layout="deepseek", mtp=True)
        for f in out.glob("*.safetensors"):
            d = load_file(str(f))
            for k in list(d):
                if k.endswith(("o_proj.weight", "down_proj.weight", "wo_b.weight", "w2.weight")):
                    d[k] = d[k] * 0.1
                elif k.endswith("eh_proj.weight"):
                    H = d[k].shape[0]
                    d[k] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
                elif k.endswith("mtp.0.e_proj.weight"):
                    d[k] = torch.eye(d[k].shape[0])
                elif k.endswith("mtp.0.h_proj.weight"):
                    d[k] = torch.zeros_like(d[k])
            save_file(d, str(f), metadata={"format": "pt"})
        tiny_checkpoints.add_tokenizer(out)
        _SPEC_MODELS[family] = out
        return out

    return get


def _spec_prompts(n: int = 12) -> list:
    rng = np.random.default_rng(0)
    # 3 to 19 tokens: V3.2's indexer (index_topk 4) chooses among most of their positions; V4's
    # window is 8 tokens, its CSA / HCA windows 4 and 8
    return [rng.integers(2, 256, int(k)).tolist() for k in rng.integers(3, 20, n)]


@pytest.mark.parametrize("family", ["v32", "v4"])
@pytest.mark.parametrize("backend", _backends())
def test_family_greedy_output_is_identical_with_speculation(backend, family, spec_model):
    """V3.2's MTP layer (a V3.2 block whose indexer reads the MTP layer's own cache) and V4's (the
    main model's last streams through e_proj / h_proj, a sliding-window V4 block, its own
    hyper-connection head) draft; the verified output equals plain decoding, alone and in mixed
    batches, fixed K and auto."""
    model = spec_model(family)
    ids = _spec_prompts()
    off = _engine(backend, model=model)
    ref = off.generate_ids(ids, max_new_tokens=16)
    for spec, alone in (({"method": "mtp", "num_draft": 2, "confidence": 0.0}, False),
                        ({"method": "mtp", "num_draft": 3, "confidence": 0.0}, True),
                        ({"method": "mtp", "num_draft": 2, "confidence": "auto"}, False)):
        eng = _engine(backend, spec, model=model)
        got = [eng.generate_ids([i], max_new_tokens=16)[0] for i in ids[:4]] if alone else \
            eng.generate_ids(ids, max_new_tokens=16)
        _assert_same_greedy(backend, off, ids, ref[:len(got)], got, spec)
        st = eng.stats()
        if spec["confidence"] == 0.0:
            # drafts were accepted and rejected: both paths of the verification ran
            assert st["spec_drafts_verified"] > st["spec_drafts_accepted"] > 0, st


@pytest.mark.parametrize("backend", [b for b in _backends() if b.id == "cpu"])
def test_v4_speculation_with_an_expert_cache(backend, spec_model):
    """V4's speculative steps pause at every MoE layer for the expert cache (its hash-routed first
    layer prefetched from the verified rows' ids, the MTP layer's experts streamed too); the output
    is still plain decoding's."""
    model = spec_model("v4")
    ids = _spec_prompts(8)
    ref = _engine(backend, model=model, max_batch=4).generate_ids(ids, max_new_tokens=12)
    on = _engine(backend, {"method": "mtp", "num_draft": 3, "confidence": 0.0}, model=model, max_batch=4,
                 expert_cache={"capacity": 0.5, "prefetch": True})
    assert on.generate_ids(ids, max_new_tokens=12) == ref
    st = on.stats()
    assert st["spec_drafts_accepted"] > 0 and st["expert_misses"] > 0 and st["expert_prefetch_used"] > 0


@pytest.mark.parametrize("family", ["v32", "v4"])
@pytest.mark.parametrize("backend", _backends())
def test_family_rollback_leaves_no_stale_cache_entries(backend, family, spec_model):
    """After speculative steps with rejections, every pool of every layer (V3.2: the MLA latent and
    the indexer's keys; V4: the window's KV, the compressors' inputs, compressed entries and indexer
    keys; the MTP layer's included) holds at the sequence's positions what a plain recomputation of
    the accepted tokens writes there."""
    _check_rollback(backend, spec_model(family), _spec_prompts()[1], steps=10)


# ---------------------------------------------------------------------------- the scheduler
def _costs(plain: dict, spec: dict) -> StepCosts:
    c = StepCosts()
    for k, v in plain.items():
        c.observe("plain", k, v)
    for k, v in spec.items():
        c.observe("spec", k, v)
    return c


def test_scheduler_backs_off_when_verification_costs_more_than_it_gains():
    # verifying costs as much per row as decoding: drafts can never pay, so the step runs plain
    costly = _costs({b: b * 1e-3 for b in (1, 2, 4, 8, 16, 32)}, {b: b * 1.2e-3 for b in (1, 2, 4, 8, 16, 32, 64)})
    surv = [[0.9, 0.8]] * 8
    assert admit([2] * 8, surv, costly, bucket, None, True).counts is None
    # verification nearly free (a launch-bound GPU): every likely draft is admitted
    cheap = _costs({b: 1e-3 for b in (1, 2, 4, 8, 16)}, {b: 1.1e-3 for b in (1, 2, 4, 8, 16, 24, 32)})
    a = admit([2] * 8, surv, cheap, bucket, None, True)
    assert a.counts == [2] * 8 and a.expected_tokens == pytest.approx(8 + 8 * 1.7)
    # in between: the most likely drafts first, until the next bucket's step time outweighs them
    mid = _costs({1: 1e-3, 2: 1e-3, 4: 1e-3}, {1: 1.2e-3, 2: 1.25e-3, 4: 1.3e-3, 8: 2.6e-3})
    a = admit([2, 2], [[0.9, 0.3], [0.6, 0.1]], mid, bucket, None, True)
    assert a.counts == [1, 1]
    # a fixed threshold admits exactly the drafts whose survival reaches it
    assert admit([2, 2], [[0.9, 0.3], [0.6, 0.1]], mid, bucket, 0.5, True).counts == [1, 1]
    assert admit([2, 2], [[0.9, 0.3], [0.6, 0.1]], mid, bucket, 0.0, True).counts == [2, 2]
    assert admit([2, 2], [[0.9, 0.3], [0.6, 0.1]], mid, bucket, 0.0, False).counts is None


def test_calibration_learns_measured_acceptance():
    cal = Calibration(2)
    assert cal(0, 0.95) == pytest.approx(0.95)           # no data: the draft probability
    for _ in range(400):
        cal.update(0, 0.95, False)                      # drafts this confident are always wrong
    assert cal(0, 0.95) < 0.02
    assert cal(0, 0.35) == pytest.approx(0.35)           # other bins untouched
    assert survival([0.95, 0.35], cal)[1] < 0.01


def test_step_costs_interpolate_and_average():
    c = _costs({1: 1.0, 4: 4.0}, {})
    assert c.get("plain", 2) == pytest.approx(2.0) and c.get("plain", 8) == pytest.approx(8.0)
    c.observe("plain", 1, 2.0)
    assert 1.0 < c.get("plain", 1) < 2.0


# ---------------------------------------------------------------------------- config and CLI
@pytest.mark.parametrize("spec, msg", [
    ({"method": "eagle"}, "only \"mtp\""),
    ({"method": "mtp", "num_draft": 0}, "num_draft"),
    ({"method": "mtp", "num_draft": 9}, "num_draft"),
    ({"method": "mtp", "num_draft": 2.0}, "num_draft"),
    ({"method": "mtp", "confidence": 1.0}, "below 1"),
    ({"method": "mtp", "confidence": "high"}, "auto"),
    ({"method": "mtp", "confidence": float("nan")}, "finite"),
    ({"method": "mtp", "mtp": False}, "needs the MTP head"),
    ({"num_draft": 2}, "set \"method\""),
    ({"method": "mtp", "draft": 2}, "unknown speculative"),
])
def test_bad_speculative_config_is_a_clear_error(spec, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        SpecConfig.parse(spec)


def test_speculation_needs_an_mtp_layer(tiny_copy):
    import tiny_checkpoints

    model = tiny_copy("v2")                      # V2 has no MTP module
    tiny_checkpoints.add_tokenizer(model)
    with pytest.raises(ConfigError, match="MTP layer"):
        Engine.from_pretrained(model, config={"backend": "reference", "speculative": {"method": "mtp"}})


def test_cli_run_speculative():
    out = subprocess.run([sys.executable, "-m", "deepinfer.cli", "run", str(MODEL), "def fibonacci(n):", "--backend",
                          "reference",
                          "--precision", "f32", "--speculative", "mtp", "--num-draft", "2", "--spec-confidence", "0",
                          "--max-new-tokens", "12", "-v"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    plain = subprocess.run([sys.executable, "-m", "deepinfer.cli", "run", str(MODEL), "def fibonacci(n):", "--backend",
                            "reference",
                            "--precision", "f32", "--max-new-tokens", "12"], capture_output=True, text=True, timeout=600)
    assert out.stdout == plain.stdout and out.stdout.strip()
    stats = json.loads(out.stderr.split("deepinfer: stats ", 1)[1].splitlines()[0])
    assert stats["spec_steps"] > 0 and stats["spec_acceptance_per_position"][0] is not None


def test_one_stalled_step_does_not_make_its_kind_look_slow_for_good():
    """A step that stalled (a page fault, the collector) moves the estimate by at most twice itself:
    otherwise one slow plain step makes plain look slow until a plain step runs again, which the
    scheduler then never chooses. A real change is still followed within a few dozen steps."""
    c = StepCosts()
    c.observe("plain", 1, 250e-6)
    c.observe("plain", 1, 2.7e-3)
    assert c.get("plain", 1) == pytest.approx(300e-6)
    for _ in range(30):
        c.observe("plain", 1, 1e-3)
    assert c.get("plain", 1) > 0.95e-3
