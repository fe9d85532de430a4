#!/usr/bin/env bash
# GPU-host run for the gpuinv branch (batch-invariant tree attention), from the repository root
# with a packed build carried along:
#   tools/gpu_run_gpuinv.sh [PACKED_DIR]        (default .device)
# Runs every tests/gpu binary (timeout 120 s each; one line each, failures in full), then the
# attention kernel benchmarks briefly. Budget: about 3 minutes.
set -u
dev=${1:-.device}
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fail=0
for t in "$dev"/bin/tests/*_cuda_test "$dev"/bin/tests/cuda_*_test "$dev"/bin/tests/gemm_invariance_test; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  log=/tmp/$name.log
  if timeout 120 "$t" > "$log" 2>&1; then
    echo "PASS $name: $(grep -E '^\[  PASSED  \]|SKIPPED \]' "$log" | tr '\n' ' ')"
  else
    rc=$?
    fail=1
    echo "FAIL $name (exit $rc):"
    grep -B2 -A12 -E 'Failure$|: Failure' "$log" | head -80
    grep -E '^\[  FAILED  \]' "$log"
  fi
done
if [ -x "$dev/bin/bench/cuda_kernels_bench" ]; then
  timeout 90 "$dev/bin/bench/cuda_kernels_bench" --benchmark_filter='Attention' \
    --benchmark_min_time=0.05 || echo "bench exit $?"
fi
exit $fail
