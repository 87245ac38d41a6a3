"""How quantized weights are stored on disk, and how they become deepinfer Tensors with a Quant.

This is the one place that knows the checkpoint formats; the model loader and the quantizer both
go through it. Two families are read (`config.json` -> `quantization_config`):

* The official DeepSeek FP8 release:
  `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`.
  `X.weight` is e4m3 [N, K] and `X.weight_scale_inv` one f32 per 128x128 block; the scale
  multiplies (real = q * scale_inv), so it becomes Quant(scales, (128, 128)) as is.
  Weights the release keeps in bf16 simply have no `_scale_inv`.

  DeepSeek V4 adds two keys (transformers' FineGrainedFP8Config has both):
  - `"scale_fmt": "ue8m0"`: the block scales are powers of two stored in one byte, safetensors
    dtype F8_E8M0 (float8_e8m0fnu; a checkpoint may also hold the raw bytes as U8). The fp8_block
    format of the ABI takes f32 scales, so these are widened (exactly) on load.
  - `"expert_dtype": "fp4"` (V4-Flash writes it at the top level of config.json, next to
    quantization_config; transformers moves it inside, see quantization_config_of): the routed
    experts are e2m1, stored as I8 [N, K/2] with two elements per byte, element 2i in the low
    nibble (DeepSeek's inference/convert.py and transformers' Fp8Dequantize unpack `b & 0xF`
    first; torch's float4_e2m1fn_x2 documents val0 in bits 0..3), which is the ABI's own
    DI_NIBBLE_LOW_FIRST, so the bytes are used as they lie on disk. Their `X.weight_scale_inv`
    (DeepSeek's own layout: `X.scale`, renamed by model.v4_names) is one F8_E8M0 per row and 32
    columns [N, K/32]: Quant(scales e8m0, (1, 32)), the ABI's fp4_g32 format, consumed as is.
    A weight of these checkpoints without a scale (V4's compressor and indexer kv_proj /
    gate_proj, the indexer's weights_proj: BF16) stays float.

* Our own `"quant_method": "deepinfer"` (written by `deepinfer quantize`):

      {"quant_method": "deepinfer", "format": "int8" | "int4" | "fp8",
       "group_size": 64, "symmetric": true, "scale_dtype": "f32",
       "modules_not_converted": ["lm_head", "embed_tokens", "mlp.gate", ...]}

  - int8 per output channel: `X.weight` int8 [N, K], `X.weight_scale` f32 [N, 1]
    -> Quant(scales [N, 1], block (1, 0)).
  - int4 group-wise: `X.weight` uint8 [N, ceil(K/2)] holding two 4-bit codes per byte, element
    2i in the low nibble of byte i (the ABI's own packing, so the bytes are used as they lie on
    disk); `X.weight_scale` f32 or bf16 [N, ceil(K/g)]. Symmetric: the codes are int4 two's
    complement in [-7, 7]. Asymmetric (`symmetric: false`): the codes are uint4 in [0, 15] and
    `X.weight_zero` uint8 [N, ceil(K/g)] holds the zero points; real = (q - zero) * scale.
    A packed row cannot say whether K is odd, so for odd K the quantizer also writes
    `X.weight_shape` (int64 [2] = [N, K]); a loader that knows the shape may pass it instead.
  - fp8 (`format: fp8`): exactly the official layout (`X.weight` e4m3 + `X.weight_scale_inv`).

Which weights are quantized is decided by what lies on disk (an e4m3 / int8 / uint8 weight with
its scale tensor); `modules_not_converted` documents what was left in high precision and lets
`is_converted()` answer the same question before a tensor is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import abi
from . import dtypes as D
from .errors import CheckpointError
from .tensor import Quant, Tensor, pack_4bit

# from the format table of deepinfer_abi.h (DI_FORMATS, DI_GROUP_SIZES)
FP8_BLOCK = next((f.block_rows, f.block_cols) for f in abi.FORMATS if f.name == "fp8_block")
GROUP_SIZES = abi.GROUP_SIZES
FORMATS = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class PrecisionPath:
    """One precision the engine runs: how its quantizable linears store weights and take activations."""

    name: str
    weights: str             # f32, bf16, fp8, int8, int4
    activations: str         # "float" (the model's f32/bf16) or "int8" (quantized per token at run time)
    bytes_per_weight: float  # of the quantizable weights, scales aside


# The one registry of precision names (EngineConfig.precision, precision.resolve, the model loader).
PRECISION_PATHS: dict[str, PrecisionPath] = {p.name: p for p in (
    PrecisionPath("f32", "f32", "float", 4),
    PrecisionPath("bf16", "bf16", "float", 2),
    PrecisionPath("fp8", "fp8", "float", 1),
    PrecisionPath("int8", "int8", "float", 1),
    PrecisionPath("int4", "int4", "float", 0.5),
    PrecisionPath("w8a8", "int8", "int8", 1),
    PrecisionPath("w4a8", "int4", "int8", 0.5),
)}


def weight_format_of(precision: Optional[str]) -> Optional[str]:
    """The weight storage of a precision path (None: as stored); a bare format name maps to itself."""
    if precision is None:
        return None
    p = PRECISION_PATHS.get(precision)
    return p.weights if p is not None else precision


# Linear layers of attention, MLP / experts and the MTP projection; everything else stays high precision.
# V4 adds kv_proj and the grouped output projection o_a_proj / o_b_proj; its compressors' kv_proj and
# gate_proj stay high precision (DeepSeek ships them in BF16), see is_quantizable.
QUANTIZED_LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                     "gate_proj", "up_proj", "down_proj", "eh_proj", "kv_proj", "o_a_proj", "o_b_proj")
# (parent module, linear) pairs that are never quantized: V4's compressor / indexer projections
NOT_QUANTIZED = {("compressor", "kv_proj"), ("compressor", "gate_proj"), ("indexer", "kv_proj"),
                 ("indexer", "gate_proj")}
# the ABI's fp4 e2m1 format DeepSeek V4's routed experts use: one e8m0 scale per row and 32 columns
FP4_GROUP = 32
FP4_GROUPS = tuple(f.block_cols for f in abi.FORMATS if f.q_dtype == "e2m1")    # (16, 32)
# What `deepinfer quantize` leaves in high precision (matched as whole dotted components).
DEFAULT_NOT_CONVERTED = ("lm_head", "embed_tokens", "mlp.gate", "shared_head", "norm", "layernorm",
                         "e_score_correction_bias")

_CONFIG_KEYS = {
    # DeepSeek's release keys, plus what transformers' FineGrainedFP8Config writes when it saves an fp8
    # model (dequantize, modules_to_convert, modules_to_not_convert; scale_fmt "float")
    "fp8": {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "modules_not_converted",
            "ignored_layers", "dequantize", "modules_to_convert", "modules_to_not_convert", "expert_dtype"},
    "deepinfer": {"quant_method", "format", "group_size", "symmetric", "scale_dtype", "modules_not_converted",
                  "weight_block_size", "calibration", "source"},
}


@dataclass(frozen=True)
class QuantScheme:
    """A parsed, validated quantization_config."""

    method: str                        # "fp8" (official) or "deepinfer"
    format: str                        # "fp8", "int8" or "int4"
    group_size: int = 64               # int4 only
    symmetric: bool = True             # int4 only (int8 and fp8 are always symmetric)
    scale_dtype: str = "f32"           # int4 scales: f32 or bf16
    block: tuple = FP8_BLOCK           # fp8 only
    modules_not_converted: tuple = field(default=())
    scale_fmt: str = "float"           # official fp8: "float" (f32 block scales) or "ue8m0" (powers of two, 1 byte)
    expert_dtype: str = "fp8"          # official fp8: routed experts "fp8" or "fp4" (e2m1, DeepSeek V4)

    @property
    def fp4_experts(self) -> bool:
        """The routed experts are stored as fp4 e2m1 (DeepSeek V4-Flash / Pro)."""
        return self.method == "fp8" and self.expert_dtype == "fp4"

    def to_config(self) -> dict:
        """The quantization_config dict that `parse_quantization_config` reads back to this scheme."""
        if self.method == "fp8":
            cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(self.block), "modules_not_converted": list(self.modules_not_converted)}
            if self.scale_fmt != "float":
                cfg["scale_fmt"] = self.scale_fmt
            if self.expert_dtype != "fp8":
                cfg["expert_dtype"] = self.expert_dtype
            return cfg
        cfg = {"quant_method": "deepinfer", "format": self.format, "modules_not_converted": list(self.modules_not_converted)}
        if self.format == "int4":
            cfg.update(group_size=self.group_size, symmetric=self.symmetric, scale_dtype=self.scale_dtype)
        elif self.format == "int8":
            cfg.update(symmetric=True, scale_dtype="f32")
        else:
            cfg.update(weight_block_size=list(self.block), symmetric=True, scale_dtype="f32")
        return cfg

    def describe(self) -> str:
        if self.format == "int4":
            return f"int4 g{self.group_size} {'sym' if self.symmetric else 'asym'} ({self.scale_dtype} scales)"
        if self.format == "int8":
            return "int8 per channel"
        s = f"fp8 e4m3 block {self.block[0]}x{self.block[1]}"
        if self.scale_fmt == "ue8m0":
            s += " (ue8m0 scales)"
        if self.fp4_experts:
            s += f", routed experts fp4 e2m1 group {FP4_GROUP}"
            s += " (ue8m0 scales)" if self.scale_fmt == "ue8m0" else ""
        return s


def quantization_config_of(config: dict) -> Optional[dict]:
    """config.json's quantization_config with the keys DeepSeek writes beside it folded in:
    DeepSeek-V4-Flash has `"expert_dtype": "fp4"` at the top level (transformers'
    DeepseekV4Config moves it into quantization_config the same way). A key already inside wins."""
    qc = config.get("quantization_config")
    top = config.get("expert_dtype")
    if isinstance(qc, dict) and top is not None and "expert_dtype" not in qc and qc.get("quant_method") == "fp8":
        qc = {**qc, "expert_dtype": top}
    return qc


def make_scheme(format: str, group_size: int = 64, symmetric: bool = True, scale_dtype: str = "f32",
                modules_not_converted=DEFAULT_NOT_CONVERTED) -> QuantScheme:
    """The scheme `deepinfer quantize --format F [--group N] [--asym]` writes (always quant_method deepinfer)."""
    return parse_quantization_config({
        "quant_method": "deepinfer", "format": format, "group_size": group_size, "symmetric": symmetric,
        "scale_dtype": scale_dtype, "modules_not_converted": list(modules_not_converted)})


def parse_quantization_config(qc: Optional[dict], source: str = "quantization_config") -> Optional[QuantScheme]:
    """Validates a config.json `quantization_config`; None (not quantized) stays None.

    Raises CheckpointError naming the bad key, so a typo in a hand-edited config is caught at load.
    """
    if qc is None:
        return None
    if isinstance(qc, QuantScheme):
        return qc
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source} must be a JSON object, not {type(qc).__name__}")
    method = qc.get("quant_method")
    if not isinstance(method, str) or method not in _CONFIG_KEYS:
        raise CheckpointError(f"{source}.quant_method={method!r} is not supported; deepinfer reads "
                              f"'fp8' (the official DeepSeek release) and 'deepinfer' (deepinfer quantize)")
    unknown = sorted(set(qc) - _CONFIG_KEYS[method])
    if unknown:
        raise CheckpointError(f"{source}: unknown key(s) {unknown} for quant_method {method!r}; "
                              f"valid: {sorted(_CONFIG_KEYS[method])}")
    # which weights are quantized is read from the checkpoint itself (dtype and scale tensors); these
    # lists matter to `deepinfer quantize`, which writes modules_not_converted
    mnc = qc.get("modules_not_converted") or qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    if not isinstance(mnc, (list, tuple)) or not all(isinstance(m, str) for m in mnc):
        raise CheckpointError(f"{source}.modules_not_converted must be a list of module names")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{source}.fmt={fmt!r}: only e4m3 fp8 weights are supported")
        act = qc.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise CheckpointError(f"{source}.activation_scheme={act!r}: only dynamic activation scales are supported")
        sf = qc.get("scale_fmt")
        if sf not in (None, "float", "ue8m0"):
            raise CheckpointError(f"{source}.scale_fmt={sf!r}: expected 'float' or 'ue8m0'")
        ed = qc.get("expert_dtype")
        if ed not in (None, "fp8", "fp4"):
            raise CheckpointError(f"{source}.expert_dtype={ed!r}: expected 'fp8' or 'fp4'")
        mc = qc.get("modules_to_convert")
        if mc is not None and (not isinstance(mc, (list, tuple)) or not all(isinstance(m, str) for m in mc)):
            raise CheckpointError(f"{source}.modules_to_convert must be null or a list of module names")
        # `dequantize` is transformers' load option (fp8 weights widened at load); the values are the
        # same e4m3 x scale products either way, so it does not change what is computed
        if not isinstance(qc.get("dequantize", False), bool):
            raise CheckpointError(f"{source}.dequantize must be true or false")
        return QuantScheme("fp8", "fp8", block=_block(qc, source), modules_not_converted=tuple(mnc),
                           scale_fmt=sf or "float", expert_dtype=ed or "fp8")
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise CheckpointError(f"{source}.format={fmt!r} must be one of {FORMATS}")
    sym = qc.get("symmetric", True)
    if not isinstance(sym, bool):
        raise CheckpointError(f"{source}.symmetric must be true or false, not {sym!r}")
    if not sym and fmt != "int4":
        raise CheckpointError(f"{source}: asymmetric quantization exists for int4 only, not {fmt}")
    sdt = qc.get("scale_dtype", "f32")
    if sdt not in ("f32", "bf16") or (fmt != "int4" and sdt != "f32"):
        raise CheckpointError(f"{source}.scale_dtype={sdt!r}: int4 takes f32 or bf16 scales, int8 and fp8 f32")
    g = qc.get("group_size", 64)
    if fmt == "int4" and (not isinstance(g, int) or isinstance(g, bool) or g not in GROUP_SIZES):
        raise CheckpointError(f"{source}.group_size={g!r} must be one of {GROUP_SIZES}")
    block = _block(qc, source) if fmt == "fp8" else FP8_BLOCK
    return QuantScheme("deepinfer", fmt, group_size=int(g) if fmt == "int4" else 0, symmetric=sym,
                       scale_dtype=sdt, block=block, modules_not_converted=tuple(mnc))


def _block(qc: dict, source: str) -> tuple:
    wbs = qc.get("weight_block_size") or list(FP8_BLOCK)
    if (not isinstance(wbs, (list, tuple)) or len(wbs) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in wbs)):
        raise CheckpointError(f"{source}.weight_block_size={wbs!r} must be two positive integers")
    return (int(wbs[0]), int(wbs[1]))


# ---------------------------------------------------------------------------- which modules


def module_of(weight_name: str) -> str:
    """'model.layers.0.mlp.gate_proj.weight' -> 'model.layers.0.mlp.gate_proj'."""
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def matches_module(module: str, pattern: str) -> bool:
    """True when `pattern`'s dotted components occur contiguously in `module`'s, so 'mlp.gate'
    matches 'model.layers.3.mlp.gate' but not 'model.layers.3.mlp.gate_proj'."""
    m, p = module.split("."), pattern.split(".")
    return any(m[i:i + len(p)] == p for i in range(len(m) - len(p) + 1))


def is_quantizable(name: str, shape) -> bool:
    """A 2-d `.weight` of one of the QUANTIZED_LINEARS (attention, MLP, experts, MTP eh_proj), not
    one of V4's compressor / indexer projections (NOT_QUANTIZED)."""
    if not name.endswith(".weight") or len(tuple(shape)) != 2:
        return False
    parts = module_of(name).split(".")
    if parts[-1] not in QUANTIZED_LINEARS:
        return False
    return len(parts) < 2 or (parts[-2], parts[-1]) not in NOT_QUANTIZED


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight ('...mlp.experts.3.up_proj.weight'), not a shared expert's."""
    return ".mlp.experts." in name


