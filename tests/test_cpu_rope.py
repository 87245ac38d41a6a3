"""rope with negative positions (ABI 1.3: V4 undoes its output rotation) on the CPU library against
the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from cpu_op_harness import In, both, close, run
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== rope with negative positions


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rope_negative_positions_undo(be, ref, interleaved):
    """V4 rotates its attention output back by -p: rope(-p) after rope(p) is the identity, and rope at
    negative positions agrees with the reference."""
    rng = np.random.default_rng(interleaved)
    T, H, D = 6, 3, 16
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 2047, 5], np.int32)
    sc = dict(interleaved=interleaved, scaling=1, theta=10000.0, factor=4.0, original_max_position=64,
              beta_fast=32.0, beta_slow=1.0, attn_factor=1.0)
    fwd = run(be, "rope", {"x": In(x), "positions": In(pos, "int32")}, {"out": ((T, H, D), "f32")}, **sc)["out"]
    back, want = both(be, ref, "rope", {"x": In(fwd), "positions": In(-pos, "int32")}, {"out": ((T, H, D), "f32")},
                      **sc)
    close(back["out"], want["out"], "f32", "rope(-p)", rtol=1e-4)
    np.testing.assert_allclose(back["out"], x, rtol=1e-4, atol=1e-4)
