"""rope (abi/README.md section 8), including DeepSeek's YaRN frequency correction.

Frequencies and angles are computed in float64: the exact value every backend approximates.
"""
from __future__ import annotations

import math

import numpy as np

from deepinfer import abi

from .common import check_arg, check_dim, check_shape, f32, i32, read, read_index, unsupported, write
ROPE_NONE = abi.const("DI_ROPE_NONE")
ROPE_YARN = abi.const("DI_ROPE_YARN")


def yarn_correction_dim(num_rotations: float, dim: int, theta: float, original_max_position: int) -> float:
    """The dimension whose wavelength completes `num_rotations` turns over the original context."""
    return dim * math.log(original_max_position / (2 * math.pi * num_rotations)) / (2 * math.log(theta))


def inv_freq(dim: int, theta: float, scaling: int = ROPE_NONE, factor: float = 1.0,
             original_max_position: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """inv_freq[i] = theta^(-2i/D) for i < D/2, YaRN-corrected when scaling == DI_ROPE_YARN."""
    i = np.arange(dim // 2, dtype=np.float64)
    freq = theta ** (-2.0 * i / dim)
    if scaling == ROPE_YARN:
        # DeepSeek and HF clamp low from below and high from above only (find_correction_range)
        low = max(math.floor(yarn_correction_dim(beta_fast, dim, theta, original_max_position)), 0)
        high = min(math.ceil(yarn_correction_dim(beta_slow, dim, theta, original_max_position)), dim - 1)
        if low == high:
            high += 0.001  # DeepSeek's guard against a zero-width ramp
        ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
        # ramp 0: high-frequency dims keep their frequency; ramp 1: low ones are interpolated
        freq = freq / factor * ramp + freq * (1.0 - ramp)
    return freq


def rope(x=None, positions=None, out=None, interleaved=None, scaling=None, theta=None, factor=None,
         original_max_position=None, beta_fast=None, beta_slow=None, attn_factor=None) -> None:
    op = "rope"
    check_arg(op, "x", x)
    check_arg(op, "positions", positions)
    check_arg(op, "out", out)
    check_shape(op, "out", out, x.shape)
    check_dim(op, "positions.shape[0]", positions.shape[0], x.shape[0], "x.shape[0]")
    interleaved = i32(interleaved, op, "interleaved") != 0
    scaling = i32(scaling, op, "scaling")
    theta, factor, attn_factor = f32(theta, op, "theta"), f32(factor, op, "factor"), f32(attn_factor, op, "attn_factor")
    beta_fast, beta_slow = f32(beta_fast, op, "beta_fast"), f32(beta_slow, op, "beta_slow")
    original_max_position = i32(original_max_position, op, "original_max_position")
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"{op}: x.shape[-1]={D} must be even")
    if scaling not in (ROPE_NONE, ROPE_YARN):
        raise unsupported(op, f"scaling={scaling} (known: {ROPE_NONE} none, {ROPE_YARN} yarn)")
    if not theta > 1:
        raise ValueError(f"{op}: theta={theta} must be > 1")
    if scaling == ROPE_YARN:
        if not factor > 0:
            raise ValueError(f"{op}: factor={factor} must be > 0 with yarn scaling")
        if original_max_position <= 0:
            raise ValueError(f"{op}: original_max_position={original_max_position} must be > 0 with yarn scaling")
        if not (beta_fast > 0 and beta_slow > 0):
            raise ValueError(f"{op}: beta_fast={beta_fast} and beta_slow={beta_slow} must be > 0 with yarn scaling")

    freq = inv_freq(D, theta, scaling, factor, original_max_position, beta_fast, beta_slow)
    angle = read_index(positions).astype(np.float64)[:, None] * freq[None, :]   # [T, D/2]
    c, s = np.cos(angle) * attn_factor, np.sin(angle) * attn_factor
    v = read(x)
    if v.ndim == 3:
        c, s = c[:, None, :], s[:, None, :]   # the same angle for every head
    if interleaved:
        u, w = v[..., 0::2], v[..., 1::2]
    else:
        u, w = v[..., : D // 2], v[..., D // 2:]
    ru, rw = u * c - w * s, w * c + u * s
    y = np.empty_like(v)
    if interleaved:
        y[..., 0::2], y[..., 1::2] = ru, rw
    else:
        y[..., : D // 2], y[..., D // 2:] = ru, rw
    write(out, y)
