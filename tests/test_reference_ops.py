"""The reference backend's calling convention and its simple ops (embedding, rmsnorm, add, mul,
silu_mul, concat) against torch formulas."""
import inspect
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import abi
from deepinfer.backend import Backend
from deepinfer.errors import UnsupportedOpError
from deepinfer.reference import OPS, ReferenceBackend, write
from deepinfer.tensor import DeviceBuffer, Tensor

ref = ReferenceBackend()


def f32(a):
    return Tensor.from_numpy(np.asarray(a, dtype=np.float32))


def bf16(a):
    return Tensor.from_numpy(np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16))


def as_torch(t: Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(t.numpy()).astype(np.float32))


# ---------------------------------------------------------------------------- calling convention


def test_backend_identity_and_ops():
    assert isinstance(ref, Backend)
    assert ref.info.name == "reference" and ref.info.device == "cpu"
    assert ref.ops() == abi.OP_NAMES and len(ref.ops()) == abi.const("DI_OP_COUNT_V1_6")


@pytest.mark.parametrize("op", abi.OP_NAMES)
def test_op_functions_take_exactly_the_header_fields(op):
    params = list(inspect.signature(OPS[op]).parameters)
    assert params == abi.op_fields(op)


def test_unknown_keyword_is_rejected():
    with pytest.raises(TypeError, match="unknown argument"):
        ref.add(a=f32([1]), b=f32([1]), out=Tensor.empty((1,), "f32"), c=1)


def test_device_tensors_are_rejected_cleanly():
    device = Tensor(DeviceBuffer(0, 8, SimpleNamespace(device="cuda")), (2,), "f32")
    with pytest.raises(ValueError, match="add: a lives on cuda"):
        ref.add(a=device, b=f32([1, 2]), out=Tensor.empty((2,), "f32"))
    with pytest.raises(ValueError, match="add: b lives on no memory"):
        ref.add(a=f32([1, 2]), b=Tensor(None, (2,), "f32"), out=Tensor.empty((2,), "f32"))


# ---------------------------------------------------------------------------- writing in place


def test_write_into_a_column_slice_leaves_the_rest():
    buf = Tensor.empty((3, 5), "f32", fill=-1.0)
    view = buf.narrow(1, 1, 3)
    ref.add(a=f32(np.ones((3, 3))), b=f32(np.full((3, 3), 2.0)), out=view)
    np.testing.assert_array_equal(buf.numpy(), [[-1, 3, 3, 3, -1]] * 3)


def test_read_from_strided_views():
    base = f32(np.arange(24).reshape(4, 6))
    a, b = base.narrow(1, 0, 3), base.narrow(1, 3, 3)   # kv_a[:, :3]-style views
    out = Tensor.empty((4, 3), "f32")
    ref.mul(a=a, b=b, out=out)
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.testing.assert_array_equal(out.numpy(), full[:, :3] * full[:, 3:])


def test_write_4bit_odd_rows_and_views():
    t = Tensor(np.full((3, 3), 0xAB, np.uint8), (3, 5), "int4")   # rows of 5: 3 bytes, 1 padding nibble
    write(t, np.array([[1, -1, 2, -2, 7]] * 3))
    # elements 0/1 -> 0xF1, 2/3 -> 0xE2, element 4 low nibble 7, padding nibble (0xA) kept
    np.testing.assert_array_equal(t.buffer, [[0xF1, 0xE2, 0xA7]] * 3)
    e = Tensor(np.zeros((2, 4), np.uint8), (2, 8), "e2m1").narrow(0, 1, 1)
    write(e, np.array([[0.5, -6.0, 1.5, 0.0, 3.0, -0.5, 4.0, 6.0]]))
    np.testing.assert_array_equal(e.buffer[1], [0xF1, 0x03, 0x95, 0x76])
    assert not e.buffer[0].any()


# ---------------------------------------------------------------------------- embedding


def test_embedding_gathers_rows_and_zeroes_bad_ids():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = Tensor.empty((5, 3), "f32", fill=np.nan)
    ref.embedding(ids=Tensor.from_numpy(np.array([2, 0, -1, 4, 3], np.int32)), table=f32(table), out=out)
    np.testing.assert_array_equal(out.numpy(), [table[2], table[0], [0, 0, 0], [0, 0, 0], table[3]])


