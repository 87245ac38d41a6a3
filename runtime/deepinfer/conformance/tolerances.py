"""How close a library's result must be to the reference's, per op and per output kind.

The table is versioned: a certificate records TOLERANCES_VERSION and the exact values it used, so a
certificate stays meaningful after the bounds are tightened. Never edit a published table in
place; add the next version (v2 for ABI 1.2, v3 for 1.3, v4 for 1.4, v5 for 1.5, v6 and v7 for 1.6) and point
CURRENT at it.

An element passes when |got - want| <= rtol * |want| + atol_rel * rms(want), where rms(want) is
the root mean square of the whole expected tensor (so elements near zero after cancellation are
judged against the tensor's scale, not their own). The tensor passes when every element passes and
the normalised mean squared error sum((got-want)^2) / sum(want^2) is at most nmse. "exact" means
bit-identical (NaN never equals anything but the same NaN at a position the reference also left NaN).

Keys of the inner dicts:
  f32, bf16, f16   plain float inputs/outputs of that dtype
  q/f32, q/bf16    a quantized operand (weights or activations), output of that dtype; the reference
                   computes on its own dequantized values, the library may accumulate in any order or
                   in integers, so only f32 rounding of the accumulation separates them (from v7, a bf16
                   output of linear and moe_experts also allows the dequantized weight rounded to bf16)
  exact            integer outputs, copies and casts, quantize and dequantize
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol_rel: float
    nmse: float

    @property
    def exact(self) -> bool:
        return self.rtol == 0 and self.atol_rel == 0 and self.nmse == 0

    def as_dict(self) -> dict:
        return asdict(self)


EXACT = Tol(0.0, 0.0, 0.0)

# f32: different summation orders and a vectorised exp differ by a few ulp (~1e-7 each);
# bf16 output: one rounding to an 8-bit mantissa is 2^-9 relative, two neighbours differ by 2^-8,
# and inputs the library converts differently (bf16 -> f32 is exact) add nothing.
_F32 = Tol(1e-5, 1e-5, 1e-10)
_F32_TRANSCENDENTAL = Tol(1e-4, 1e-4, 1e-8)      # exp / rsqrt / sin / cos inside
_BF16 = Tol(1e-2, 1e-2, 1e-4)
_BF16_CHAINED = Tol(2e-2, 2e-2, 4e-4)            # a bf16 rounding in the middle is allowed
_F16 = Tol(2e-3, 2e-3, 1e-6)
_Q_F32 = Tol(2e-5, 2e-5, 1e-9)
_Q_BF16 = Tol(1e-2, 1e-2, 1e-4)

TOLERANCES_V1: dict[str, dict[str, Tol]] = {
    "embedding":       {"exact": EXACT},
    "rmsnorm":         {"f32": _F32, "bf16": _BF16, "f16": _F16},
    "linear":          {"f32": _F32, "bf16": _BF16, "f16": _F16, "q/f32": _Q_F32, "q/bf16": _Q_BF16},
    "quantize":        {"exact": EXACT},
    "dequantize":      {"exact": EXACT},
    # angles are positions * inv_freq; computing them in f32 (allowed: "at least f32") costs
    # position * 2^-24 radians, ~1e-4 at the positions the cases use (< 2048)
    "rope":            {"f32": Tol(1e-4, 2e-4, 1e-8), "bf16": _BF16},
    "mla_cache_write": {"exact": EXACT},
    "mla_prefill":     {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16_CHAINED},
    "mla_decode":      {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16_CHAINED},
    # ids are exact except between experts whose selection scores tie (see harness._cmp_router)
    "moe_router":      {"f32": _F32, "exact": EXACT},
    "moe_experts":     {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16_CHAINED, "q/f32": _F32_TRANSCENDENTAL,
                        "q/bf16": _BF16_CHAINED},
    "add":             {"f32": Tol(1e-6, 1e-7, 1e-12), "bf16": _BF16, "f16": _F16},
    "mul":             {"f32": Tol(1e-6, 1e-7, 1e-12), "bf16": _BF16, "f16": _F16},
    "silu_mul":        {"f32": _F32, "bf16": _BF16, "f16": _F16},
    "concat":          {"exact": EXACT},
    # greedy rows exact; sampled rows equal except where u * sum(kept p) falls within
    # SAMPLE_BOUNDARY_EPS of a boundary between two tokens (near-ties of the kept probabilities)
    "sample":          {"exact": EXACT},
}

# v2 (ABI 1.2): v1 unchanged, plus sample's `probs` output and the spec_verify op.
TOLERANCES_V2: dict[str, dict[str, Tol]] = {
    **TOLERANCES_V1,
    # probs: an f32 softmax probability, compared on the rows whose tokens agree
    "sample":          {"exact": EXACT, "probs": _F32_TRANSCENDENTAL},
    # out and accepted exact, except where a decision of the spec (the acceptance test u*q(d) < p(d),
    # the residual draw, the kept set's cutoffs) falls within SAMPLE_BOUNDARY_EPS of its threshold
    "spec_verify":     {"exact": EXACT},
}

# v3 (ABI 1.3): v2 unchanged (the 1.3 fields of existing ops, mla_decode's indices, hash routing,
# sqrtsoftplus and the SwiGLU limits, are judged by their op's v2 bounds), plus the six new ops.
TOLERANCES_V3: dict[str, dict[str, Tol]] = {
    **TOLERANCES_V2,
    # sigmoids, a softmax and Sinkhorn's divisions; mixes are dots over N * H (16384 in V4-Flash)
    # accumulated in f32. post and comb are f32 outputs whatever x is (key "f32").
    "hc_pre":           {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16},
    "hc_post":          {"f32": _F32, "bf16": _BF16},
    # a softmax over the window's slots per feature
    "kv_compress":      {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16},
    # entry ids: the sets must agree except for swaps between entries whose scores are within
    # INDEXER_TIE_EPS of each other (harness._cmp_indexer)
    "indexer_topk":     {"exact": EXACT},
    # as mla_decode: exp inside, and a bf16 rounding of the probabilities allowed in the middle
    "sparse_attention": {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16_CHAINED},
    # rsqrt, and a one-pass f32 variance (E[x^2] - mean^2) is allowed: a mean of a few times the
    # spread costs ~mean^2/var * 2^-24 relative
    "layernorm":        {"f32": _F32_TRANSCENDENTAL, "bf16": _BF16},
}

# v4 (ABI 1.4): v3 unchanged, plus the collectives and the two local halves of expert parallelism.
# The suite runs the collectives on a one-rank communicator (cases/dist.py); the bounds hold for any rank count.
TOLERANCES_V4: dict[str, dict[str, Tol]] = {
    **TOLERANCES_V3,
    # a sum over N ranks accumulated in f32 and rounded once: (N - 1) roundings of the running sum, far
    # inside _F32 for any N a job has (one rank: x itself). That every rank gets the same bits is checked
    # by the multi-rank tests, not by a tolerance.
    "all_reduce":       {"f32": _F32, "bf16": _BF16},
    # copies: bit-identical; all_to_all's recv and moe_dispatch's send_x only on the rows below the counts
    "all_gather":       {"exact": EXACT},
    "all_to_all":       {"exact": EXACT},
    "moe_dispatch":     {"exact": EXACT},
    # out (+)= at most N rows, summed in f32 in rank order and rounded once (key: out's dtype)
    "moe_combine":      {"f32": _F32, "bf16": _BF16},
}

# v5 (ABI 1.5): v4 unchanged, plus moe_experts' `misses` output (expert_map's skipped pairs): integers,
# exactly the reference's. moe_experts' out with a map is judged by its v1 bounds (the map only chooses
# which descriptor each pair uses).
TOLERANCES_V5: dict[str, dict[str, Tol]] = {
    **TOLERANCES_V4,
    "moe_experts":      {**TOLERANCES_V4["moe_experts"], "exact": EXACT},
}

# v6 (ABI 1.6): v5 unchanged, plus the fused mla_rope_cache_write, judged as tightly as rope: its norm
# is rmsnorm's (a sum over Dc and an rsqrt, well inside rope's f32 bound) and the rest is rope's math and
# copies. Every output (q, cache, kv_out) has the case's key; a bf16 cache of an f32 kv is keyed bf16.
TOLERANCES_V6: dict[str, dict[str, Tol]] = {
    **TOLERANCES_V5,
    "mla_rope_cache_write": dict(TOLERANCES_V1["rope"]),
}

# v7 (still ABI 1.6): v6 unchanged but for linear with a quantized operand and a bf16 output, which is
# judged as moe_experts' q/bf16 always was: one bf16 rounding in the middle is allowed. A tensor-core
# library dequantizes the weight into bf16 tiles (Marlin, transformers' fp8 and GPTQ paths do the same);
# (q * s) rounded to bf16 is up to 2^-8 off per element, and on an output column whose errors happen to
# line up that reaches ~1.3% of the output's rms (conformance's 300 x 256 x 272 e4m3 case on H100,
# 2026-12-07), past v6's 1% + 1%. An f32 output keeps the tight q/f32 bound: libraries take exact paths for it.
TOLERANCES_V7: dict[str, dict[str, Tol]] = {
    **TOLERANCES_V6,
    "linear":           {**TOLERANCES_V6["linear"], "q/bf16": _BF16_CHAINED},
}

SAMPLE_BOUNDARY_EPS = 1e-5
ROUTER_TIE_EPS = 1e-5
# indexer_topk: two entries' scores tie when they differ by at most this times the sum of their terms'
# magnitudes, scale * sum_h |w_h| * sum_i |q_hi * k_i|: accumulating Di products and NI heads in f32
# moves a score by at most about (Di + NI) * 2^-24 of that (1.1e-5 for V4's 128 and 64), typically far less
INDEXER_TIE_EPS = 1e-5

TOLERANCES_VERSION = "v7"
CURRENT = TOLERANCES_V7


def lookup(op: str, key: str, table: dict | None = None) -> Tol:
    table = CURRENT if table is None else table
    per_op = table[op]
    if key in per_op:
        return per_op[key]
    if key.startswith("q/") and key[2:] in per_op:
        return per_op[key[2:]]
    raise KeyError(f"tolerance table {TOLERANCES_VERSION} has no entry {op}/{key}")


def table_as_dict(table: dict | None = None) -> dict:
    table = CURRENT if table is None else table
    return {op: {k: t.as_dict() for k, t in d.items()} for op, d in table.items()}