def is_converted(name: str, scheme: Optional[QuantScheme]) -> bool:
    """Whether a checkpoint made under `scheme` stores `name` quantized (before reading it)."""
    if scheme is None or not name.endswith(".weight"):
        return False
    mod = module_of(name)
    return not any(matches_module(mod, p) for p in scheme.modules_not_converted)


# ---------------------------------------------------------------------------- reading

GetTensor = Callable[[str], np.ndarray]


def _lookup(get_tensor: GetTensor, name: str, has_tensor) -> Optional[np.ndarray]:
    if has_tensor is not None:
        return get_tensor(name) if has_tensor(name) else None
    try:
        return get_tensor(name)
    except (KeyError, CheckpointError):
        return None


def _check_shape(name: str, a: np.ndarray, want, what: str) -> None:
    if tuple(a.shape) != tuple(want):
        raise CheckpointError(f"tensor {name!r} ({what}) has shape {list(a.shape)}, expected {list(want)}")


def weight_from_checkpoint(get_tensor: GetTensor, name: str, quantization_config=None, *, shape=None,
                           has_tensor: Optional[Callable[[str], bool]] = None) -> Tensor:
    """The Tensor of a linear weight `name` ('...q_proj.weight'): plain float, or quantized.

    get_tensor(name) returns the stored array (memory-mapped is fine: nothing is copied except fp8
    scales stored in another float type); a missing name raises KeyError or CheckpointError, or
    `has_tensor` says whether it exists. `shape` is the logical [N, K] the model expects (checked;
    also resolves odd K of packed int4 rows). `quantization_config` is the config.json dict or a
    QuantScheme.
    """
    scheme = parse_quantization_config(quantization_config)
    w = _lookup(get_tensor, name, has_tensor)
    if w is None:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    w = np.asarray(w)

    if w.dtype == D.e4m3.np:
        block = scheme.block if scheme is not None else FP8_BLOCK
        if shape is not None:
            _check_shape(name, w, shape, "fp8 weight")
        if w.ndim != 2:
            raise CheckpointError(f"fp8 tensor {name!r} must be 2-d, has shape {list(w.shape)}")
        s = _lookup(get_tensor, name + "_scale_inv", has_tensor)
        if s is None:
            raise CheckpointError(f"fp8 tensor {name!r} has no {name + '_scale_inv'!r}")
        n, k = w.shape
        grid = (-(-n // block[0]), -(-k // block[1]))
        s = np.asarray(s)
        if tuple(s.shape) != grid and tuple(d for d in s.shape if d != 1) == tuple(d for d in grid if d != 1):
            # transformers 5's default save of fused fp8 experts writes each expert's scale grid with
            # its size-1 dims dropped ([2] for a [1, 2] grid); the order is the same, so reshape
            s = s.reshape(grid)
        _check_shape(name + "_scale_inv", s, grid, f"one scale per {block[0]}x{block[1]} block")
        s = _float_scales(name + "_scale_inv", s, scheme)
        if s.dtype != np.float32:
            # the ABI's fp8_block format takes f32 scales; bf16 / f16 / e8m0 widen exactly
            s = s.astype(np.float32)
        return Tensor.from_numpy(w, "e4m3", quant=Quant(Tensor.from_numpy(s), block))

    if w.dtype == np.int8 and scheme is not None and scheme.method == "fp8":
        return _fp4_weight(get_tensor, name, w, scheme, shape, has_tensor)

    if w.dtype == np.int8:
        if scheme is None or scheme.format != "int8":
            raise CheckpointError(f"tensor {name!r} is int8 but quantization_config does not say format int8")
        if w.ndim != 2:
            raise CheckpointError(f"int8 tensor {name!r} must be 2-d, has shape {list(w.shape)}")
        if shape is not None:
            _check_shape(name, w, shape, "int8 weight")
        s = _scale(get_tensor, name, has_tensor, (w.shape[0], 1), ("f32",))
        return Tensor.from_numpy(w, "int8", quant=Quant(Tensor.from_numpy(s), (1, 0)))

    if w.dtype == np.uint8:
        if scheme is None or scheme.format != "int4":
            raise CheckpointError(f"tensor {name!r} is uint8 (packed int4) but quantization_config does not "
                                  f"say format int4")
        if w.ndim != 2:
            raise CheckpointError(f"packed int4 tensor {name!r} must be 2-d, has shape {list(w.shape)}")
        n, kb = w.shape
        k = 2 * kb
        stored_shape = _lookup(get_tensor, name + "_shape", has_tensor)
        if stored_shape is not None:
            sn, k = (int(v) for v in np.asarray(stored_shape).reshape(-1)[:2])
            if sn != n:
                raise CheckpointError(f"{name}_shape says {sn} rows, the packed weight has {n}")
        if shape is not None:
            if int(shape[0]) != n or (int(shape[1]) + 1) // 2 != kb:
                raise CheckpointError(f"packed int4 tensor {name!r} [{n}, {kb}] bytes cannot hold a "
                                      f"[{shape[0]}, {shape[1]}] weight")
            k = int(shape[1])
        if (k + 1) // 2 != kb:
            raise CheckpointError(f"packed int4 tensor {name!r}: {kb} bytes per row cannot hold K={k}")
        g = scheme.group_size
        grid = (n, -(-k // g))
        s = _scale(get_tensor, name, has_tensor, grid, ("f32", "bf16"))
        zeros = None
        if scheme.symmetric:
            qdt = "int4"
        else:
            qdt = "uint4"
            z = _lookup(get_tensor, name + "_zero", has_tensor)
            if z is None:
                raise CheckpointError(f"asymmetric int4 tensor {name!r} has no {name + '_zero'!r}")
            _check_shape(name + "_zero", z, grid, f"one zero point per group of {g}")
            zeros = Tensor.from_numpy(np.asarray(z, dtype=np.uint8))
        # the packed bytes are the tensor's storage as they are: no unpacking, no copy
        return Tensor(np.asarray(w), (n, k), qdt, quant=Quant(Tensor.from_numpy(s), (1, g), zeros))

    if w.dtype in (np.float32, np.float16, D.bf16.np):
        if shape is not None:
            _check_shape(name, w, shape, "weight")
        return Tensor.from_numpy(w)
    raise CheckpointError(f"tensor {name!r} has dtype {w.dtype}, which is no weight format deepinfer reads")


def _float_scales(name: str, s: np.ndarray, scheme: Optional[QuantScheme]) -> np.ndarray:
    """Scales of the official fp8 format as a float array: f32 / bf16 / f16 / e8m0 as stored; U8
    is read as ue8m0 bytes (2^(b - 127)) when scale_fmt says ue8m0, as transformers does. An e8m0
    byte of 255 (NaN) is a damaged scale."""
    if s.dtype == np.uint8:
        if scheme is None or scheme.scale_fmt != "ue8m0":
            raise CheckpointError(f"tensor {name!r} holds bytes (U8); that is a ue8m0 scale only when "
                                  f"quantization_config.scale_fmt is 'ue8m0'")
        s = s.view(D.e8m0.np)
    if s.dtype == D.e8m0.np:
        if np.any(s.view(np.uint8) == 255):
            raise CheckpointError(f"tensor {name!r} holds the ue8m0 NaN byte (255); the checkpoint is damaged")
        return s
    if s.dtype not in (np.float32, np.float16, D.bf16.np):
        raise CheckpointError(f"tensor {name!r} has dtype {s.dtype}; scales are F32, BF16, F16 or F8_E8M0")
    return s


def _fp4_weight(get_tensor, name, w, scheme, shape, has_tensor) -> Tensor:
    """DeepSeek V4's fp4 routed experts: I8 [N, K/2] holding two e2m1 codes per byte (element 2i
    in the low nibble, the ABI's packing) and `_scale_inv` [N, K/32] (e8m0) -> an e2m1 Tensor
    [N, K] over the stored bytes with Quant(scales, (1, 32)); nothing is unpacked or copied."""
    if w.ndim != 2:
        raise CheckpointError(f"fp4 tensor {name!r} must be 2-d, has shape {list(w.shape)}")
    n, kb = w.shape
    k = 2 * kb
    if shape is not None:
        if int(shape[0]) != n or (int(shape[1]) + 1) // 2 != kb:
            raise CheckpointError(f"fp4 tensor {name!r} [{n}, {kb}] bytes (two e2m1 values each) cannot hold a "
                                  f"[{shape[0]}, {shape[1]}] weight")
        k = int(shape[1])
    s = _lookup(get_tensor, name + "_scale_inv", has_tensor)
    if s is None:
        raise CheckpointError(f"tensor {name!r} is I8 in an fp8 checkpoint (packed fp4 e2m1) but has no "
                              f"{name + '_scale_inv'!r}")
    s = np.asarray(s)
    if s.ndim != 2 or s.shape[0] != n:
        raise CheckpointError(f"tensor {name + '_scale_inv'!r} has shape {list(s.shape)}; fp4 scales are "
                              f"[{n}, K/{FP4_GROUP}] for the [{n}, {k}] weight")
    groups = [g for g in sorted(FP4_GROUPS, reverse=True) if -(-k // g) == s.shape[1]]
    if not groups:
        raise CheckpointError(f"tensor {name + '_scale_inv'!r} has {s.shape[1]} scales per row; an fp4 weight "
                              f"of K={k} has one per {' or '.join(map(str, FP4_GROUPS))} columns "
                              f"({', '.join(str(-(-k // g)) for g in FP4_GROUPS)})")
    g = groups[0]
    s = _float_scales(name + "_scale_inv", s, scheme)
    if s.dtype != D.e8m0.np:
        # the ABI's fp4 formats take e8m0 (or e4m3) scales: float scales are fine when they are
        # powers of two (what ue8m0 stores), which e8m0 holds exactly
        f = s.astype(np.float32)
        m, e = np.frexp(f)
        if not (np.all(np.isfinite(f)) and np.all(f > 0) and np.all(m == 0.5) and e.min(initial=1) - 1 >= -127
                and e.max(initial=1) - 1 <= 127):
            raise CheckpointError(f"tensor {name + '_scale_inv'!r}: fp4 weights take power-of-two (ue8m0) scales; "
                                  f"these {s.dtype} scales are not all powers of two")
        s = f.astype(D.e8m0.np)
    data = np.asarray(w).view(np.uint8)
    return Tensor(data, (n, k), "e2m1", quant=Quant(Tensor.from_numpy(np.asarray(s)), (1, g)))


def _scale(get_tensor, name, has_tensor, grid, allowed) -> np.ndarray:
    s = _lookup(get_tensor, name + "_scale", has_tensor)
    if s is None:
        raise CheckpointError(f"quantized tensor {name!r} has no {name + '_scale'!r}")
    s = np.asarray(s)
    _check_shape(name + "_scale", s, grid, "scales")
    dt = D.get(s.dtype).name if s.dtype in (np.float32, D.bf16.np, np.float16) else str(s.dtype)
    if dt not in allowed:
        raise CheckpointError(f"{name}_scale has dtype {dt}; this format takes {' or '.join(allowed)}")
    return s


# ---------------------------------------------------------------------------- writing


def weight_to_checkpoint(name: str, t: Tensor) -> dict[str, np.ndarray]:
    """The checkpoint tensors that store Tensor `t` under weight name `name` (inverse of
    weight_from_checkpoint). Host tensors only."""
    if not t.on_host:
        raise ValueError(f"{name}: weight_to_checkpoint needs a host tensor, got one on {t.device}")
    if t.quant is None:
        if t.dtype.name not in ("f32", "bf16", "f16"):
            raise ValueError(f"{name}: plain weights are stored as f32, bf16 or f16, not {t.dtype.name}")
        return {name: np.ascontiguousarray(t.numpy())}
    q, dt = t.quant, t.dtype.name
    if t.ndim != 2:
        raise ValueError(f"{name}: quantized weights must be 2-d, got shape {list(t.shape)}")
    n, k = t.shape
    scales = np.ascontiguousarray(q.scales.numpy())
    if dt == "e4m3" and q.zeros is None and q.scales.dtype.name == "f32" and q.block[0] > 0 and q.block[1] > 0:
        return {name: np.ascontiguousarray(t.numpy()), name + "_scale_inv": scales}
    if dt == "e2m1" and q.zeros is None and q.scales.dtype.name == "e8m0" and q.block[0] == 1 \
            and q.block[1] in FP4_GROUPS:
        # DeepSeek V4's fp4 layout: the packed bytes as I8 [N, ceil(K/2)], e8m0 scales beside them
        packed = np.ascontiguousarray(t.packed_bytes()) if t.is_contiguous() and t.offset == 0 else _pack_codes(t)
        return {name: packed.view(np.int8), name + "_scale_inv": scales}
    if dt == "int8" and tuple(q.block) == (1, 0) and q.zeros is None and q.scales.dtype.name == "f32":
        return {name: np.ascontiguousarray(t.numpy()), name + "_scale": scales.reshape(n, 1)}
    if dt in ("int4", "uint4") and q.block[0] == 1 and q.block[1] > 0 and q.scales.dtype.name in ("f32", "bf16"):
        if (dt == "uint4") != (q.zeros is not None):
            raise ValueError(f"{name}: int4 is stored symmetric (int4, no zeros) or asymmetric (uint4 + zeros)")
        out = {name: np.ascontiguousarray(t.packed_bytes()) if t.is_contiguous() and t.offset == 0
               else _pack_codes(t), name + "_scale": scales}
        if q.zeros is not None:
            z = np.asarray(q.zeros.numpy()).astype(np.float64)
            if np.any(z != np.rint(z)) or z.min(initial=0) < 0 or z.max(initial=0) > 15:
                raise ValueError(f"{name}: uint4 zero points must be integers in [0, 15] to be stored as uint8")
            out[name + "_zero"] = np.ascontiguousarray(z.astype(np.uint8))
        if k % 2:
            out[name + "_shape"] = np.array([n, k], np.int64)
        return out
    raise ValueError(f"{name}: no checkpoint format for {q.describe(t.dtype)} (stored formats: fp8 e4m3 "
                     f"blocks with f32 scales, fp4 e2m1 block (1,16|32) e8m0, int8 block (1,0) f32, "
                     f"int4/uint4 block (1,g) f32/bf16)")


def _pack_codes(t: Tensor) -> np.ndarray:
    return pack_4bit(np.asarray(t.numpy()).view(np.uint8) & 0xF)


# ---------------------------------------------------------------------------- sizes


def weight_nbytes(shape, format: str, group_size: int = 64, symmetric: bool = True, scale_dtype: str = "f32",
                  fp8_block=FP8_BLOCK) -> int:
    """Bytes one [N, K] linear weight occupies in `format` (precisions of EngineConfig included:
    w8a8 / w4a8 store the same weights as int8 / int4)."""
    n, k = (int(s) for s in shape)
    fmt = weight_format_of(format)
    if fmt in ("f32",):
        return 4 * n * k
    if fmt in ("bf16", "f16"):
        return 2 * n * k
    if fmt == "int8":
        return n * k + 4 * n
    if fmt == "fp8":
        return n * k + 4 * math.ceil(n / fp8_block[0]) * math.ceil(k / fp8_block[1])
    if fmt == "int4":
        groups = n * math.ceil(k / group_size)
        return n * ((k + 1) // 2) + groups * D.get(scale_dtype).nbytes(1) + (0 if symmetric else groups)
    if fmt == "fp4":
        # e2m1 with one e8m0 byte per FP4_GROUP columns (DeepSeek V4's routed experts)
        return n * ((k + 1) // 2) + n * math.ceil(k / FP4_GROUP)
    raise ValueError(f"weight_nbytes: unknown format {format!r}")


SIDE_SUFFIXES = ("_scale_inv", "_scale", "_zero", "_shape")


def logical_shapes(entries, get_tensor: Optional[GetTensor] = None) -> dict[str, tuple]:
    """{name: logical shape} of a checkpoint's tensors from {name: (dtype, stored shape)}: the
    scale / zero / shape side tensors of quantized weights are dropped and a packed int4 weight
    [N, ceil(K/2)] becomes [N, K] (K from `X.weight_shape` when get_tensor is given and it exists,
    else 2 * ceil(K/2)), as does a packed fp4 weight (I8 [N, K/2] with a `_scale_inv`, DeepSeek V4's
    experts). What precision.weight_bytes needs to size a pre-quantized checkpoint."""
    names = set(entries)
    out = {}
    for name, (dtype, shape) in entries.items():
        if any(name.endswith(".weight" + s) and name[: -len(s)] in names for s in SIDE_SUFFIXES):
            continue
        shape = tuple(int(s) for s in shape)
        if np.dtype(dtype) == np.uint8 and len(shape) == 2 and name + "_scale" in names:
            k = 2 * shape[1]
            if get_tensor is not None and name + "_shape" in names:
                k = int(np.asarray(get_tensor(name + "_shape")).reshape(-1)[1])
            shape = (shape[0], k)
        elif np.dtype(dtype) == np.int8 and len(shape) == 2 and name + "_scale_inv" in names:
            shape = (shape[0], 2 * shape[1])
        out[name] = shape
    return out
