"""spec_verify (ABI 1.2) and sample's `probs`, on the reference and the CPU library.

The statistical tests check the point of speculative sampling: a draft token drawn from the draft
distribution q, then judged by spec_verify against the target distribution p, yields tokens
distributed exactly as p (chi-square over many rows, each with its own seed), and the acceptance
rate is sum_x min(p(x), q(x)). Everything is seeded, so the tests are deterministic.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from deepinfer.reference import ReferenceBackend
from deepinfer.reference.sampling import distribution, sample_row, uniform
from deepinfer.tensor import Tensor

F = Tensor.from_numpy
V = 8
N = 20000          # rows per statistical test (one call)
ALPHA = 1e-4       # fixed seeds: a correct sampler passes these deterministically


@pytest.fixture(params=["reference", "cpu"])
def backend(request):
    if request.param == "reference":
        return ReferenceBackend()
    return request.getfixturevalue("cpu_backend")


def run_spec_verify(be, logits, draft_ids, temperature, top_k=0, top_p=1.0, seeds=None, draft_logits=None):
    T = logits.shape[0]
    full = lambda v, dt: np.broadcast_to(np.asarray(v, dt), (T,)).copy()  # noqa: E731
    out = be.upload(Tensor.empty((T,), "int32", fill=-7))
    acc = be.upload(Tensor.empty((T,), "int32", fill=-7))
    # a prepared call borrows its tensors: they must stay alive while it runs
    kw = dict(logits=be.upload(F(np.ascontiguousarray(logits, np.float32))),
              draft_logits=None if draft_logits is None else be.upload(F(np.ascontiguousarray(draft_logits,
                                                                                             np.float32))),
              draft_ids=be.upload(F(full(draft_ids, np.int32))), temperature=be.upload(F(full(temperature, np.float32))),
              top_k=be.upload(F(full(top_k, np.int32))), top_p=be.upload(F(full(top_p, np.float32))),
              seeds=be.upload(F(full(0 if seeds is None else seeds, np.uint64))), out=out, accepted=acc)
    be.prepare("spec_verify", **kw)()
    return be.to_numpy(out), be.to_numpy(acc)


def chi_square_p(tokens: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"tokens outside the support of p: {counts} vs {p}"
    support = p > 0
    return stats.chisquare(counts[support], len(tokens) * p[support]).pvalue


SETTINGS = [  # (temperature, top_k, top_p, how far the draft model is from the target)
    (1.0, 0, 1.0, 1.0),
    (0.7, 5, 1.0, 0.5),
    (1.3, 0, 0.85, 2.0),
    (1.0, 3, 0.9, 0.0),    # the draft is the target: everything is accepted
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s[0]}-k{s[1]}-p{s[2]}-d{s[3]}")
def test_drafts_from_q_then_verify_are_distributed_as_p(backend, setting):
    temp, k, top_p, dist = setting
    rng = np.random.default_rng(int(1000 * temp + 10 * k + 100 * top_p + dist))
    target = rng.standard_normal(V) * 1.5
    draft = target + dist * rng.standard_normal(V)
    p = distribution(target.astype(np.float32).astype(np.float64), temp, k, top_p)
    q = distribution(draft.astype(np.float32).astype(np.float64), temp, k, top_p)
    drafts = rng.choice(V, size=N, p=q)
    seeds = rng.integers(0, 2**64, N, dtype=np.uint64)
    out, acc = run_spec_verify(backend, np.tile(target, (N, 1)), drafts, temp, k, top_p, seeds,
                               draft_logits=np.tile(draft, (N, 1)))
    assert set(np.unique(acc)) <= {0, 1}
    np.testing.assert_array_equal(out[acc == 1], drafts[acc == 1])
    assert chi_square_p(out, p) > ALPHA
    rate = np.minimum(p, q).sum()     # the acceptance probability of speculative sampling
    assert abs(acc.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / N) + 1e-9, (acc.mean(), rate)


@pytest.mark.parametrize("temp,k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.95)])
def test_greedy_drafts_are_distributed_as_p(backend, temp, k, top_p):
    """No draft_logits: q is one-hot at the draft (a deterministic draft model). The output is still
    p-distributed; the draft is accepted with probability p(d)."""
    rng = np.random.default_rng(7 + k)
    target = rng.standard_normal(V) * 1.5
    p = distribution(target.astype(np.float32).astype(np.float64), temp, k, top_p)
    d = int(np.argsort(-p, kind="stable")[1])     # a plausible but not the likeliest draft
    seeds = rng.integers(0, 2**64, N, dtype=np.uint64)
    out, acc = run_spec_verify(backend, np.tile(target, (N, 1)), d, temp, k, top_p, seeds)
    assert chi_square_p(out, p) > ALPHA
    assert abs(acc.mean() - p[d]) < 5 * np.sqrt(p[d] * (1 - p[d]) / N)
    assert np.all(out[acc == 1] == d)


def test_bonus_rows_are_sample_exactly(backend):
    rng = np.random.default_rng(11)
    T = 64
    logits = (rng.standard_normal((T, 50)) * 2).astype(np.float32)
    temp = rng.choice(np.array([0.5, 1.0, 1.7], np.float32), T)
    ks = rng.choice(np.array([0, 3, 20], np.int32), T)
    ps = rng.choice(np.array([1.0, 0.9], np.float32), T)
    seeds = rng.integers(0, 2**64, T, dtype=np.uint64)
    out, acc = run_spec_verify(backend, logits, -1, temp, ks, ps, seeds,
                               draft_logits=logits + rng.standard_normal(logits.shape).astype(np.float32))
    want = [sample_row(logits[t].astype(np.float64), float(temp[t]), int(ks[t]), float(ps[t]), int(seeds[t]))
            for t in range(T)]
    np.testing.assert_array_equal(out, want)
    assert not acc.any()


def test_greedy_rows(backend):
    logits = np.array([[1.0, 3.0, 3.0, -2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -1.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]],
                      np.float32)
    draft_logits = np.full_like(logits, np.nan)   # never read by greedy rows
    out, acc = run_spec_verify(backend, logits, [1, 2, -1, 3], 0.0, draft_logits=draft_logits)
    np.testing.assert_array_equal(out, [1, 0, 2, 3])
    np.testing.assert_array_equal(acc, [1, 0, 0, 1])


def test_acceptance_and_residual_follow_the_seed(backend):
    """Row by row against the README's formulas: accept iff u * q(d) < p(d); else the first index whose
    running sum of max(p - q, 0) exceeds u2 * sum, u2 from seed + 0x9E3779B97F4A7C15."""
    target = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    draft = np.log(np.array([0.4, 0.1, 0.3, 0.2]))
    p, q = np.exp(target), np.exp(draft)
    r = np.maximum(p - q, 0)    # [0, 0.3, 0, 0.1]
    seeds = np.arange(300, dtype=np.uint64) * 7919
    drafts = np.array([0, 2] * 150)
    out, acc = run_spec_verify(backend, np.tile(target, (300, 1)), drafts, 1.0, seeds=seeds,
                               draft_logits=np.tile(draft, (300, 1)))
    checked = 0
    for t in range(300):
        d, s = int(drafts[t]), int(seeds[t])
        u = uniform(s)
        if abs(u * q[d] - p[d]) < 1e-6:
            continue
        if u * q[d] < p[d]:
            assert (out[t], acc[t]) == (d, 1), t
        else:
            u2 = uniform((s + 0x9E3779B97F4A7C15) % 2**64)
            if abs(u2 * r.sum() - r[1]) < 1e-6:
                continue
            assert (out[t], acc[t]) == ((1 if u2 * r.sum() < r[1] else 3), 0), t
        checked += 1
    assert checked > 280


def test_sample_probs(backend):
    rng = np.random.default_rng(5)
    B, Vb = 40, 30
    logits = (rng.standard_normal((B, Vb)) * 2).astype(np.float32)
    temp = rng.choice(np.array([0.0, 0.6, 1.0, 1.5], np.float32), B)
    ks = rng.choice(np.array([0, 1, 5], np.int32), B)
    ps = rng.choice(np.array([1.0, 0.8], np.float32), B)
    seeds = rng.integers(0, 2**64, B, dtype=np.uint64)
    out = backend.upload(Tensor.empty((B,), "int32", fill=-1))
    probs = backend.upload(Tensor.empty((B,), "f32", fill=np.nan))
    kw = dict(logits=backend.upload(F(logits)), temperature=backend.upload(F(temp)), top_k=backend.upload(F(ks)),
              top_p=backend.upload(F(ps)), seeds=backend.upload(F(seeds)), out=out, probs=probs)
    backend.prepare("sample", **kw)()
    out, probs = backend.to_numpy(out), backend.to_numpy(probs)
    for b in range(B):
        x = logits[b].astype(np.float64)
        if temp[b] <= 0:
            e = np.exp(x - x.max())
            want = e[out[b]] / e.sum()      # the model's confidence at temperature 1
            assert out[b] == np.argmax(x)
        else:
            want = distribution(x, float(temp[b]), int(ks[b]), float(ps[b]))[out[b]]
            if ks[b] == 1:
                assert probs[b] == pytest.approx(1.0, rel=1e-6)
        assert probs[b] == pytest.approx(want, rel=1e-5), b
    # without probs the tokens are the same
    out2 = backend.upload(Tensor.empty((B,), "int32", fill=-1))
    backend.sample(logits=backend.upload(F(logits)), temperature=backend.upload(F(temp)), top_k=backend.upload(F(ks)),
                   top_p=backend.upload(F(ps)), seeds=backend.upload(F(seeds)), out=out2)
    np.testing.assert_array_equal(backend.to_numpy(out2), out)


@pytest.mark.parametrize("bad", ["draft id >= V", "NaN draft logits of a judged row", "all -inf logits"])
def test_invalid_inputs_are_rejected_before_writing(backend, bad):
    from deepinfer.errors import BackendCallError

    logits = np.zeros((3, 5), np.float32)
    draft_logits = np.zeros((3, 5), np.float32)
    ids = np.array([0, 1, -1], np.int32)
    temp = np.array([1.0, 1.0, 1.0], np.float32)
    if bad == "draft id >= V":
        ids[1] = 5
    elif bad == "NaN draft logits of a judged row":
        draft_logits[0, 2] = np.nan
    else:
        logits[2] = -np.inf
    with pytest.raises((ValueError, BackendCallError)) as e:
        run_spec_verify(backend, logits, ids, temp, draft_logits=draft_logits)
    if isinstance(e.value, BackendCallError):
        assert e.value.status_name == "INVALID_ARGUMENT"
    # NaN draft logits of a row that does not read them (bonus or greedy) are fine
    draft_logits = np.zeros((3, 5), np.float32)
    draft_logits[2] = np.nan
    run_spec_verify(backend, np.zeros((3, 5), np.float32), np.array([0, 1, -1], np.int32), temp,
                    draft_logits=draft_logits)
