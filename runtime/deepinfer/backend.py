"""The Backend object: one shape for every backend, the NumPy reference and any ABI library.

Ops are called by name with the keyword arguments of their args struct in deepinfer_abi.h
(`backend.linear(x=x, w=w, out=y)`); absent optional tensors are simply left out. This module
is the one import path for all of it; the parts live in

  backend_base.py      the Backend interface with its host defaults, and the handles a backend
                       creates (Stream, Event, Graph, Comm, HostRegistration)
  native_backend.py    NativeBackend: an ABI library's context, memory, streams, graphs, copies
  native_calls.py      how NativeBackend marshals an op call into the C args struct
  fallback_backend.py  FallbackBackend: ops a host backend lacks run on the reference
"""
from .abi import ffi
from .backend_base import Backend, BackendInfo, Comm, Event, Graph, HostRegistration, Stream
from .fallback_backend import FallbackBackend
from .native_backend import FILL_CHUNK, NativeBackend

__all__ = ["Backend", "BackendInfo", "Comm", "Event", "FILL_CHUNK", "FallbackBackend", "Graph", "HostRegistration",
           "NativeBackend", "Stream", "ffi"]
