"""sample: greedy, seeded top-k / top-p, and the SplitMix64 stream of the README."""
import numpy as np
import pytest

from deepinfer.reference import ReferenceBackend
from deepinfer.tensor import Tensor

ref = ReferenceBackend()
M64 = 2**64


def hand_splitmix64(x):
    """The README's formula, step by step in Python ints."""
    z = (x + 0x9E3779B97F4A7C15) % M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    return z ^ (z >> 31)


def hand_uniform(seed):
    return (hand_splitmix64(seed) >> 11) / 2.0**53


def run_sample(logits, temperature, top_k=None, top_p=None, seeds=None):
    logits = np.asarray(logits, np.float32)
    B = logits.shape[0]
    full = lambda v, dt: np.broadcast_to(np.asarray(v, dt), (B,)).copy()  # noqa: E731
    out = Tensor.empty((B,), "int32", fill=-1)
    ref.sample(logits=Tensor.from_numpy(logits), temperature=Tensor.from_numpy(full(temperature, np.float32)),
               top_k=Tensor.from_numpy(full(0 if top_k is None else top_k, np.int32)),
               top_p=Tensor.from_numpy(full(1.0 if top_p is None else top_p, np.float32)),
               seeds=Tensor.from_numpy(full(0 if seeds is None else seeds, np.uint64)), out=out)
    return out.numpy().copy()


def test_splitmix64_known_values():
    # the first two outputs of the SplitMix64 generator seeded with 0 (Vigna's reference splitmix64.c):
    # state 0 and state 0x9E3779B97F4A7C15
    assert hand_splitmix64(0) == 0xE220A8397B1DCDAF
    assert hand_splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    from deepinfer.reference import splitmix64
    for seed in [0, 1, 42, 2**63, M64 - 1, 0x9E3779B97F4A7C15, 123456789012345]:
        assert splitmix64(seed) == hand_splitmix64(seed)


def test_greedy_ties_go_to_the_lowest_index():
    logits = [[1.0, 3.0, 3.0, -2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -1.0, 0.0, 0.0]]
    np.testing.assert_array_equal(run_sample(logits, temperature=0.0), [1, 0, 2])
    np.testing.assert_array_equal(run_sample(logits, temperature=-1.0), [1, 0, 2])


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 30))
    logits[7, 3] = logits[7, 11] = logits[7].max() + 1   # a tie: top_k=1 keeps the lower index
    got = run_sample(logits, temperature=1.3, top_k=1, seeds=np.arange(50))
    np.testing.assert_array_equal(got, np.argmax(logits.astype(np.float32), axis=1))


def test_tiny_top_p_is_greedy():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((40, 9))
    got = run_sample(logits, temperature=0.8, top_p=1e-6, seeds=np.arange(40) * 7919)
    np.testing.assert_array_equal(got, np.argmax(logits.astype(np.float32), axis=1))


def test_token_follows_the_seed_exactly():
    # p = [0.2, 0.5, 0.3] -> sorted order tokens 1 (0.5), 2 (0.3), 0 (0.2); cumulative 0.5, 0.8, 1.0
    logits = np.log(np.array([[0.2, 0.5, 0.3]]))
    for seed in range(200):
        u = hand_uniform(seed)
        want = 1 if u < 0.5 else (2 if u < 0.8 else 0)
        if min(abs(u - 0.5), abs(u - 0.8)) < 1e-6:
            continue   # too close to a boundary for f32 logits
        assert run_sample(logits, 1.0, seeds=[seed])[0] == want, seed
        # top_p 0.79: keep tokens 1 and 2 only (0.5 + 0.3 >= 0.79); u scales over their sum 0.8
        want_p = 1 if u * 0.8 < 0.5 else 2
        if abs(u * 0.8 - 0.5) > 1e-6:
            assert run_sample(logits, 1.0, top_p=0.79, seeds=[seed])[0] == want_p, seed
        # top_k 2 keeps the same two
        if abs(u * 0.8 - 0.5) > 1e-6:
            assert run_sample(logits, 1.0, top_k=2, seeds=[seed])[0] == want_p, seed


def test_empirical_distribution_matches_softmax():
    V, N, temp = 6, 6000, 0.7
    logits = np.array([1.0, 0.3, -0.5, 2.0, 0.0, 1.2], np.float32)
    tokens = run_sample(np.tile(logits, (N, 1)), temp, seeds=np.arange(N, dtype=np.uint64) * 0x1234567 + 99)
    p = np.exp(logits.astype(np.float64) / np.float32(temp))
    p /= p.sum()
    freq = np.bincount(tokens, minlength=V) / N
    sigma = np.sqrt(p * (1 - p) / N)
    assert np.all(np.abs(freq - p) < 4.5 * sigma + 1e-9), (freq, p)


def test_top_k_distribution_is_renormalised():
    N = 4000
    logits = np.array([0.0, 1.0, 2.0, 0.5], np.float32)
    tokens = run_sample(np.tile(logits, (N, 1)), 1.0, top_k=2, seeds=np.arange(N) + 5)
    assert set(np.unique(tokens)) <= {1, 2}
    p2 = np.exp(2.0) / (np.exp(1.0) + np.exp(2.0))
    assert abs(np.mean(tokens == 2) - p2) < 4.5 * np.sqrt(p2 * (1 - p2) / N)


def test_sample_validation():
    with pytest.raises(ValueError, match=r"sample: top_k.shape\[0\]=3 != logits.shape\[0\]=2"):
        ref.sample(logits=Tensor.from_numpy(np.zeros((2, 4), np.float32)),
                   temperature=Tensor.from_numpy(np.ones(2, np.float32)),
                   top_k=Tensor.from_numpy(np.zeros(3, np.int32)), top_p=Tensor.from_numpy(np.ones(2, np.float32)),
                   seeds=Tensor.from_numpy(np.zeros(2, np.uint64)), out=Tensor.empty((2,), "int32"))
    with pytest.raises(TypeError, match="sample: seeds.dtype=int64, expected uint64"):
        ref.sample(logits=Tensor.from_numpy(np.zeros((2, 4), np.float32)),
                   temperature=Tensor.from_numpy(np.ones(2, np.float32)),
                   top_k=Tensor.from_numpy(np.zeros(2, np.int32)), top_p=Tensor.from_numpy(np.ones(2, np.float32)),
                   seeds=Tensor.from_numpy(np.zeros(2, np.int64)), out=Tensor.empty((2,), "int32"))
    with pytest.raises(ValueError, match="NaN"):
        run_sample([[0.0, np.nan]], 1.0)
