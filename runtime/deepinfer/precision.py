"""The precision choice of `run` / `load` (EngineConfig.precision).

Inputs: what the backend can run (its answer to op_query for `linear` with tiny concrete
descriptors of each weight format), how much memory the weights may take, how many bytes the
model's weights need in each precision, and the precision the checkpoint is stored in. Output: a
precision and a reason string the engine prints.

  "auto"     (the default) keeps the stored precision (bf16 weights stay bf16, an fp8 / int8 / int4
             checkpoint runs as stored) whenever the backend runs it and the weights fit the memory
             budget, so the default computes what the checkpoint's authors computed. Only when they
             do not fit (or the backend cannot run them) does it take the most accurate path that
             fits, ranked by the measured accuracy cost in ACCURACY_COSTS; the reason of a lossy
             choice quotes that cost.
  "fastest"  the fastest path the backend runs whose weights fit, per SPEED_ORDER below.
  a format   forced: checked the same way; one the backend cannot run is an error naming the op
             and the format.

Speed order per device (fastest first; measured by benchmarks/bench_cpu_formats.py on the CPU):
  cpu:  w4a8 (only with VNNI, int8 dot products) > int4 > w8a8 (VNNI) > int8 > fp8 > bf16 > f32
  cuda / rocm: fp8 > int4 > int8 > bf16 > f32
fp8 on the CPU and int8 on a GPU are never picked for a float checkpoint (a faster format of the
same size comes first); they are there so an fp8 / int8 checkpoint runs as stored instead of being
dequantized to twice or four times the bytes.
Decode is bound by weight reads, so fewer bytes per weight is faster wherever a kernel exists.
A format the backend reports as SLOW (a correct fallback) is tried only after every fast one.

Everything here is a pure function of its arguments except `backend_capabilities` (which asks the
backend), `memory_budget` (which reads /proc/meminfo or the backend's attributes) and
`accuracy_costs` (which reads the packaged table once).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from . import abi
from . import quant_formats as QF
from .errors import ConfigError
from .host_memory import meminfo_available
from .model.expert_cache import ExpertCacheConfig
from .tensor import Quant, Tensor

SPEED_ORDER = {
    "cpu": ("w4a8", "int4", "w8a8", "int8", "fp8", "bf16", "f32"),
    "cuda": ("fp8", "int4", "int8", "bf16", "f32"),
    "rocm": ("fp8", "int4", "int8", "bf16", "f32"),
}
GENERIC_ORDER = ("fp8", "int4", "int8", "bf16", "f32")
VNNI_ONLY = ("w4a8", "w8a8")       # without int8 dot-product instructions these lose to int4 / int8
ALL_PRECISIONS = tuple(QF.PRECISION_PATHS)
POLICIES = ("auto", "fastest")
# The measured accuracy of each path (tools/accuracy_table.py writes it from
# benchmarks/results/accuracy_nano.json): held-out perplexity change and top-1 agreement against
# the bf16 weights of the embedded model.
ACCURACY_COSTS = Path(__file__).resolve().parent / "assets" / "accuracy_costs.json"
PROBE_M, PROBE_N, PROBE_K = 2, 256, 256   # tiny, but two fp8 blocks and several int4 groups per row


@dataclass(frozen=True)
class Probe:
    """The linear call a precision makes: activation format and weight format."""

    x: str            # "f32", "bf16" or "int8" (per-token int8 activations)
    w: str            # "f32", "bf16", "int8", "int4", "uint4", "fp8", "fp4" (e2m1 group 32, e8m0 scales)

    def describe(self, group: int) -> str:
        w = {"int8": "int8 per channel (block 1,0)", "int4": f"int4 sym group {group} (block 1,{group})",
             "uint4": f"uint4 asym group {group}", "fp8": "fp8 e4m3 block 128x128",
             "fp4": f"fp4 e2m1 group {QF.FP4_GROUP} with e8m0 scales (block 1,{QF.FP4_GROUP})"}.get(self.w, self.w)
        x = "int8 per-token activations" if self.x == "int8" else f"{self.x} activations"
        return f"weights {w}, {x}"


def probe_for(precision: str, activation_dtype: str = "f32", symmetric: bool = True) -> Probe:
    if precision not in ALL_PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {ALL_PRECISIONS}")
    if precision == "w8a8":
        return Probe("int8", "int8")
    if precision == "w4a8":
        return Probe("int8", "int4")
    if precision == "int4" and not symmetric:
        return Probe(activation_dtype, "uint4")
    return Probe(activation_dtype, precision)


def _probe_tensors(p: Probe, group: int, scale_dtype: str = "f32") -> dict:
    """Host tensors of the probe call (tiny: a few tens of KB)."""
    m, n, k = PROBE_M, PROBE_N, PROBE_K
    if p.x == "int8":
        x = Tensor.from_numpy(np.zeros((m, k), np.int8), "int8",
                              quant=Quant(Tensor.from_numpy(np.ones((m, 1), np.float32)), (1, 0)))
    else:
        x = Tensor.empty((m, k), p.x, fill=0)
    if p.w in ("f32", "bf16"):
        w = Tensor.empty((n, k), p.w, fill=0)
    elif p.w == "int8":
        w = Tensor.from_numpy(np.zeros((n, k), np.int8), "int8",
                              quant=Quant(Tensor.from_numpy(np.ones((n, 1), np.float32)), (1, 0)))
    elif p.w in ("int4", "uint4"):
        g = math.ceil(k / group)
        scales = Tensor.empty((n, g), scale_dtype, fill=1)
        zeros = Tensor.from_numpy(np.full((n, g), 8, np.uint8)) if p.w == "uint4" else None
        w = Tensor(np.zeros((n, k // 2), np.uint8), (n, k), p.w, quant=Quant(scales, (1, group), zeros))
    elif p.w == "fp8":
        w = Tensor.empty((n, k), "e4m3", fill=0)
        w.quant = Quant(Tensor.from_numpy(np.ones((n // 128, k // 128), np.float32)), (128, 128))
    elif p.w == "fp4":
        g = QF.FP4_GROUP
        scales = Tensor.from_numpy(np.ones((n, k // g), np.float32), "e8m0")
        w = Tensor(np.zeros((n, k // 2), np.uint8), (n, k), "e2m1", quant=Quant(scales, (1, g)))
    else:
        raise ValueError(f"no probe for weight format {p.w!r}")
    out_dtype = "bf16" if p.x == "bf16" else "f32"
    return dict(x=x, w=w, out=Tensor.empty((m, n), out_dtype, fill=0))


def backend_capabilities(backend, group_size: int = 64, activation_dtype: Optional[str] = None,
                         symmetric: bool = True, precisions=ALL_PRECISIONS, scale_dtype: str = "f32",
                         fp4_experts: bool = False) -> dict[str, int]:
    """{precision: abi.SUPPORT_NO / YES / SLOW} from the backend's op_query of `linear`.

    Paths with int8 activations also need the `quantize` op (activations are quantized per token
    at run time). With `fp4_experts` (a DeepSeek V4 checkpoint whose routed experts are fp4 e2m1)
    the fp8 path (the checkpoint as stored) also needs e2m1 weights with e8m0 group-32 scales; it
    gets the weaker of the two answers. A backend that raises on a query (it should answer NO)
    counts as NO.
    """
    act = activation_dtype or default_activation_dtype(backend)
    caps = {}
    for prec in precisions:
        p = probe_for(prec, act, symmetric)
        if not backend.has_op("linear") or (p.x == "int8" and not backend.has_op("quantize")):
            caps[prec] = abi.SUPPORT_NO
            continue
        probes = [p] + ([Probe(p.x, "fp4")] if fp4_experts and prec == "fp8" else [])
        answers = [_query(backend, q, group_size, scale_dtype) for q in probes]
        caps[prec] = abi.SUPPORT_NO if abi.SUPPORT_NO in answers else \
            abi.SUPPORT_SLOW if abi.SUPPORT_SLOW in answers else abi.SUPPORT_YES
    return caps


def _query(backend, p: Probe, group_size: int, scale_dtype: str) -> int:
    try:
        args = {k: backend.upload(v) for k, v in _probe_tensors(p, group_size, scale_dtype).items()}
        support, _ = backend.query("linear", **args)
    except Exception:  # a query must not fail for an unsupported request; treat a failure as NO
        support = abi.SUPPORT_NO
    return int(support)


def default_activation_dtype(backend) -> str:
    return "f32" if getattr(backend, "device", "cpu") == "cpu" else "bf16"


def has_vnni(backend=None, cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Int8 dot products (AVX512-VNNI or AVX-VNNI), from the backend's `cpu.features` attribute or
    the kernel's CPU flags."""
    attrs = getattr(getattr(backend, "info", None), "attributes", None) or {}
    feats = attrs.get("cpu.features")
    if feats is not None:
        return any(f in feats.replace("_", "").split() for f in ("avx512vnni", "avxvnni"))
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return "avx512_vnni" in flags or "avx_vnni" in flags
    except OSError:
        pass
    return False


