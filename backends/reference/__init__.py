"""The NumPy reference backend: the executable form of abi/README.md and the oracle every other
backend is certified against.

Each op is one plain function in a module by topic (quant, linear, norm, rope, attention, moe,
elementwise, sampling; 1.3: hyper for hyper-connections, sparse for V4's compressed and sparse
attention and the lightning indexer; 1.4: dist for collectives and expert parallelism) whose keyword parameters are exactly the fields of the op's args struct in
deepinfer_abi.h. Inputs are read into float64 (float32 where the README defines f32 semantics:
dequantize, quantize, the residual sum of rmsnorm) and each output is rounded once to its dtype.
"""
from __future__ import annotations

from deepinfer import abi
from deepinfer._version import __version__
from deepinfer.backend import Backend, BackendInfo, Comm

from .attention import mla_cache_write, mla_decode, mla_prefill
from .common import unsupported, write, write_4bit
from . import dist
from .dist import all_gather, all_reduce, all_to_all, moe_combine, moe_dispatch
from .elementwise import add, concat, embedding, mul, silu_mul
from .fused import mla_rope_cache_write
from .linear import linear
from .hyper import hc_post, hc_pre
from .moe import moe_experts, moe_router
from .norm import layernorm, rmsnorm
from .quant import dequantize, dequantize_array, quantize, quantize_array
from .rope import inv_freq, rope
from .sampling import sample, spec_verify, splitmix64
from .sparse import indexer_topk, kv_compress, sparse_attention

# op name -> function, in DI_OpId order
OPS = {
    "embedding": embedding,
    "rmsnorm": rmsnorm,
    "linear": linear,
    "quantize": quantize,
    "dequantize": dequantize,
    "rope": rope,
    "mla_cache_write": mla_cache_write,
    "mla_prefill": mla_prefill,
    "mla_decode": mla_decode,
    "moe_router": moe_router,
    "moe_experts": moe_experts,
    "add": add,
    "mul": mul,
    "silu_mul": silu_mul,
    "concat": concat,
    "sample": sample,
    "spec_verify": spec_verify,
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "kv_compress": kv_compress,
    "indexer_topk": indexer_topk,
    "sparse_attention": sparse_attention,
    "layernorm": layernorm,
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "all_to_all": all_to_all,
    "moe_dispatch": moe_dispatch,
    "moe_combine": moe_combine,
    "mla_rope_cache_write": mla_rope_cache_write,
}

if list(OPS) != abi.OP_NAMES:  # the header is the source of truth for the op set
    raise RuntimeError(f"reference ops {list(OPS)} do not match the header's {abi.OP_NAMES}")


class ReferenceBackend(Backend):
    """Runs every op of the ABI (this header's version) on host tensors with NumPy."""

    info = BackendInfo(name="reference", version=__version__, device="cpu")

    def ops(self) -> list[str]:
        return list(OPS)

    def _run(self, op: str, kwargs: dict) -> None:
        fn = OPS.get(op)
        if fn is None:
            raise unsupported(op, f"the reference backend does not implement {op}")
        if "comm" in kwargs and isinstance(kwargs["comm"], Comm):
            kwargs = dict(kwargs, comm=kwargs["comm"].handle)
        fn(**kwargs)

    # ---- communicators (ABI 1.4): the MPI job this process runs in (dist.ReferenceComm)
    @property
    def supports_comm(self) -> bool:
        return True

    def comm_unique_id(self) -> bytes:
        return dist.unique_id()

    def comm_create(self, comm_id: bytes, nranks: int, rank: int) -> Comm:
        return Comm(self, nranks, rank, dist.create_comm(bytes(comm_id), nranks, rank))

    def _comm_destroy(self, handle) -> None:
        dist.destroy_comm(handle)


__all__ = [
    "ReferenceBackend", "OPS", "dequantize_array", "quantize_array", "write", "write_4bit", "inv_freq",
    "splitmix64",
]
