"""silu_mul's clipped SwiGLU (ABI 1.3) on the CPU library against the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from cpu_op_harness import In, both, close, expect_error, run
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== clipped SwiGLU


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_silu_mul_limit(be, ref, dt):
    rng = np.random.default_rng(8)
    T, I = 13, 70
    ins = {"gate": In(rng.standard_normal((T, I)) * 8, dt, (0, 3)), "up": In(rng.standard_normal((T, I)) * 8, dt)}
    outs = {"out": ((T, I), dt)}
    got, want = both(be, ref, "silu_mul", ins, outs, limit=7.0)
    close(got["out"], want["out"], dt, "silu_mul limit 7")
    g, u = ins["gate"].rounded(), ins["up"].rounded()
    assert (np.abs(got["out"]) <= 7.0 * 7.0 * 1.01).all()
    mine = np.minimum(g, 7.0) / (1 + np.exp(-np.minimum(g, 7.0))) * np.clip(u, -7.0, 7.0)
    close(got["out"], mine, dt, "silu_mul vs the README formula")
    # limit 0 is no clipping: the same bits as a call that leaves the field out
    a = run(be, "silu_mul", ins, outs, limit=0.0)["out"]
    b = run(be, "silu_mul", ins, outs)["out"]
    assert np.array_equal(a, b)
    expect_error(be, "silu_mul", ins, outs, match="limit", limit=-1.0)