def test_embedding_f16_table_to_bf16():
    table = np.array([[1.0, 1.00390625, -3.0]], np.float16)   # 1 + 2^-8 is a tie in bf16 -> 1.0
    out = Tensor.empty((1, 3), "bf16")
    ref.embedding(ids=Tensor.from_numpy(np.array([0], np.int32)), table=Tensor.from_numpy(table), out=out)
    np.testing.assert_array_equal(out.numpy().astype(np.float32), [[1.0, 1.0, -3.0]])


def test_embedding_validation():
    with pytest.raises(TypeError, match="embedding: ids.dtype=int64, expected int32"):
        ref.embedding(ids=Tensor.from_numpy(np.zeros(2, np.int64)), table=f32(np.ones((3, 4))),
                      out=Tensor.empty((2, 4), "f32"))
    with pytest.raises(ValueError, match=r"embedding: out.shape\[1\]=5 != table.shape\[1\]=4"):
        ref.embedding(ids=Tensor.from_numpy(np.zeros(2, np.int32)), table=f32(np.ones((3, 4))),
                      out=Tensor.empty((2, 5), "f32"))


# ---------------------------------------------------------------------------- rmsnorm


def assert_bf16_rounding_of(got, exact):
    """got (bf16) is exact rounded to nearest: within half a bf16 ulp, up to float64 noise in `exact`
    (the reference and torch sum in different orders, so a value a hair from a tie may go either way)."""
    got, exact = got.astype(np.float64), np.asarray(exact, np.float64)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 2.0 ** -126))) - 7)
    assert np.all(np.abs(got - exact) <= ulp / 2 * (1 + 1e-9))


