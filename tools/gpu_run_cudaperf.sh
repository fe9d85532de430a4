#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with a packed build in .device (see
# ../shared/device/README.md): every GPU op test (tests/gpu), compute-sanitizer over the two
# reworked kernels when it is there, then the kernel benchmarks. Prints a compact summary last;
# full logs go to $OUT (or /tmp) as cudaperf_*.log.
#   tools/gpu_run_cudaperf.sh [--no-sanitizer] [--no-bench]
set -uo pipefail
sanitize=1 bench=1
for a in "$@"; do
  case "$a" in
    --no-sanitizer) sanitize=0 ;;
    --no-bench) bench=0 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
[ -f .device/env.sh ] || { echo "no .device/env.sh: pack a build first" >&2; exit 2; }
. .device/env.sh
logs=${OUT:-/tmp}
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory --format=csv,noheader

for t in .device/bin/tests/*_cuda_test; do
  name=$(basename "$t")
  start=$(date +%s%N)
  "$t" --gtest_brief=1 > "$logs/cudaperf_$name.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  line=$(grep -E '^\[  (PASSED|FAILED)|^\[  SKIPPED' "$logs/cudaperf_$name.log" | tr '\n' ' ')
  summary+=("$(printf '%-28s rc=%d %6d ms %s' "$name" "$rc" "$ms" "$line")")
  if [ $rc -ne 0 ]; then
    echo "=== $name FAILED (last 40 lines) ==="
    grep -v '^\[       OK \]\|^\[ RUN      \]' "$logs/cudaperf_$name.log" | tail -40
  fi
done

if [ $sanitize -eq 1 ] && command -v compute-sanitizer > /dev/null; then
  for t in sampling_cuda_test tree_attention_cuda_test; do
    for tool in memcheck racecheck; do
      # racecheck is slow: the sampling edge rows and decode cases cover both kernels' paths.
      filter='*'
      [ $tool = racecheck ] && filter='*SplitPathEdgeRows*:*Decode*:*TiesFollow*'
      compute-sanitizer --tool $tool --error-exitcode 9 \
        .device/bin/tests/$t --gtest_brief=1 --gtest_filter="$filter" \
        > "$logs/cudaperf_san_${t}_$tool.log" 2>&1
      rc=$?
      summary+=("$(printf '%-28s %-9s rc=%d %s' "$t" "$tool" "$rc" \
        "$(grep -E 'ERROR SUMMARY' "$logs/cudaperf_san_${t}_$tool.log" | tail -1)")")
      [ $rc -ne 0 ] && tail -30 "$logs/cudaperf_san_${t}_$tool.log"
    done
  done
fi

if [ $bench -eq 1 ]; then
  .device/bin/bench/cuda_kernels_bench --benchmark_counters_tabular=true \
    --benchmark_filter='Attention|Sample' > "$logs/cudaperf_bench.log" 2>&1
  echo "=== cuda_kernels_bench (attention, sampling) ==="
  # name, time per launch, counters (kv_GBps, splits, ctas)
  grep -E '^BM_' "$logs/cudaperf_bench.log" | awk '{$4=$5=""; print}' | sed 's/  */ /g'
fi

echo "=== summary ==="
printf '%s\n' "${summary[@]}"
