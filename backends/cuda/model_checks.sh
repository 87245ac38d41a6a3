#!/usr/bin/env bash
# The model-level checks of a GPU backend library, shared by backends/cuda/device.sh (recipe certify) and
# backends/hip/certify.sh: the model-versus-transformers oracle tests on it, and the embedded model's
# greedy tokens on it against the CPU backend's, with f32 and bf16 activations.
#   backends/cuda/model_checks.sh NAME LIB CPU_LIB OUT     (NAME: the backend, e.g. cuda or hip)
# Logs land in OUT (model_oracle_NAME.log, greedy_NAME_vs_cpu_ACT.log); exit status 0 only if every
# check passed. DRY_RUN=1 prints the commands instead of running them.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
(( $# == 4 )) || { echo "usage: $0 NAME LIB CPU_LIB OUT" >&2; exit 2; }
NAME="$1" LIB="$2" CPU_LIB="$3" OUT="$4"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
status=0
dry() { [[ "${DRY_RUN:-0}" == 1 ]] && { echo "+ $*"; return 0; }; return 1; }

echo "== model-versus-oracle tests on $NAME"
# the model tests' fixture reads DEEPINFER_TEST_BACKENDS and DEEPINFER_<NAME>_LIB (tests/conftest.py)
ORACLE=(env DEEPINFER_TEST_BACKENDS="$NAME" "DEEPINFER_${NAME^^}_LIB=$LIB" python3 -m pytest -q -p no:cacheprovider
        tests/test_model_oracle.py tests/test_model_precision.py)
dry "${ORACLE[*]} > $OUT/model_oracle_$NAME.log" \
  || { "${ORACLE[@]}" 2>&1 | tee "$OUT/model_oracle_$NAME.log" | tail -25 || status=1; }

echo "== embedded model, greedy tokens: $NAME vs cpu"
for act in f32 bf16; do
  GREEDY=(python3 "$HERE/compare_greedy.py" "$LIB" "$CPU_LIB" --tokens 64 --activation-dtype $act)
  dry "${GREEDY[*]} > $OUT/greedy_${NAME}_vs_cpu_$act.log" && continue
  "${GREEDY[@]}" > "$OUT/greedy_${NAME}_vs_cpu_$act.log" 2>&1 || status=1
  tail -30 "$OUT/greedy_${NAME}_vs_cpu_$act.log"
done
exit $status
