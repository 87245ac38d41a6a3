"""GPU kernel benchmark: moe_experts of a GPU backend library against the hardware bounds and peers,
all measured in one run on one device.

    PYTHONPATH=runtime python3 benchmarks/bench_gpu_kernels.py LIB --commit SHA \
        --out benchmarks/results/gpu_kernels_<date>.json [--shapes V2-Lite,V3] [--tokens 1,4,...]

Per (shape, weight format, tokens) it first checks the op against a torch f32 computation on the
dequantized weights (nmse and max error relative to the rms), then times it: the median of CUDA-event
timed calls, cycling through 4 routings so the touched experts change from call to call as they do
in a model. Reported beside it, from the same run:
  - the bytes of the experts the routing touches (codes + scales) and that over the copy bandwidth
    (device-to-device copy of 4 GiB, bytes read + written): the memory bound of a decode step;
  - FLOP/s against the bf16 matmul peak (cuBLAS 8192^3 through torch);
  - HF transformers' expert loop (DeepseekV3Experts, eager) on the same weights in bf16;
  - torch._grouped_mm (the same sort, two grouped GEMMs, SiLU, weighted scatter) in bf16.
The peers run bf16 only: rows of the quantized formats carry the bf16 peers' times of that size.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import numpy as np
import torch

from deepinfer import abi
from deepinfer.loader import load_library
from deepinfer.tensor import DeviceBuffer, Quant, Tensor

ffi = abi.ffi
SHAPES = {"V2-Lite": dict(E=64, K=6, H=2048, I=1408), "V3": dict(E=256, K=8, H=7168, I=2048)}
TOKENS = (1, 4, 16, 64, 512, 4096)
# label: (codes dtype, block, scale dtype)
FORMATS = {
    "bf16": ("bf16", None, None),
    "fp8 e4m3 128x128": ("e4m3", (128, 128), torch.float32),
    "int8 per channel": ("int8", (1, 0), torch.float32),
    "int4 g128": ("int4", (1, 128), torch.bfloat16),
    "int4 g64": ("int4", (1, 64), torch.bfloat16),
    "int4 g32": ("int4", (1, 32), torch.bfloat16),
}


def timed(fn, iters=20, warm=3) -> float:
    """Median seconds of fn(i) for i = 0, 1, ... on the current stream."""
    for i in range(warm):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return float(np.median(ts))


def view(t: torch.Tensor, shape, dtype: str, quant=None) -> Tensor:
    """A deepinfer device Tensor over torch memory (not owned)."""
    ptr = t.data_ptr()
    return Tensor(DeviceBuffer(ptr, t.numel() * t.element_size(), None), shape, dtype, quant=quant)


class Weights:
    """One format's experts in the fused layout [E, 2I, H] (gate rows, then up rows) and [E, H, I]."""

    def __init__(self, fmt: str, E: int, H: int, I: int, gen: torch.Generator):
        self.fmt, self.E, self.H, self.I = fmt, E, H, I
        qdt, block, sdt = FORMATS[fmt]
        self.qdt, self.block = qdt, block
        dev = "cuda"

        def codes(N, K):
            if qdt == "bf16":
                return (torch.randn(E, N, K, device=dev, generator=gen) * K ** -0.5).to(torch.bfloat16)
            if qdt == "e4m3":
                c = torch.randint(0, 256, (E, N, K), device=dev, dtype=torch.uint8, generator=gen)
                c[(c & 0x7F) == 0x7F] = 0x38  # no NaN codes
                return c
            if qdt == "int8":
                return torch.randint(-127, 128, (E, N, K), device=dev, dtype=torch.int8, generator=gen)
            return torch.randint(0, 256, (E, N, K // 2), device=dev, dtype=torch.uint8, generator=gen)  # int4

        def scales(N, K):
            if block is None:
                return None
            br, bc = block
            shape = (E, math.ceil(N / (br or N)), math.ceil(K / (bc or K)))
            mag = {"e4m3": 1 / 64, "int8": 1 / 64, "int4": 1 / 8}[qdt] * K ** -0.5
            return (torch.rand(shape, device=dev, generator=gen) * mag + 0.5 * mag).to(sdt)

        self.gu, self.gu_s = codes(2 * I, H), scales(2 * I, H)
        self.dn, self.dn_s = codes(H, I), scales(H, I)
        self.bytes_per_expert = sum(t[0].numel() * t.element_size() for t in (self.gu, self.dn)) + sum(
            t[0].numel() * t.element_size() for t in (self.gu_s, self.dn_s) if t is not None)

    def _desc(self, q, s, e, r0, N, K) -> Tensor:
        """Expert e, rows r0 .. r0 + N of a fused [E, rows, K] tensor."""
        qe = q[e, r0:r0 + N]
        quant = None
        if s is not None:
            br, bc = self.block
            s_rows = (r0 // br, (r0 + N + br - 1) // br) if br else (0, 1)
            se = s[e, s_rows[0]:s_rows[1]]
            quant = Quant(view(se, tuple(se.shape), {torch.float32: "f32", torch.bfloat16: "bf16"}[se.dtype]),
                          self.block)
        shape = (N, K)
        return view(qe, shape, self.qdt, quant)

    def descriptors(self):
        E, H, I = self.E, self.H, self.I
        gate = [self._desc(self.gu, self.gu_s, e, 0, I, H) for e in range(E)]
        up = [self._desc(self.gu, self.gu_s, e, I, I, H) for e in range(E)]
        down = [self._desc(self.dn, self.dn_s, e, 0, H, I) for e in range(E)]
        return gate, up, down

    def dequant(self, q, s, e) -> torch.Tensor:
        """f32 [N, K] of expert e of a fused tensor."""
        c = q[e]
        if self.qdt == "bf16":
            return c.float()
        if self.qdt == "e4m3":
            v = c.view(torch.float8_e4m3fn).float()
        elif self.qdt == "int8":
            v = c.float()
        else:
            lo = (c & 0xF).to(torch.int16)
            hi = (c >> 4).to(torch.int16)
            v = torch.stack([lo, hi], -1).reshape(c.shape[0], -1)
            v = torch.where(v >= 8, v - 16, v).float()
        N, K = v.shape
        br, bc = self.block
        sc = s[e].float()
        sc = sc.repeat_interleave(br or N, 0)[:N].repeat_interleave(bc or K, 1)[:, :K]
        return v * sc

    def expert_f32(self, e):
        g_u = self.dequant(self.gu, self.gu_s, e)
        return g_u[:self.I], g_u[self.I:], self.dequant(self.dn, self.dn_s, e)


def torch_reference(x, ids, tw, w: Weights) -> torch.Tensor:
    T, H = x.shape
    out = torch.zeros(T, H, device="cuda", dtype=torch.float32)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        tok, kpos = torch.where(ids == e)
        g, u, d = w.expert_f32(e)
        xe = xf[tok]
        h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
        out.index_add_(0, tok, (h @ d.T) * tw[tok, kpos, None])
    return out


def routings(T, E, K, n, gen):
    """n random top-k routings: distinct experts per token, uniform over experts (a balanced router)."""
    out = []
    for _ in range(n):
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
        tw = torch.rand(T, K, device="cuda", generator=gen) * 0.9 + 0.1
        out.append((ids.contiguous(), tw.contiguous()))
    return out


class MoECall:
    """moe_experts marshalled once per routing, sharing one workspace."""

    def __init__(self, be, stream, x, rts, gate, up, down, out, workspace_cache):
        self.be, self.calls = be, []
        xt = view(x, tuple(x.shape), "bf16")
        ot = view(out, tuple(out.shape), "bf16")
        fn, ctx = be._api.moe_experts, be._ctx
        for ids, tw in rts:
            kw = dict(x=xt, topk_ids=view(ids, tuple(ids.shape), "int32"), topk_weights=view(tw, tuple(tw.shape), "f32"),
                      w_gate=gate, w_up=up, w_down=down, out=ot, accumulate=0)
            _, ws = be.query("moe_experts", **kw)
            args, keep = be._marshal("moe_experts", kw)
            if ws:
                buf = workspace_cache(ws)
                args.header.workspace = ffi.cast("void*", buf.data_ptr())
                args.header.workspace_size = ws
            args.header.stream = ffi.cast("void*", stream)
            self.calls.append((fn, ctx, args, keep))

    def __call__(self, i=0):
        fn, ctx, args, _ = self.calls[i % len(self.calls)]
        st = fn(ctx, args)
        if st != abi.OK:
            raise RuntimeError(f"moe_experts: {abi.STATUS_NAMES.get(st)}: {self.be._error_message(ctx)}")

    def graphs(self, stream):
        """One captured graph per routing (graph_begin / graph_end of the ABI): replay costs no host
        work and no launch gaps, as in an engine that captures its decode step."""
        api, ctx = self.be._api, self.be._ctx
        self.graph_list, s = [], ffi.cast("void*", stream)
        for i in range(len(self.calls)):
            g = ffi.new("DI_Graph**")
            assert api.graph_begin(ctx, s) == abi.OK, self.be._error_message(ctx)
            st = self.calls[i][0](ctx, self.calls[i][2])
            st_end = api.graph_end(ctx, s, g)
            if st != abi.OK or st_end != abi.OK:
                raise RuntimeError(f"capturing moe_experts: {self.be._error_message(ctx)}")
            self.graph_list.append(g)

        def replay(i=0):
            api.graph_launch(ctx, self.graph_list[i % len(self.graph_list)][0], s)
        return replay

    def close(self):
        for g in getattr(self, "graph_list", []):
            self.be._api.graph_destroy(self.be._ctx, g[0])


def hf_experts(w: Weights):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = DeepseekV3Config(n_routed_experts=w.E, hidden_size=w.H, moe_intermediate_size=w.I, hidden_act="silu")
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    with torch.device("meta"):
        m = DeepseekV3Experts(cfg)
    m.gate_up_proj = torch.nn.Parameter(w.gu, requires_grad=False)
    m.down_proj = torch.nn.Parameter(w.dn, requires_grad=False)
    return m


def grouped_mm_moe(x, ids, tw, w: Weights):
    T, K = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=w.E), 0).to(torch.int32)
    gu = torch._grouped_mm(x[tok], w.gu.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(g) * u, w.dn.transpose(1, 2), offs=offs)
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, tok, y.float() * tw.reshape(-1)[order, None])
    return out.to(x.dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-peers", action="store_true")
    a = ap.parse_args()
    be = load_library(a.lib)
    torch.cuda.init()
    # a created stream (the default one cannot be captured), shared by torch and the library
    torch.cuda.set_stream(torch.cuda.Stream())
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "commit": a.commit, "date": datetime.date.today().isoformat(),
              "library": a.lib, "torch": torch.__version__, "rows": []}
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except ImportError:
        pass

    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda i: dst.copy_(src), iters=10)
    bw = 2 * src.numel() / t
    del src, dst
    A = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda i: A @ B, iters=20)
    peak = 2 * 8192 ** 3 / t
    del A, B
    result["copy_GBps"], result["bf16_matmul_TFLOPs"] = bw / 1e9, peak / 1e12
    print(f"{result['gpu']}: copy {bw / 1e9:.0f} GB/s (read + write), bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)

    ws_buf = {}

    def workspace(n):
        if ws_buf.get("t") is None or ws_buf["t"].numel() < n:
            ws_buf["t"] = None
            torch.cuda.empty_cache()
            ws_buf["t"] = torch.empty(n, dtype=torch.uint8, device="cuda")
        return ws_buf["t"]

    tokens = [int(v) for v in a.tokens.split(",")]
    failures = 0
    for shape_name in a.shapes.split(","):
        sh = SHAPES[shape_name]
        E, K, H, I = sh["E"], sh["K"], sh["H"], sh["I"]
        peers = {}
        for fmt in a.formats.split(","):
            w = Weights(fmt, E, H, I, gen)
            gate, up, down = w.descriptors()
            for T in tokens:
                x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
                rts = routings(T, E, K, 4, gen)
                out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
                call = MoECall(be, stream, x, rts, gate, up, down, out, workspace)
                # correctness first: every routing against torch on the dequantized weights
                worst = (0.0, 0.0)
                for i, (ids, tw) in enumerate(rts[:2]):
                    out.fill_(float("nan"))
                    call(i)
                    torch.cuda.synchronize()
                    ref = torch_reference(x, ids, tw, w)
                    got = out.float()
                    err = got - ref
                    rms = ref.pow(2).mean().sqrt().item()
                    nmse = (err.pow(2).sum() / ref.pow(2).sum()).item()
                    mx = err.abs().max().item() / rms if rms else float("inf")
                    if not math.isfinite(nmse):
                        nmse = float("inf")
                    worst = (max(worst[0], nmse), max(worst[1], mx))
                ok = worst[0] <= 4e-4 and worst[1] <= 0.1
                failures += not ok
                t_op = timed(call)
                replay = call.graphs(stream)
                t_graph = timed(replay)
                touched = np.mean([len(torch.unique(ids)) for ids, _ in rts]) * w.bytes_per_expert
                flops = 2 * T * K * 3 * H * I
                row = {"op": "moe_experts", "shape": shape_name, "E": E, "topk": K, "H": H, "I": I, "format": fmt,
                       "tokens": T, "us": t_op * 1e6, "us_graph": t_graph * 1e6, "touched_MB": touched / 1e6,
                       "GBps_graph": touched / t_graph / 1e9, "of_copy_bw_graph": touched / t_graph / bw,
                       "GBps": touched / t_op / 1e9, "of_copy_bw": touched / t_op / bw,
                       "bound_us": touched / bw * 1e6, "TFLOPs": flops / t_op / 1e12, "of_bf16_peak": flops / t_op / peak,
                       "check_nmse": worst[0], "check_max_err_over_rms": worst[1], "check_ok": ok}
                if not a.no_peers and fmt == "bf16":
                    p = {}
                    try:
                        hf = hf_experts(w)
                        p["hf_us"] = timed(lambda i: hf(x, rts[i % 4][0].long(), rts[i % 4][1].to(torch.bfloat16)),
                                           iters=5 if T >= 512 else 10, warm=2) * 1e6
                        del hf
                    except Exception as e:  # a peer that cannot run is reported, not fatal
                        p["hf_error"] = f"{type(e).__name__}: {e}"[:200]
                    try:
                        p["grouped_mm_us"] = timed(lambda i: grouped_mm_moe(x, rts[i % 4][0], rts[i % 4][1], w),
                                                   iters=10, warm=2) * 1e6
                    except Exception as e:
                        p["grouped_mm_error"] = f"{type(e).__name__}: {e}"[:200]
                    peers[T] = p
                row.update(peers.get(T, {}))
                if "hf_us" in row:
                    row["speedup_vs_hf"] = row["hf_us"] / row["us"]
                if "grouped_mm_us" in row:
                    row["speedup_vs_grouped_mm"] = row["grouped_mm_us"] / row["us"]
                result["rows"].append(row)
                print(f"{shape_name:7s} {fmt:17s} T={T:5d}: {row['us']:9.1f} us  {row['GBps']:6.0f} GB/s "
                      f"({100 * row['of_copy_bw']:3.0f}% copy)  graph {row['us_graph']:8.1f} us "
                      f"({100 * row['of_copy_bw_graph']:3.0f}%)  {row['TFLOPs']:6.1f} TFLOP/s "
                      f"({100 * row['of_bf16_peak']:3.0f}% peak)  HF {row.get('hf_us', float('nan')):9.1f} us  "
                      f"grouped_mm {row.get('grouped_mm_us', float('nan')):9.1f} us  "
                      f"check nmse {worst[0]:.1e} max {worst[1]:.1e} {'ok' if ok else 'FAIL'}", flush=True)
                call.close()
                del call
            del w, gate, up, down
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}; {failures} check failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
