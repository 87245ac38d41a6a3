#!/usr/bin/env bash
# Several device scripts in one device call: each call starts a bare machine (a minute) and builds the
# library (another), so runs that belong together share one start and one build.
#
#   backends/cuda/device_parts.sh COMMIT PART...
#       PART: v4 (device_v4.sh), speculative (device_speculative.sh), cache_nano and cache_v2lite
#       (device_expert_cache.sh COMMIT nano / v2lite), chunks (benchmarks/sweep_expert_chunks.py on the
#       27-layer V2-Lite shape; EC_CHUNK_ARGS: its options), cli (`deepinfer run` on cuda: the embedded model
#       with expert_cache at 25% capacity from disk and from host, and with --speculative mtp).
#   Each part writes into $OUT/<part>/, which is then packed into $OUT/<part>.tgz (the device tool
#   returns at most 8 files), and its exit status is printed.
#   Env: PART_TIMEOUT (seconds per part, default 540), PART_TIMEOUT_<part> (one part's, e.g.
#   PART_TIMEOUT_speculative=200: a call of several parts must end within the tool's 10 minutes).
# The library: backends/cuda/carried/libdeepinfer_cuda.so when that holds a build of exactly these
# sources (its file srchash says which; carry the folder), else one build into /tmp/di_cuda, which
# also comes back gzipped as $OUT/lib/libdeepinfer_cuda.so.gz with its srchash (the tool returns no
# file over 16 MiB, and the library is about that): gunzip both into backends/cuda/carried/.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-$HERE/build}"; mkdir -p "$OUT"
COMMIT="${1:?usage: device_parts.sh COMMIT PART...}"; shift
export PYTHONPATH="$ROOT/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
python3 -c "import cffi" 2>/dev/null || { [[ -d .whl ]] && python3 -m pip install -q --no-index --find-links .whl cffi; }

# LC_ALL=C: the glob's order (so the hash) must not depend on the machine's locale
SRC_HASH="$(export LC_ALL=C; cat "$HERE"/src/* "$ROOT"/abi/*.h | sha1sum | cut -c1-12)"
LIB=/tmp/di_cuda/libdeepinfer_cuda.so
CARRIED="$HERE/carried"
mkdir -p /tmp/di_cuda
if [[ -f "$CARRIED/libdeepinfer_cuda.so" && "$(cat "$CARRIED/srchash" 2>/dev/null)" == "$SRC_HASH" ]]; then
  cp "$CARRIED/libdeepinfer_cuda.so" "$LIB"; echo "== carried library of sources $SRC_HASH"
elif [[ ! -f "$LIB" ]]; then
  t0=$SECONDS
  DI_CUDA_ARCHS="${DI_CUDA_ARCHS:-90a}" JOBS="${JOBS:-16}" "$HERE/build.sh" /tmp/di_cuda > /tmp/build.log 2>&1 \
    || { tail -60 /tmp/build.log; cp /tmp/build.log "$OUT/"; exit 1; }
  echo "== built sources $SRC_HASH in $((SECONDS - t0)) s"
  mkdir -p "$OUT/lib" && gzip -c "$LIB" > "$OUT/lib/libdeepinfer_cuda.so.gz" && echo "$SRC_HASH" > "$OUT/lib/srchash"
fi
# the expert cache's native disk readers (a second of cc; the runtime finds them through this variable)
if [[ -z "${DEEPINFER_READER_LIB:-}" ]]; then
  cc -O2 -shared -fPIC -pthread -o /tmp/di_cuda/libdi_expert_reader.so runtime/native/expert_reader.c \
    && export DEEPINFER_READER_LIB=/tmp/di_cuda/libdi_expert_reader.so || echo "== native expert readers: build failed"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/   GPU: /'

cli_part() {   # deepinfer run on cuda: resident, expert cache (disk and host), speculative decoding
  local st=0
  one() {   # one NAME ARGS...: a run's text (stdout) is kept; with a cache or speculation it must
            # equal the resident run's greedy text
    local name="$1"; shift
    echo "== $name: deepinfer run --backend cuda $*"
    python3 -m deepinfer.cli run --backend "$LIB" --max-new-tokens 32 "$@" "The capital of France is" \
      > "/tmp/cli_$name.txt" || st=1
    cat "/tmp/cli_$name.txt"
    if [[ $name != resident ]] && ! cmp -s /tmp/cli_resident.txt "/tmp/cli_$name.txt"; then
      echo "   FAIL: the text differs from the resident run's"; st=1
    fi
  }
  one resident
  one cache_disk --expert-cache '{"capacity": 0.25, "source": "disk"}' -v
  one cache_host --expert-cache '{"capacity": 0.25, "source": "host", "prefetch": true}' -v
  one speculative --speculative mtp -v
  return $st
}

status=0
for part in "$@"; do
  dir="$OUT/$part"; mkdir -p "$dir"
  t0=$SECONDS
  tvar="PART_TIMEOUT_$part"; tmo="${!tvar:-${PART_TIMEOUT:-540}}"
  echo "################ $part (at most $tmo s)"
  case "$part" in
    v4)           OUT="$dir" V4_LIB="$LIB" timeout "$tmo" bash "$HERE/device_v4.sh" ;;
    speculative)  OUT="$dir" timeout "$tmo" bash "$HERE/device_speculative.sh" ;;
    cache_nano)   OUT="$dir" timeout "$tmo" bash "$HERE/device_expert_cache.sh" "$COMMIT" nano ;;
    cache_v2lite) OUT="$dir" timeout "$tmo" bash "$HERE/device_expert_cache.sh" "$COMMIT" v2lite ;;
    chunks)       python3 benchmarks/_v2lite_random.py /tmp/v2lite27 --layers 27 --jobs 0 > /dev/null && sync \
                    && timeout "$tmo" python3 benchmarks/sweep_expert_chunks.py --backend "$LIB" --model /tmp/v2lite27 \
                         --commit "$COMMIT" --out-dir "$dir" ${EC_CHUNK_ARGS:-} 2>&1 | tee "$dir/sweep.log" | tail -12
                  ( exit "${PIPESTATUS[0]}" ) ;;
    cli)          timeout "$tmo" bash -c "$(declare -f cli_part); LIB=$LIB; cli_part" 2>&1 | tee "$dir/cli.log"
                  ( exit "${PIPESTATUS[0]}" ) ;;
    *)            echo "unknown part $part"; false ;;
  esac
  rc=$?
  [[ $rc -eq 0 ]] || status=1
  echo "################ $part: exit $rc in $((SECONDS - t0)) s"
  tar -czf "$OUT/$part.tgz" -C "$OUT" "$part" && rm -rf "$dir"
done
exit $status
