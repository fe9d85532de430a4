#!/usr/bin/env bash
# GPU-host run for the cudagraph branch (CUDA graphs, GEMM row invariance, model tests, step
# benchmark), from the repository root with a packed build carried along:
#   tools/gpu_run_cudagraph.sh [PACKED_DIR]        (default .device)
# Prints one line per test binary (and the failures in full), then the benchmark tables.
# Budget: about 4 minutes (tests ~1 min, checkpoints ~1 min, benchmarks ~2 min).
set -u
dev=${1:-.device}
. "$dev/env.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
fail=0
for t in "$dev"/bin/tests/*_cuda_test "$dev"/bin/tests/cuda_*_test "$dev"/bin/tests/gemm_invariance_test; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  log=/tmp/$name.log
  if timeout 120 "$t" > "$log" 2>&1; then
    echo "PASS $name: $(grep -E '^\[  PASSED  \]|SKIPPED \]' "$log" | tr '\n' ' ')"
  else
    fail=1
    echo "FAIL $name (exit $?):"
    grep -E 'Failure|error|Expected|Which is|actual|FAILED|diverged|differs' "$log" | head -40
  fi
  # Lines the tests print for the report (match lengths, graph counts, acceptance).
  grep -E '^(graphs captured|pycoder-target greedy|speculative vs|draft on)' "$log" || true
done
t0=$(date +%s)
python3 tools/bench/make_random_checkpoint.py --shape llama-3.2-1b --out /tmp/specd-1b &&
  "$dev"/bin/bench/cuda_step_bench --model /tmp/specd-1b --label Llama-3.2-1B --runs 15
rm -rf /tmp/specd-1b
python3 tools/bench/make_random_checkpoint.py --shape llama-3.1-8b --out /tmp/specd-8b &&
  "$dev"/bin/bench/cuda_step_bench --model /tmp/specd-8b --label Llama-3.1-8B --runs 15
rm -rf /tmp/specd-8b
echo "benchmarks took $(( $(date +%s) - t0 )) s"
exit $fail
