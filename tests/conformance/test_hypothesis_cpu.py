"""Hypothesis-drawn shapes through the conformance harness on the CPU library: odd sizes, K not a
multiple of the group, empty batches, unbalanced experts, strided views. The quick profile draws a
few examples per op; DEEPINFER_CONFORMANCE_THOROUGH=1 draws many (the vendor setting)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugin_build import THOROUGH

from deepinfer.conformance import cases as C
from deepinfer.conformance.harness import ReferenceCache, check_case
from deepinfer.loader import load_library
from deepinfer.reference import ReferenceBackend

SETTINGS = settings(max_examples=300 if THOROUGH else 8, deadline=None, derandomize=not THOROUGH,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

seeds = st.integers(0, 2**31 - 1)
floats = st.sampled_from(C.FLOATS)


@pytest.fixture(scope="module")
def cpu(cpu_lib):
    be = load_library(cpu_lib)
    yield be
    be.close()


@pytest.fixture(scope="module")
def ref():
    return ReferenceCache(ReferenceBackend())


def _check(be, ref, case):
    if not be.has_op(case.op):
        pytest.skip(f"the CPU library does not claim {case.op}")
    o = check_case(be, case, ref)
    assert o.status in ("pass", "unsupported"), f"{case.name} (seed {case.seed}): {o.message}"


@SETTINGS
@given(seed=seeds, M=st.integers(0, 9), K=st.integers(1, 300), N=st.integers(1, 40),
       x=floats, w=st.sampled_from(list(C.FLOATS) + list(C.WEIGHT_FORMATS)), bias=st.booleans(), view=st.booleans())
def test_linear(cpu, ref, seed, M, K, N, x, w, bias, view):
    _check(cpu, ref, C.linear(seed, M, K, N, x, w if w not in C.FLOATS else x, bias=bias, view=view))


@SETTINGS
@given(seed=seeds, M=st.integers(0, 6), K=st.integers(1, 400), N=st.integers(1, 140),
       pair=st.sampled_from([("int8/token/f32", "int8/channel/f32"), ("int8/token/f32", "int4/g32/sym/f32"),
                             ("e4m3/1x128/f32", "e4m3/128x128/f32")]))
def test_linear_quantized_activations(cpu, ref, seed, M, K, N, pair):
    _check(cpu, ref, C.linear(seed, M, K, N, pair[0], pair[1]))


@SETTINGS
@given(seed=seeds, rows=st.integers(0, 140), cols=st.integers(1, 300), fmt=st.sampled_from(list(C.WEIGHT_FORMATS)),
       out=floats)
def test_dequantize_bit_exact(cpu, ref, seed, rows, cols, fmt, out):
    _check(cpu, ref, C.dequantize(seed, (rows, cols), fmt, out))


@SETTINGS
@given(seed=seeds, rows=st.integers(1, 140), cols=st.integers(1, 300), fmt=st.sampled_from(list(C.QUANTIZE_FORMATS)),
       x=floats, pow2=st.integers(0, 1), zero_row=st.booleans())
def test_quantize_bit_exact(cpu, ref, seed, rows, cols, fmt, x, pow2, zero_row):
    _check(cpu, ref, C.quantize(seed, (rows, cols), x, fmt, scale_pow2=pow2, zero_row=zero_row))


@SETTINGS
@given(seed=seeds, T=st.integers(0, 12), H=st.integers(1, 300), dt=floats,
       variant=st.sampled_from(["plain", "residual", "residual_out_alias_residual", "residual_out_alias_x",
                                "out_alias_x"]), view=st.booleans())
def test_rmsnorm(cpu, ref, seed, T, H, dt, variant, view):
    _check(cpu, ref, C.rmsnorm(seed, T, H, dt, variant, view=view and variant in ("plain", "residual")))


@SETTINGS
@given(seed=seeds, T=st.integers(0, 9), H=st.integers(0, 4), half=st.integers(1, 40), dt=floats,
       interleaved=st.integers(0, 1), yarn=st.booleans(), alias=st.booleans(), view=st.booleans())
def test_rope(cpu, ref, seed, T, H, half, dt, interleaved, yarn, alias, view):
    _check(cpu, ref, C.rope(seed, T, H, 2 * half, dt, interleaved, yarn, alias=alias and not view, view=view))


@SETTINGS
@given(seed=seeds, T=st.integers(0, 10), E=st.integers(1, 8), K=st.integers(1, 3), H=st.integers(1, 48),
       I=st.integers(1, 48), dt=floats, routing=st.sampled_from(["random", "one", "skip", "all"]),
       accumulate=st.integers(0, 1), w=st.sampled_from([None, "int4/g32/sym/f32", "e4m3/128x128/f32"]))
def test_moe_experts_unbalanced(cpu, ref, seed, T, E, K, H, I, dt, routing, accumulate, w):
    _check(cpu, ref, C.moe_experts(seed, T, E, K, H, I, dt, w, routing=routing, accumulate=accumulate))


@SETTINGS
@given(seed=seeds, T=st.integers(0, 40), cfg=st.sampled_from(list(C.ROUTER_CONFIGS)))
def test_moe_router(cpu, ref, seed, T, cfg):
    _check(cpu, ref, C.moe_router(seed, T, cfg))


@SETTINGS
@given(seed=seeds, seqlens=st.lists(st.integers(0, 9), min_size=1, max_size=4), H=st.integers(1, 3),
       Dn=st.integers(1, 16), Dr=st.integers(1, 4), Dv=st.integers(1, 16), dt=floats)
def test_mla_prefill(cpu, ref, seed, seqlens, H, Dn, Dr, Dv, dt):
    _check(cpu, ref, C.mla_prefill(seed, seqlens, H, Dn, 2 * Dr, Dv, dt))


@SETTINGS
@given(seed=seeds, T=st.integers(0, 8), S=st.integers(1, 3), H=st.integers(1, 3), Dn=st.integers(1, 12),
       Dr=st.integers(1, 4), Dv=st.integers(1, 12), Dc=st.integers(1, 32), BS=st.integers(1, 6),
       MB=st.integers(1, 3), dt=floats)
def test_mla_decode(cpu, ref, seed, T, S, H, Dn, Dr, Dv, Dc, BS, MB, dt):
    _check(cpu, ref, C.mla_decode(seed, T, S, H, Dn, 2 * Dr, Dv, Dc, S * MB + 1, BS, MB, dt))


@SETTINGS
@given(seed=seeds, B=st.integers(0, 16), V=st.integers(1, 3000), mode=st.sampled_from(["greedy", "mixed"]),
       ties=st.booleans())
def test_sample(cpu, ref, seed, B, V, mode, ties):
    _check(cpu, ref, C.sample(seed, B, V, mode, ties))


@SETTINGS
@given(seed=seeds, op=st.sampled_from(["add", "mul"]), shape=st.lists(st.integers(0, 9), min_size=1, max_size=4),
       dt=floats, alias=st.sampled_from([None, "a", "b"]), view=st.booleans())
def test_binary(cpu, ref, seed, op, shape, dt, alias, view):
    _check(cpu, ref, C.binary(op, seed, tuple(shape), dt, alias=alias, view=view and not alias))
