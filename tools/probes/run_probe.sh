#!/usr/bin/env bash
# One device call: the kernel-parameter probe, then ncu on moe_experts (V2-Lite, int4 g128, 1 token).
#   bash tools/probes/run_probe.sh   (writes $OUT/ncu.txt; needs .whl carried for cffi)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/runtime || exit
nvcc -O2 -arch=sm_90a tools/probes/kernel_param_cost.cu -o /tmp/kpc && /tmp/kpc
[ -f /tmp/di_cuda/libdeepinfer_cuda.so ] || DI_CUDA_ARCHS=90a JOBS=16 backends/cuda/build.sh /tmp/di_cuda > /tmp/build.log 2>&1 || { tail /tmp/build.log; exit 1; }
ncu --clock-control none --kernel-name regex:"k_gate_up|k_down" --launch-count 2 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis python3 benchmarks/bench_gpu_kernels.py /tmp/di_cuda/libdeepinfer_cuda.so --out /tmp/x.json --shapes V2-Lite --formats "int4 g128" --tokens 1 --no-peers > $OUT/ncu.txt 2>&1
grep -E "k_gate_up|k_down|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slot|Block Limit|Waves Per SM|One or More|No Eligible" $OUT/ncu.txt | head -80
