#!/usr/bin/env bash
# Issue 46 on the device in one call: conformance of sample (ABI 1.7's controls included) and
# spec_verify on the CUDA library, then bench_structured_step.py at batch 16 on the 27-layer V2-Lite
# shape (random bf16 weights, the embedded tokenizer), constrained against unconstrained steps.
#
#   benchmarks/gpu_structured.sh LIB COMMIT      (OUT: where results go, default /tmp/structured)
#
# The device has no network: cffi and llguidance come as wheels from .whl/ (pip --no-index).
set -u
LIB=$1 C=$2
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/runtime PYTHONUNBUFFERED=1
W=${OUT:-/tmp/structured}; mkdir -p "$W"
python -c "import cffi" 2>/dev/null || python -m pip install -q --no-index --find-links .whl cffi 2>&1 | tail -1
python -c "import llguidance" 2>/dev/null || python -m pip install -q --no-index --find-links .whl llguidance 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
python -m deepinfer.conformance "$LIB" --ops sample,spec_verify --no-out > "$W/conf.log" 2>&1
echo "conformance rc=$? $((SECONDS - t0))s"; grep -E "FAIL|RESULT|  x " "$W/conf.log" | head -12
python benchmarks/bench_structured_step.py --backend "$LIB" --v2-lite 27 --batch 16 --steps 48 --repeats 2 \
    --commit "$C" --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" --out-dir "$W" \
    > "$W/bench.log" 2>&1
echo "bench rc=$? $((SECONDS - t0))s"; tail -8 "$W/bench.log"
