"""The runtime's side of ABI 1.1 streams, events, pinned / registered host memory and async copies:
the same calls on the reference (host, trivially ordered), the CPU library (through the ABI), and a
clear UNIMPLEMENTED from a 1.0 library that lacks them."""
from __future__ import annotations

import numpy as np
import pytest

import deepinfer
from deepinfer.errors import UnsupportedOpError
from deepinfer.tensor import Tensor


@pytest.fixture(params=["reference", "cpu"])
def backend(request, cpu_backend):
    return deepinfer.get_backend("reference") if request.param == "reference" else cpu_backend


def test_upload_on_one_stream_then_compute_on_another(backend):
    """Copy new values from pinned memory on stream A, record an event, make stream B wait, add on B."""
    a_stream, b_stream = backend.create_stream(), backend.create_stream()
    ev = backend.create_event()
    try:
        pinned = backend.host_empty((4, 8), "f32")
        vals = np.arange(32, dtype=np.float32).reshape(4, 8)
        pinned.numpy()[...] = vals
        dst = backend.empty((4, 8), "f32")
        backend.copy_async(dst, pinned, a_stream)
        ev.record(a_stream)
        b_stream.wait(ev)
        out = backend.empty((4, 8), "f32", fill=np.nan)
        backend.add(a=dst, b=dst, out=out)
        b_stream.synchronize()
        ev.synchronize()
        assert ev.query()
        np.testing.assert_array_equal(backend.to_numpy(out), 2 * vals)
    finally:
        ev.close()
        a_stream.close()
        b_stream.close()


def test_registered_host_range_and_memory_info(backend):
    arr = np.random.default_rng(1).standard_normal(1024).astype(np.float32)
    with backend.register_host(arr):
        dst = backend.empty((1024,), "f32")
        backend.copy_async(dst, Tensor.from_numpy(arr))
        backend.synchronize()
        np.testing.assert_array_equal(backend.to_numpy(dst), arr)
    free, total = backend.memory_info()
    assert 0 < free <= total
    assert backend.device_count() == 1


def test_copy_async_checks_its_arguments(backend):
    with pytest.raises(ValueError, match="same size"):
        backend.copy_async(backend.empty((4,), "f32"), Tensor.from_numpy(np.zeros(5, np.float32)))


def test_cpu_library_rejects_unregistering_twice(cpu_backend):
    arr = np.zeros(256, np.uint8)
    reg = cpu_backend.register_host(arr)
    ptr = reg.ptr
    reg.close()
    reg.close()   # closing the handle twice is harmless on the runtime's side...
    with pytest.raises(Exception, match="was not registered"):
        cpu_backend._host_unregister(ptr)   # ...but the library refuses a range it no longer holds


def test_descriptor_arrays_are_shared_and_never_stale(cpu_backend):
    """Per-expert descriptor arrays are marshalled once and shared by every call that passes the same
    tensors; replacing one tensor (an expert loaded or evicted) gives a fresh array."""
    be = cpu_backend
    ws = [Tensor.from_numpy(np.full((4, 8), i, np.float32)) for i in range(3)]
    a1 = be.descriptor_array(ws, "w")
    assert be.descriptor_array(list(ws), "w")[0] == a1[0]          # same tensors: the same C array
    ws2 = [ws[0], Tensor.from_numpy(np.full((4, 8), 9, np.float32)), ws[2]]
    a2 = be.descriptor_array(ws2, "w")
    assert a2[0] != a1[0]
    assert int(be.descriptor_array([ws[0], None, ws[2]], "w")[0][1].data == __import__("deepinfer").abi.ffi.NULL)


@pytest.mark.parametrize("dtype, numel, fill", [("f32", 1000, np.nan), ("bf16", 4099, 0.0), ("int4", 777, 0.0),
                                               ("f32", 48, -1.5)])
def test_device_fill_stages_through_a_bounded_host_chunk(cpu_backend, monkeypatch, dtype, numel, fill):
    """A device tensor's fill (NativeBackend._fill) copies at most FILL_CHUNK bytes from the host and
    doubles the filled part on the device: the KV cache is most of a GPU's memory. Run on the CPU
    library's memory through the same mem_copy calls, with a chunk a few elements long so the
    doubling and the last partial copy both happen."""
    import deepinfer.native_backend as B
    from deepinfer import dtypes as D

    monkeypatch.setattr(B, "FILL_CHUNK", 40)
    dt = D.get(dtype)
    t = Tensor(None, (numel,), dtype)
    t.buffer = cpu_backend._alloc(t.nbytes)
    raw = np.full(t.nbytes, 0xAB, np.uint8)                  # poison first
    cpu_backend._copy(t.buffer.ptr, raw.ctypes.data, raw.nbytes, "DI_COPY_HOST_TO_DEVICE")
    cpu_backend._fill(t, fill)
    back = np.empty(t.nbytes, np.uint8)
    cpu_backend._copy(back.ctypes.data, t.buffer.ptr, back.nbytes, "DI_COPY_DEVICE_TO_HOST")
    want = np.zeros(t.nbytes, np.uint8) if dt.packed else np.full(numel, fill, dt.np).view(np.uint8)
    np.testing.assert_array_equal(back, want)
