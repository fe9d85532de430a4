#!/usr/bin/env bash
# Builds the libFuzzer configuration (clang; ASan, UBSan and coverage on every library; the
# harnesses of tests/fuzz) in build-fuzz/ and runs each harness on its committed seed corpus
# (tests/fuzz/corpus/<harness>/, only read) for a bounded time. New inputs go to
# build-fuzz/fuzz-corpus/<harness>/ and survive between runs; a crashing input is written to
# build-fuzz/fuzz-artifacts/ and the script fails.
#
#   scripts/fuzz.sh [--seconds N] [--runs N] [--fork N] [--build DIR] [harness ...]
#
# --seconds N: run each harness for N seconds (default 15; ctest's fuzz_smoke uses this).
# --runs N: stop each harness after N executions instead (for the long runs of docs/fuzzing.md).
# --fork N: fuzz each harness in N processes (libFuzzer's -fork; one per core); with --runs
#   the count is over all of them.
# Reproduce a failure: build-fuzz/fuzz/<harness> build-fuzz/fuzz-artifacts/<crash-file>
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
seconds=15
runs=""
fork=""
build=build-fuzz
harnesses=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --fork) fork="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) harnesses+=("$1"); shift ;;
  esac
done
if [ ${#harnesses[@]} -eq 0 ]; then
  harnesses=(safetensors_header_fuzzer model_config_fuzzer tokenizer_fuzzer
             request_validation_fuzzer tree_validation_fuzzer http_json_fuzzer)
fi
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (scripts/install-deps.sh)" >&2; exit 1; }

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
    -DCMAKE_CXX_COMPILER=clang++ -DSPECD_FUZZ=ON -DSPECD_CUDA=OFF "${launcher[@]}" >/dev/null
fi
cmake --build "$build" --target "${harnesses[@]}"

mkdir -p "$build/fuzz-artifacts"
limit=(-max_total_time="$seconds")
[ -n "$runs" ] && limit=(-runs="$runs")
[ -n "$fork" ] && limit+=(-fork="$fork")
status=0
for h in "${harnesses[@]}"; do
  mkdir -p "$build/fuzz-corpus/$h"
  echo "== $h"
  # -timeout: an input taking 30 s (wall time, generous for loaded CI machines) is a hang;
  # -rss_limit_mb/-malloc_limit_mb: 2 GiB is an OOM.
  if ! SPECD_FUZZ_FIXTURES="$root/tests/fixtures/tokenizers" \
      "$build/fuzz/$h" "${limit[@]}" -timeout=30 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$h-" \
      "$build/fuzz-corpus/$h" "tests/fuzz/corpus/$h" >"$build/fuzz-$h.log" 2>&1; then
    status=1
    echo "FAILED: $h (log: $build/fuzz-$h.log)"
    grep -E "ERROR|runtime error|SUMMARY|Test unit written" "$build/fuzz-$h.log" | head -20 || true
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$build/fuzz-$h.log" || true
done
exit $status
