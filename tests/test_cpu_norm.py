"""layernorm (ABI 1.3) on the CPU library against the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from cpu_op_harness import In, both, close, expect_error
from cpu_op_harness import be, ref  # noqa: F401  (module fixtures)


# ====================================================================== layernorm


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("T,H,bias,view", [(1, 64, True, False), (37, 300, False, True), (9, 128, True, True)])
def test_layernorm(be, ref, dt, T, H, bias, view):
    rng = np.random.default_rng(T * 1000 + H)
    ins = {"x": In(rng.standard_normal((T, H)) * 3 + 1.5, dt, (2, 5) if view else (0, 0)),
           "weight": In(rng.standard_normal(H), dt), "bias": In(rng.standard_normal(H), dt) if bias else None}
    got, want = both(be, ref, "layernorm", ins, {"out": ((T, H), dt)}, eps=1e-6)
    close(got["out"], want["out"], dt, "layernorm")


def test_layernorm_rejects_negative_eps(be):
    expect_error(be, "layernorm", {"x": In(np.ones((2, 4))), "weight": In(np.ones(4))}, {"out": ((2, 4), "f32")},
                 eps=-1.0, match="eps")