# ---------------------------------------------------------------------------- memory


def memory_budget(backend=None, configured: Optional[int] = None, meminfo_path: str = "/proc/meminfo") -> tuple[int, str]:
    """(bytes the weights may use, where the number comes from)."""
    if configured is not None:
        if not isinstance(configured, int) or configured <= 0:
            raise ConfigError(f"memory_budget_bytes must be a positive integer, not {configured!r}")
        return configured, "memory_budget_bytes from the config"
    device = getattr(backend, "device", "cpu")
    if device == "cpu":
        avail = meminfo_available(meminfo_path)
        if avail is not None:
            return avail, "MemAvailable in /proc/meminfo"
    attrs = getattr(getattr(backend, "info", None), "attributes", None) or {}
    for key in ("device.memory_free_bytes", "device.memory_bytes"):
        v = attrs.get(key)
        if v is not None:
            try:
                # total memory: leave a tenth for the KV cache, activations and the runtime
                return int(int(v) * (1.0 if key.endswith("free_bytes") else 0.9)), f"{key} of the backend"
            except ValueError:
                pass
    raise ConfigError(f"cannot tell how much memory backend {getattr(backend, 'name', '?')!r} has; "
                      f"set memory_budget_bytes in the engine config")


def weight_bytes(shapes: Mapping[str, tuple], precision: str, group_size: int = 64, symmetric: bool = True,
                 kept_bytes_per_element: int = 2, fp4_experts: bool = False) -> int:
    """Bytes of every tensor of a model ({name: shape}) when loaded at `precision`: quantizable
    linears in the precision's weight format, everything else (embeddings, norms, router, lm_head)
    at `kept_bytes_per_element` (4 for f32 precision). `fp4_experts`: the checkpoint's fp8 holds
    its routed experts in fp4 (DeepSeek V4), so at fp8 (as stored) they count as fp4."""
    total = 0
    kept = 4 if precision == "f32" else kept_bytes_per_element
    for name, shape in shapes.items():
        if QF.is_quantizable(name, shape):
            fmt = "fp4" if fp4_experts and precision == "fp8" and QF.is_routed_expert(name) else precision
            total += QF.weight_nbytes(shape, fmt, group_size, symmetric)
        else:
            total += math.prod(shape) * kept
    return total


