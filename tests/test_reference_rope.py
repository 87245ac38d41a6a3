"""rope against DeepSeek's complex-number formulation and transformers' YaRN frequencies."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import abi
from deepinfer.errors import UnsupportedOpError
from deepinfer.reference import ReferenceBackend, inv_freq
from deepinfer.tensor import Tensor

ref = ReferenceBackend()
YARN = abi.const("DI_ROPE_YARN")
NONE = abi.const("DI_ROPE_NONE")


def assert_bf16_rounding_of(got, exact):
    """got (bf16) is exact rounded to nearest: within half a bf16 ulp, up to float64 noise in `exact`."""
    got, exact = got.astype(np.float64), np.asarray(exact, np.float64)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 2.0 ** -126))) - 7)
    assert np.all(np.abs(got - exact) <= ulp / 2 * (1 + 1e-9))


def deepseek_freqs(dim, theta, yarn=None):
    """inv_freq as DeepSeek-V3's inference/model.py (precompute_freqs_cis) builds it, in float64."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if yarn is not None:
        factor, orig, beta_fast, beta_slow = yarn

        def correction_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rotate_complex(x, pos, freqs, attn_factor=1.0):
    """DeepSeek's apply_rotary_emb: pairs (2i, 2i+1) as complex numbers times e^(i*pos*freq)."""
    angles = torch.outer(pos.double(), freqs)
    cis = torch.polar(torch.full_like(angles, attn_factor), angles)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], x.shape[-1] // 2, 2).contiguous())
    if x.dim() == 3:
        cis = cis[:, None, :]
    return torch.view_as_real(xc * cis).flatten(-2)


def rotate_half_form(x, pos, freqs, attn_factor=1.0):
    """The Llama / HF form: x * cos + rotate_half(x) * sin with pairs (i, i + D/2)."""
    angles = torch.outer(pos.double(), freqs)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos() * attn_factor, emb.sin() * attn_factor
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    x = x.double()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def run_rope(x, pos, **kw):
    out = Tensor.empty(x.shape, "f32", fill=np.nan)
    ref.rope(x=Tensor.from_numpy(x), positions=Tensor.from_numpy(pos.astype(np.int32)), out=out, **kw)
    return out.numpy()


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 5), H=st.sampled_from([None, 1, 3]), half=st.integers(1, 40), interleaved=st.booleans(),
       yarn=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rope_matches_deepseek_and_hf_forms(T, H, half, interleaved, yarn, seed):
    D = 2 * half
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, D) if H is None else (T, H, D)).astype(np.float32)
    pos = rng.integers(0, 200_000, T)
    theta, factor, orig, attn = 10000.0, 40.0, 4096, 1.25   # V3's YaRN numbers, attn_factor exercised
    kw = dict(interleaved=int(interleaved), theta=theta, attn_factor=attn)
    if yarn:
        kw.update(scaling=YARN, factor=factor, original_max_position=orig, beta_fast=32.0, beta_slow=1.0)
    got = run_rope(x, pos, **kw)
    freqs = deepseek_freqs(D, theta, (factor, orig, 32.0, 1.0) if yarn else None)
    form = rotate_complex if interleaved else rotate_half_form
    want = form(torch.from_numpy(x), torch.from_numpy(pos), freqs, attn)
    np.testing.assert_allclose(got, want.float().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,theta,factor,orig,beta_fast,beta_slow", [
    (64, 10000.0, 40.0, 4096, 32, 1),      # DeepSeek-V3 / V2
    (64, 10000.0, 4.0, 4096, 32, 1),
    (32, 50000.0, 8.0, 2048, 16, 2),
    (16, 10000.0, 2.0, 64, 32, 1),         # low clamps at 0
    (16, 2.0, 4.0, 4096, 32, 1),           # low = 34 > high = 15 (clamped): every dim is interpolated
])
def test_yarn_inv_freq_matches_transformers(dim, theta, factor, orig, beta_fast, beta_slow):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV3Config(
        qk_rope_head_dim=dim, max_position_embeddings=int(orig * factor),
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                         "original_max_position_embeddings": orig, "beta_fast": beta_fast, "beta_slow": beta_slow,
                         "mscale": 1.0, "mscale_all_dim": 1.0})
    config.head_dim = dim
    hf, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert attention_factor == 1.0   # mscale == mscale_all_dim: DeepSeek folds mscale into the softmax scale
    ours = inv_freq(dim, theta, YARN, factor, orig, beta_fast, beta_slow)
    np.testing.assert_allclose(ours, hf.double().numpy(), rtol=2e-6)   # HF computes in f32


def test_rope_hand_case_position_one():
    # D = 4, theta = 100: inv_freq = [1, 0.1]; at position 1 pair 0 turns by 1 rad, pair 1 by 0.1 rad
    x = np.array([[1.0, 0.0, 0.0, 2.0]], np.float32)
    got = run_rope(x, np.array([1]), interleaved=1, theta=100.0, attn_factor=1.0)
    np.testing.assert_allclose(got[0], [math.cos(1), math.sin(1), -2 * math.sin(0.1), 2 * math.cos(0.1)], rtol=1e-6)
    got = run_rope(x, np.array([1]), interleaved=0, theta=100.0, attn_factor=1.0)
    # pairs (0, 2) and (1, 3): (1, 0) turns by 1 rad, (0, 2) by 0.1 rad
    np.testing.assert_allclose(got[0], [math.cos(1), -2 * math.sin(0.1), math.sin(1), 2 * math.cos(0.1)],
                               rtol=1e-6, atol=1e-7)


def test_rope_in_place_bf16():
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((3, 2, 8)).astype(ml_dtypes.bfloat16)
    x = Tensor.from_numpy(x0.copy())
    pos = np.array([0, 5, 77])
    ref.rope(x=x, positions=Tensor.from_numpy(pos.astype(np.int32)), out=x, interleaved=1, theta=10000.0,
             attn_factor=1.0)
    want = rotate_complex(torch.from_numpy(x0.astype(np.float32)), torch.from_numpy(pos), deepseek_freqs(8, 10000.0))
    assert_bf16_rounding_of(x.numpy(), want.numpy())


def test_rope_validation():
    x = Tensor.from_numpy(np.ones((2, 5), np.float32))
    pos = Tensor.from_numpy(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"rope: x.shape\[-1\]=5 must be even"):
        ref.rope(x=x, positions=pos, out=Tensor.empty((2, 5), "f32"), theta=10000.0)
    x = Tensor.from_numpy(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"rope: positions.shape\[0\]=3 != x.shape\[0\]=2"):
        ref.rope(x=x, positions=Tensor.from_numpy(np.zeros(3, np.int32)), out=Tensor.empty((2, 4), "f32"),
                 theta=10000.0)
    with pytest.raises(UnsupportedOpError, match="scaling=7"):
        ref.rope(x=x, positions=pos, out=Tensor.empty((2, 4), "f32"), theta=10000.0, scaling=7)
    with pytest.raises(ValueError, match="original_max_position"):
        ref.rope(x=x, positions=pos, out=Tensor.empty((2, 4), "f32"), theta=10000.0, scaling=YARN, factor=4.0)
    with pytest.raises(ValueError, match="theta"):
        ref.rope(x=x, positions=pos, out=Tensor.empty((2, 4), "f32"))
