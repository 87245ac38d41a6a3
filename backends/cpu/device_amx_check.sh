#!/usr/bin/env bash
# The CPU backend on a machine with AMX (the GPU host: Intel Xeon, amx_int8 / amx_bf16), in one call:
# build, conformance (L0-L3) at every ISA level DEEPINFER_CPU_ISA can cap to, and the integer linear
# at prefill sizes on AMX tiles against the VNNI rows and the f32 path, same threads, same run.
#   backends/cpu/device_amx_check.sh            (wheels of cffi / pycparser / ml_dtypes in build/devwheels)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$ROOT/build/amx}"; mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}"
if [ -d build/devwheels ]; then
  python3 -m pip install -q --no-index --find-links build/devwheels cffi pycparser ml_dtypes 2>&1 | tail -2
fi
lscpu | grep -E "Model name|^CPU\(s\)" ; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
cmake -S backends/cpu -B /tmp/di_cpu -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
  && cmake --build /tmp/di_cpu -j16 >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
LIB=/tmp/di_cpu/libdeepinfer_cpu.so
status=0
for isa in scalar avx2 avx512 avx512vnni amx; do
  DEEPINFER_CPU_ISA=$isa python3 -c "import sys, deepinfer.cli as c; sys.exit(c.main())" conformance "$LIB" \
    --out "$OUT/conformance-$isa.json" --force > "$OUT/conformance-$isa.log" 2>&1 || status=1
  echo "== $isa: $(grep -E 'RESULT' "$OUT/conformance-$isa.log") arch=$(python3 -c "import json;print(json.load(open('$OUT/conformance-$isa.json'))['library']['attributes']['device.arch'])" 2>/dev/null)"
  grep -E "FAIL" "$OUT/conformance-$isa.log" | head -5
done
for t in 16 2; do
  for isa in avx512vnni amx; do
    DEEPINFER_CPU_ISA=$isa python3 benchmarks/bench_cpu_linear.py "$LIB" --threads $t --json "$OUT/linear-$isa-t$t.json" 2>&1 | tee -a "$OUT/bench.log"
  done
done
exit $status