def resident_weight_bytes(shapes: Mapping[str, tuple], precision: str, expert_cache, group_size: int = 64,
                          symmetric: bool = True, kept_bytes_per_element: int = 2, fp4_experts: bool = False) -> int:
    """weight_bytes with an expert cache (model.expert_cache): every tensor but the routed experts,
    plus what the cache allocates for them at this precision (a capacity fraction of each layer's
    experts plus the shared overflow, at most experts - slots of one layer; a byte capacity as given).
    What must fit the memory budget when the experts stream, so that `auto` keeps the checkpoint's
    precision for a model whose experts do not fit."""
    ec = ExpertCacheConfig.parse(expert_cache)
    experts = {n: sh for n, sh in shapes.items() if ".mlp.experts." in n}
    rest = {n: sh for n, sh in shapes.items() if n not in experts}
    total = weight_bytes(experts, precision, group_size, symmetric, kept_bytes_per_element, fp4_experts)
    if not experts or total == 0:
        return weight_bytes(rest, precision, group_size, symmetric, kept_bytes_per_element, fp4_experts)
    layers = {n.split(".mlp.experts.")[0] for n in experts}
    E = len({(n.split(".mlp.experts.")[1].split(".")[0]) for n in experts})
    if isinstance(ec.capacity, float):
        n = min(E, max(1, round(ec.capacity * E)))
        cache = total * n // E + (total // max(len(layers), 1)) * (E - n) // E
    else:
        cache = min(int(ec.capacity), total + total // max(len(layers), 1))
    return weight_bytes(rest, precision, group_size, symmetric, kept_bytes_per_element, fp4_experts) + cache


# ---------------------------------------------------------------------------- accuracy


@functools.lru_cache(maxsize=4)
def accuracy_costs(path: Path = ACCURACY_COSTS) -> dict:
    """The packaged accuracy table: {"source": ..., "paths": [{precision, group, ppl_change_pct,
    top1_agreement}]}; an empty table when the file is missing (a source tree without assets)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {"source": None, "paths": []}


def accuracy_cost(precision: str, group_size: int = 64, table: Optional[dict] = None) -> Optional[dict]:
    """The measured row of a precision (int4 / w4a8: the row of this group size, else the nearest
    measured group, flagged by its own `group`); None when it was never measured."""
    rows = [r for r in (table or accuracy_costs())["paths"] if r["precision"] == precision]
    if not rows:
        return None
    return min(rows, key=lambda r: abs((r.get("group") or group_size) - group_size))


def describe_cost(precision: str, group_size: int = 64, table: Optional[dict] = None) -> str:
    table = table or accuracy_costs()
    r = accuracy_cost(precision, group_size, table)
    if r is None:
        return f"accuracy cost of {precision} not measured"
    g = f" at group {r['group']}" if r.get("group") and r["group"] != group_size else ""
    return (f"measured cost{g}: perplexity {r['ppl_change_pct']:+.2f}%, top-1 agreement "
            f"{100 * r['top1_agreement']:.1f}% vs bf16 weights ({table.get('source') or 'accuracy table'})")


def accuracy_order(precisions, group_size: int = 64, table: Optional[dict] = None) -> list[str]:
    """Most accurate first: by measured top-1 agreement, then perplexity change, then more bytes
    per weight (f32 before bf16, which the bf16-stored reference model cannot tell apart);
    unmeasured precisions last, widest first."""
    width = {n: p.bytes_per_weight for n, p in QF.PRECISION_PATHS.items()}

    def key(p):
        r = accuracy_cost(p, group_size, table)
        if r is None:
            return (1, 0.0, 0.0, -width.get(p, 0))
        return (0, -r["top1_agreement"], abs(r["ppl_change_pct"]), -width.get(p, 0))

    return sorted(precisions, key=key)


def stored_precision(entries: Mapping[str, tuple], scheme=None) -> tuple[str, str]:
    """(precision that reproduces the checkpoint as stored, what it is stored as), from the
    checkpoint's {name: (dtype, shape)}: a quantized checkpoint's own format; for float weights
    the dtype of its linear weights (f16 and mixed widths map to f32, which holds them exactly)."""
    scheme = QF.parse_quantization_config(scheme)
    if scheme is not None:
        return scheme.format, scheme.describe()
    dts = {np.dtype(dt).name for name, (dt, shape) in entries.items() if QF.is_quantizable(name, tuple(shape))}
    if dts == {"bfloat16"}:
        return "bf16", "bf16"
    if dts == {"float32"} or not dts:
        return "f32", "f32"
    return "f32", "+".join(sorted(dts))


# ---------------------------------------------------------------------------- the choice


def speed_order(device: str, vnni: bool) -> tuple[str, ...]:
    order = SPEED_ORDER.get(device, GENERIC_ORDER)
    if device == "cpu" and not vnni:
        # without VNNI the a8 paths are emulated with wider multiplies: try them after their a32 twins
        order = tuple(p for p in order if p not in VNNI_ONLY) + tuple(p for p in order if p in VNNI_ONLY)
    return order


def _gb(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def choose_precision(caps: Mapping[str, int], sizes: Mapping[str, int], budget: int, device: str = "cpu",
                     vnni: bool = False, forced: Optional[str] = None, allowed=None, group_size: int = 64,
                     activation_dtype: str = "f32", backend_name: str = "backend",
                     budget_source: str = "budget", policy: str = "auto", stored: Optional[str] = None,
                     stored_as: Optional[str] = None, costs: Optional[dict] = None) -> tuple[str, str]:
    """(precision, reason). Pure: caps from backend_capabilities, sizes {precision: weight bytes},
    budget in bytes. `allowed` limits the candidates (what the checkpoint can be turned into);
    `stored` is the precision that reproduces the checkpoint (stored_precision), which "auto"
    keeps when it can; `costs` the accuracy table (default: the packaged one)."""
    if forced in POLICIES:
        policy, forced = forced, None
    if policy not in POLICIES:
        raise ConfigError(f"precision policy {policy!r} is not one of {POLICIES}")
    order = [p for p in speed_order(device, vnni) if allowed is None or p in allowed]
    if forced is not None:
        if forced not in ALL_PRECISIONS:
            raise ConfigError(f"precision {forced!r} is not one of {POLICIES + ALL_PRECISIONS}")
        if allowed is not None and forced not in allowed:
            raise ConfigError(f"precision {forced!r} cannot be made from this checkpoint (it can give: "
                              f"{', '.join(allowed)})")
        support = caps.get(forced, abi.SUPPORT_NO)
        if support == abi.SUPPORT_NO:
            probe = probe_for(forced, activation_dtype)
            runnable = [p for p in order if caps.get(p, abi.SUPPORT_NO) != abi.SUPPORT_NO]
            raise ConfigError(f"precision {forced!r}: backend {backend_name!r} cannot run op linear with "
                              f"{probe.describe(group_size)} (op_query says NO); it can run: "
                              f"{', '.join(runnable) or 'none'}")
        need = sizes.get(forced)
        note = "" if need is None or need <= budget else (
            f"; warning: its weights ({_gb(need)}) exceed the {budget_source} ({_gb(budget)})")
        slow = " (the backend marks this path SLOW)" if support == abi.SUPPORT_SLOW else ""
        return forced, f"precision {forced} forced by the config{slow}{note}{_lossy_note(forced, stored, group_size, costs)}"

    runnable = [p for p in order if caps.get(p, abi.SUPPORT_NO) != abi.SUPPORT_NO]
    if not runnable:
        raise ConfigError(f"backend {backend_name!r} cannot run op linear in any precision of "
                          f"{', '.join(order) or '(none allowed)'}")
    fast = [p for p in runnable if caps[p] == abi.SUPPORT_YES]
    slow = [p for p in runnable if caps[p] == abi.SUPPORT_SLOW]
    if policy == "fastest":
        ranked, what = fast + slow, f"the fastest {device} path backend {backend_name!r} runs whose weights fit"
    else:
        # accuracy first; among equally accurate paths a fast one before a SLOW one
        ranked = accuracy_order(runnable, group_size, costs)
        if stored in ranked:
            ranked = [stored] + [p for p in ranked if p != stored]
        ranked = [p for p in ranked if caps[p] == abi.SUPPORT_YES or p == stored] + \
                 [p for p in ranked if caps[p] == abi.SUPPORT_SLOW and p != stored]
        what = "the most accurate path that fits"
    skipped = []
    if policy == "auto" and stored is not None and stored not in runnable:
        skipped.append(f"the stored {stored} ({backend_name!r} cannot run it)")
    for p in ranked:
        need = sizes.get(p)
        if need is None:
            continue
        if need <= budget:
            fits = f"({_gb(need)} of {_gb(budget)}, {budget_source})"
            if policy == "auto" and p == stored:
                why = f"precision {p}: the checkpoint's own precision ({stored_as or stored}); its weights fit {fits}"
            elif policy == "auto" and stored is not None and p == "f32" and stored in ("bf16", "f32"):
                why = f"precision f32: holds the stored {stored_as or stored} weights exactly; they fit {fits}"
            else:
                why = f"precision {p}: {what} {fits}"
            if skipped:
                why += "; skipped " + ", ".join(skipped)
            if caps[p] == abi.SUPPORT_SLOW:
                why += " (a path the backend marks SLOW)"
            return p, why + _lossy_note(p, stored, group_size, costs)
        skipped.append(f"{p} ({_gb(need)} does not fit)")
    smallest = min((p for p in ranked if p in sizes), key=lambda p: sizes[p], default=None)
    if smallest is None:
        raise ConfigError("no weight sizes were given for any runnable precision")
    return smallest, (f"precision {smallest}: nothing fits the {budget_source} ({_gb(budget)}); using the "
                      f"smallest runnable format ({_gb(sizes[smallest])}), expect paging"
                      + _lossy_note(smallest, stored, group_size, costs))


_LOSSLESS = {None: ("f32",), "f32": ("f32",), "bf16": ("bf16", "f32"), "fp8": ("fp8", "f32"),
             "int8": ("int8", "f32"), "int4": ("int4", "f32")}


def is_lossy(p: str, stored: Optional[str]) -> bool:
    """Whether precision `p` computes something other than the stored weights (None: unknown)."""
    return p not in _LOSSLESS.get(stored, ())


def _lossy_note(p: str, stored: Optional[str], group_size: int, costs: Optional[dict]) -> str:
    """For a path that changes what the stored weights compute: '; lossy (...measured cost...)'."""
    if not is_lossy(p, stored):
        return ""
    if stored in ("fp8", "int8", "int4") and p == "bf16":
        return f"; rounds the dequantized {stored} weights to bf16 (near-lossless)"
    if stored == "f32" and p == "bf16":
        return "; lossy: rounds f32 weights to bf16 (not measured: the reference model is stored in bf16)"
    return f"; lossy ({describe_cost(p, group_size, costs)})"


def producible(scheme: Optional[QF.QuantScheme]) -> tuple[str, ...]:
    """The precisions a checkpoint can be loaded at without inventing precision it does not have:
    a float checkpoint gives anything (weights are quantized at load); a quantized one gives its own
    format (and its a8 twin) or, dequantized, bf16 / f32."""
    if scheme is None:
        return ALL_PRECISIONS
    own = {"int4": ("int4", "w4a8"), "int8": ("int8", "w8a8"), "fp8": ("fp8",)}[scheme.format]
    if scheme.format == "int4" and not scheme.symmetric:
        own = ("int4",)   # integer dot products have no zero point: w4a8 would re-round the weights
    return own + ("bf16", "f32")


def resolve(backend, config, shapes: Mapping[str, tuple], checkpoint_scheme=None,
            stored: Optional[tuple[str, str]] = None) -> tuple[str, str]:
    """The engine's entry: EngineConfig (precision, group_size, memory_budget_bytes,
    activation_dtype) + the model's {tensor name: logical shape} (quant_formats.logical_shapes of
    the checkpoint) + its quantization_config + (stored precision, what it is stored as) from
    stored_precision -> (precision, reason)."""
    scheme = QF.parse_quantization_config(checkpoint_scheme)
    group = scheme.group_size if scheme is not None and scheme.format == "int4" else config.group_size
    symmetric = scheme.symmetric if scheme is not None and scheme.format == "int4" else True
    scale_dtype = scheme.scale_dtype if scheme is not None and scheme.format == "int4" else "f32"
    act = config.activation_dtype if config.activation_dtype != "auto" else default_activation_dtype(backend)
    allowed = producible(scheme)
    fp4 = scheme is not None and scheme.fp4_experts
    caps = backend_capabilities(backend, group, act, symmetric, precisions=allowed, scale_dtype=scale_dtype,
                                fp4_experts=fp4)
    forced = config.precision if config.precision not in POLICIES else None
    policy = config.precision if config.precision in POLICIES else "auto"
    if stored is None:   # unknown for a float checkpoint: no preference, the most accurate path first
        stored = (scheme.format, scheme.describe()) if scheme is not None else (None, None)
    # weights that stay plain (embeddings, norms, router, lm_head) are held in the activation dtype
    kept = 4 if act == "f32" else 2
    ec = getattr(config, "expert_cache", None)

    def size(p: str) -> int:
        if ec is None:
            return weight_bytes(shapes, p, group, symmetric, kept, fp4)
        return resident_weight_bytes(shapes, p, ec, group, symmetric, kept, fp4)

    if forced is not None:
        sizes = {forced: size(forced)}
        budget, source = (config.memory_budget_bytes, "memory_budget_bytes") if config.memory_budget_bytes \
            else (2**62, "unknown budget")
    else:
        sizes = {p: size(p) for p in allowed}
        budget, source = memory_budget(backend, config.memory_budget_bytes)
    precision, reason = choose_precision(caps, sizes, budget, device=backend.device, vnni=has_vnni(backend),
                                         forced=forced, allowed=allowed, group_size=group, activation_dtype=act,
                                         backend_name=backend.name, budget_source=source, policy=policy,
                                         stored=stored[0], stored_as=stored[1])
    if ec is not None:
        reason += " (routed experts counted at what the expert cache holds)"
    return precision, reason
