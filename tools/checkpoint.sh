# shellcheck shell=bash
# Sourced by the tools/gpu_run_*.sh scripts: the random checkpoints their benchmarks load, written
# on the GPU host (never carried: 2.5-16 GB).
#   ensure_checkpoint SHAPE DIR [ARGS...]
# writes tools/bench/make_random_checkpoint.py's SHAPE (llama-3.1-8b, llama-3.2-1b, ...) to DIR
# with ARGS (e.g. --layers 2) unless DIR already holds one; on failure prints the last lines of
# its log and returns 1.
ensure_checkpoint() {
  local shape=$1 dir=$2 log rc
  shift 2
  [ -f "$dir/model.safetensors" ] && return 0
  log=$(mktemp)
  python3 "$(dirname "${BASH_SOURCE[0]}")/bench/make_random_checkpoint.py" --shape "$shape" \
    --out "$dir" "$@" > "$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || tail -3 "$log"
  rm -f "$log"
  return $rc
}
