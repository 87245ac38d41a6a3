"""Test cases as data: for each op, a builder that turns explicit parameters (shapes, dtypes, format,
flags) into a Case, and a generator that draws those parameters (edge cases first, then seeded
random draws). The harness runs a Case on the library and on the reference and compares.

Everything here is host NumPy data; nothing touches a backend. Values are drawn fresh for every
case from the case's own seed, so a failure names a seed that reproduces it exactly.

One module per op family, named as the reference backend's (backends/reference/<family>.py), holds
each op's builder, generator, large cases and small valid call, and declares them in its OPS dict
(op -> common.OpCases); this package collects those. Adding an op is one entry in its family's OPS.
The data model and the shared value helpers are in common.py.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ... import abi
from . import (attention, dist, elementwise, fused, hyper, linear as _linear, moe, norm, quant, rope as _rope, sampling,
               sparse)
# every name the one-file cases.py had, which callers import from here
from .attention import gen_mla_cache_write, gen_mla_decode, gen_mla_prefill, mla_cache_write, mla_decode, mla_prefill
from .common import (ACT_FORMATS, FLOATS, PROFILES, QMAX, QUANTIZE_FORMATS, WEIGHT_FORMATS, Case, Format, OpCases,
                     Profile, QSpec, TArg, TSpec, _pick, _random_codes, _random_scales, _Seeds, _shape_str,
                     _sparse_indices, _tol, ints, np_dtype, out, plain, randn, scale_shape)
from .dist import (COMM_DTYPES, _expert_ids, all_gather, all_reduce, all_to_all, comm_values, gen_all_gather,
                   gen_all_reduce, gen_all_to_all, gen_moe_combine, gen_moe_dispatch, moe_combine, moe_dispatch)
from .elementwise import _gen_binary, binary, concat, embedding, gen_concat, gen_embedding, gen_silu_mul, silu_mul
from .fused import gen_mla_rope_cache_write, mla_rope_cache_write
from .hyper import gen_hc_post, gen_hc_pre, hc_post, hc_pre
from .linear import gen_linear, linear
from .moe import (ROUTER_CONFIGS, _expert_map, gen_moe_experts, gen_moe_experts_errors, gen_moe_router, moe_experts,
                  moe_router)
from .norm import gen_layernorm, gen_rmsnorm, layernorm, rmsnorm
from .quant import dequantize, gen_dequantize, gen_dequantize_l2, gen_quantize, quantize
from .rope import YARN, gen_rope, rope
from .sampling import gen_sample, gen_spec_verify, sample, sample_controls, spec_verify
from .sparse import (KV_COMPRESS_CONFIGS, _block_table, _rows_over, gen_indexer_topk, gen_kv_compress,
                     gen_sparse_attention, indexer_topk, kv_compress, sparse_attention)

FAMILIES = (elementwise, norm, _linear, quant, _rope, attention, moe, sampling, hyper, sparse, dist, fused)


def _collect() -> dict[str, OpCases]:
    """Every family's OPS in one dict, in the header's op order (DI_OpId)."""
    found: dict[str, OpCases] = {}
    for family in FAMILIES:
        for op, cases in family.OPS.items():
            if op in found:
                raise RuntimeError(f"op {op} has conformance cases in two families ({family.__name__})")
            found[op] = cases
    order = {op: i for i, op in enumerate(abi.OP_NAMES)}
    return dict(sorted(found.items(), key=lambda kv: order.get(kv[0], len(order))))


OP_CASES: dict[str, OpCases] = _collect()
GENERATORS: dict[str, Callable] = {op: c.generate for op, c in OP_CASES.items()}
# the suite covers every op of the header; a new op without a generator fails here, not silently
_missing = set(abi.OP_NAMES) - set(GENERATORS)
if _missing:
    raise RuntimeError(f"conformance has no case generator for op(s) {sorted(_missing)}")

# a stable base seed per op so that a case name + seed reproduces across runs and machines
_OP_SEED = {op: 1000 + 97 * i for i, op in enumerate(abi.OP_NAMES)}


def _large(op: str, s: _Seeds):
    """The op's large cases (OpCases.large), drawn on the seeds its generator left."""
    large = OP_CASES[op].large
    return large(s) if large is not None else iter(())


def cases_for(op: str, profile: str | Profile = "default", seed: int = 0) -> list[Case]:
    p = PROFILES[profile] if isinstance(profile, str) else profile
    s = _Seeds(_OP_SEED[op] + seed)
    return list(GENERATORS[op](p, s)) + list(_large(op, s))


def error_cases(profile="default", seed: int = 0) -> list[Case]:
    p = PROFILES[profile] if isinstance(profile, str) else profile
    return list(gen_moe_experts_errors(p, _Seeds(7 + seed)))


def l2_cases(profile="default", seed: int = 0) -> list[Case]:
    p = PROFILES[profile] if isinstance(profile, str) else profile
    return list(gen_dequantize_l2(p, _Seeds(4242 + seed)))


def without_fields(case: Case, fields) -> Case:
    """The same call with some args-struct fields left out (absent tensors, zero scalars) and their
    outputs no longer compared: what a caller that does not know those fields sends."""
    fields = set(fields)
    return dataclasses.replace(case, name=f"{case.name} without {', '.join(sorted(fields))}",
                               tensors={k: v for k, v in case.tensors.items() if k not in fields},
                               scalars={k: v for k, v in case.scalars.items() if k not in fields},
                               check=[c for c in case.check if c not in fields])


def a_full_case(op: str) -> Case:
    """A small successful call that also sets every field appended after the op (DI_ARGS_SINCE)."""
    full = OP_CASES[op].full
    return full() if full is not None else a_valid_case(op)


def a_valid_case(op: str) -> Case:
    """A small, ordinary, successful call of an op (the L0 checks mutate it)."""
    return OP_CASES[op].valid()