def torch_rmsnorm(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@settings(max_examples=20, deadline=None)
@given(T=st.integers(0, 6), H=st.integers(1, 80), residual=st.booleans(), dtype=st.sampled_from(["f32", "bf16"]),
       seed=st.integers(0, 2**32 - 1))
def test_rmsnorm_matches_torch(T, H, residual, dtype, seed):
    rng = np.random.default_rng(seed)
    make = f32 if dtype == "f32" else bf16
    x, w, r = make(rng.standard_normal((T, H))), make(rng.standard_normal(H)), make(rng.standard_normal((T, H)))
    eps = 1e-6
    out = Tensor.empty((T, H), dtype, fill=np.nan)
    res_out = Tensor.empty((T, H), dtype, fill=np.nan) if residual else None
    ref.rmsnorm(x=x, weight=w, residual=r if residual else None, out=out, residual_out=res_out, eps=eps)
    s = as_torch(x) + as_torch(r) if residual else as_torch(x)   # the f32 sum
    want = torch_rmsnorm(s, as_torch(w), np.float32(eps).item())
    if dtype == "f32":
        np.testing.assert_allclose(out.numpy(), want.float().numpy(), rtol=1e-6, atol=1e-6)
    else:
        assert_bf16_rounding_of(out.numpy(), want.numpy())
    if residual:
        np.testing.assert_array_equal(as_torch(res_out), s.to(torch.bfloat16).float() if dtype == "bf16" else s)


def test_rmsnorm_in_place_aliases():
    rng = np.random.default_rng(0)
    x0, r0, w = rng.standard_normal((3, 8)), rng.standard_normal((3, 8)), rng.standard_normal(8)
    x, r = f32(x0), f32(r0)
    # out aliases x and residual_out aliases residual: the usual fused pre-norm update
    ref.rmsnorm(x=x, weight=f32(w), residual=r, out=x, residual_out=r, eps=1e-5)
    s = torch.from_numpy(x0).float() + torch.from_numpy(r0).float()
    np.testing.assert_allclose(x.numpy(), torch_rmsnorm(s, torch.from_numpy(w).float(), np.float32(1e-5).item()),
                               rtol=1e-6)
    np.testing.assert_array_equal(r.numpy(), s.numpy())


def test_rmsnorm_validation():
    with pytest.raises(ValueError, match=r"rmsnorm: weight.shape\[0\]=7 != x.shape\[1\]=8"):
        ref.rmsnorm(x=f32(np.ones((2, 8))), weight=f32(np.ones(7)), out=Tensor.empty((2, 8), "f32"), eps=1e-6)
    with pytest.raises(ValueError, match=r"rmsnorm: x.ndim=3, expected 2"):
        ref.rmsnorm(x=f32(np.ones((2, 2, 8))), weight=f32(np.ones(8)), out=Tensor.empty((2, 8), "f32"))
    with pytest.raises(UnsupportedOpError, match="f16"):
        ref.rmsnorm(x=Tensor.from_numpy(np.ones((2, 8), np.float16)), weight=f32(np.ones(8)),
                    out=Tensor.empty((2, 8), "f32"))


# ---------------------------------------------------------------------------- add, mul, silu_mul, concat


def test_add_mul_are_exact_f32_and_may_alias():
    rng = np.random.default_rng(1)
    a0, b0 = rng.standard_normal((4, 7)).astype(np.float32), rng.standard_normal((4, 7)).astype(np.float32)
    a, b = f32(a0.copy()), f32(b0.copy())   # from_numpy shares memory: keep a0, b0 intact
    ref.add(a=a, b=b, out=a)
    np.testing.assert_array_equal(a.numpy(), a0 + b0)
    ref.mul(a=a, b=b, out=b)
    np.testing.assert_array_equal(b.numpy(), (a0 + b0) * b0)


def test_add_shape_mismatch():
    with pytest.raises(ValueError, match=r"add: b.shape=\[3\] != a.shape=\[2\]"):
        ref.add(a=f32([1, 2]), b=f32([1, 2, 3]), out=Tensor.empty((2,), "f32"))


def test_silu_mul_matches_torch_including_extremes():
    gate = np.array([[-1000.0, -20.0, -1.0, 0.0, 1.0, 20.0, 1000.0]], np.float32)
    up = np.array([[2.0, 3.0, -1.0, 5.0, 0.5, 1.0, 1.0]], np.float32)
    out = Tensor.empty(gate.shape, "f32")
    ref.silu_mul(gate=f32(gate), up=f32(up), out=out)
    want = torch.nn.functional.silu(torch.from_numpy(gate).double()) * torch.from_numpy(up).double()
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-7, atol=0)
    assert np.isfinite(out.numpy()).all()


def test_concat_last_dim_and_validation():
    a, b = np.ones((2, 3)), np.arange(4).reshape(2, 2)
    out = Tensor.empty((2, 5), "bf16")
    ref.concat(a=f32(a), b=f32(b), out=out)
    np.testing.assert_array_equal(out.numpy().astype(np.float32), np.concatenate([a, b], axis=1))
    with pytest.raises(ValueError, match=r"concat: out.shape\[1\]=4 != a.shape\[1\] \+ b.shape\[1\]=5"):
        ref.concat(a=f32(a), b=f32(b), out=Tensor.empty((2, 4), "f32"))


def test_view_past_the_end_of_its_buffer_is_rejected():
    buf = np.zeros(8, np.float32)
    too_long = Tensor(buf, (3, 4), "f32", strides=(4, 1))          # needs 12 elements
    with pytest.raises(ValueError, match="add: a .* reaches past the end of its 32-byte buffer"):
        ref.add(a=too_long, b=f32(np.ones((3, 4))), out=Tensor.empty((3, 4), "f32"))
    shifted = Tensor(buf, (2, 4), "f32", strides=(4, 1), offset=4)  # one element too far
    with pytest.raises(ValueError, match="reaches past the end"):
        ref.add(a=shifted, b=f32(np.ones((2, 4))), out=Tensor.empty((2, 4), "f32"))
    packed = Tensor(np.zeros((2, 2), np.uint8), (2, 5), "int4")     # rows of 5 nibbles need 3 bytes
    with pytest.raises(ValueError, match="reaches past the end"):
        ref.embedding(ids=Tensor.from_numpy(np.zeros(2, np.int32)), table=packed, out=Tensor.empty((2, 5), "f32"))
