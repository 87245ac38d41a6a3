#!/usr/bin/env bash
# The batch-1 decode A/B of issue 45 in one device call: conformance of the decode ops with every CUDA
# decode switch on (the defaults) and with every switch off, then one bench_gpu_e2e.py run per
# configuration (27-layer V2-Lite shape, batches 1 and 32), a previous library beside it in the same
# call, and last the defaults again with HF transformers, int4, fp8 and the kernel profile.
#
#   benchmarks/gpu_decode_ab.sh LIB COMMIT [PREV_LIB]     (OUT: where results go, default /tmp/decode_ab)
#
# PREV_LIB runs with PREV_ENV (default: the three opt-in variables of libraries before 153d09f set to 1).
# Compare rows of one call only: run to run the same configuration moves by up to 0.15 ms on an H100.
set -u
LIB=$1 C=$2 PREV=${3:-}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/runtime PYTHONUNBUFFERED=1
W=${OUT:-/tmp/decode_ab}; mkdir -p "$W"
OPS=rmsnorm,linear,mla_decode,mla_prefill,mla_cache_write,mla_rope_cache_write,moe_router,moe_experts,silu_mul,sample,spec_verify
OFF="DEEPINFER_CUDA_PDL=0 DEEPINFER_CUDA_LINEAR_CLUSTER=0 DEEPINFER_CUDA_ROUTER_WARP=0 DEEPINFER_CUDA_MOE_DIRECT=0"
PREV_ENV=${PREV_ENV:-"DEEPINFER_CUDA_PDL=1 DEEPINFER_CUDA_LINEAR_CLUSTER=1 DEEPINFER_CUDA_ROUTER_WARP=1"}
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
conf() { local tag=$1; shift; env "$@" python -m deepinfer.conformance "$LIB" --ops $OPS --no-out > "$W/conf_$tag.log" 2>&1
         echo "conf_$tag rc=$? $((SECONDS - t0))s"; grep -E "FAIL|RESULT" "$W/conf_$tag.log" | head -8; }
conf def X=0
conf off $OFF
B="--layers 27 --batches 1,32 --precisions bf16 --ttft 128 --new 32 --ckpt-dir /tmp/ck --no-hf --no-profile --out-dir $W"
e() { local lib=$1 tag=$2; shift 2
      env "$@" python benchmarks/bench_gpu_e2e.py "$lib" --commit "$C" --tag "_$tag" $B > "$W/e_$tag.log" 2>&1
      echo "$tag $((SECONDS - t0))s: $(grep -E 'B=(1|32) step' "$W/e_$tag.log" | sed 's/.*B=/B=/' | tr '\n' ' ')"; }
e "$LIB" def X=0
e "$LIB" nodirect DEEPINFER_CUDA_MOE_DIRECT=0
e "$LIB" alloff $OFF
[ -n "$PREV" ] && e "$PREV" prev $PREV_ENV
e "$LIB" ms2 DEEPINFER_CUDA_LINEAR_MIN_STEPS=2
python benchmarks/bench_gpu_e2e.py "$LIB" --commit "$C" --tag _allhf --layers 27 --batches 1,32 --precisions bf16,int4,fp8 \
    --quant-batches 1 --ttft 128 --new 32 --ckpt-dir /tmp/ck --out-dir "$W" > "$W/e_allhf.log" 2>&1
echo "allhf $((SECONDS - t0))s"
grep -E "step|kernels" "$W/e_allhf.log" | head -12
