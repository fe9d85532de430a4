#!/usr/bin/env bash
# One GPU-host call that validates a kernel change against the build before it, the way the
# sessions run it: the random 8B checkpoint is written in the background, the listed tests/gpu
# tests run, then the attention benchmark A/B (tools/gpu_run_attn_ab.sh) and the whole-step A/B
# (tools/gpu_run_ab.sh). Every log goes to $OUT (or --out DIR) as files, since a call prints only
# the last 12,000 characters; the summary lines are printed too.
#   tools/gpu_run_validate.sh [--dev DIR] [--out DIR] [--tests "tree_attention_cuda_test ..."]
#       [--attn-rounds 2] [--step-rounds 3] [--trees 16,64] [--attn-filter REGEX]
#       [--no-step] [--no-attn] [--untimed-gemm] [-- EXTRA_CONFIG...]
# The "prev" build's benchmarks are carried as $dev/bin/bench-prev/cuda_kernels_bench_prev and
# cuda_step_bench_prev (build/bench-prev/ here; tools/pack_device.sh keeps them). Extra
# configurations after -- join both A/Bs (label@VAR=value, e.g. noearly@BENCH_ATTN_NO_EARLY=1).
# --untimed-gemm runs the step A/B with SPECD_GEMM_TIMING=0 (gpu_run_ab.sh --untimed-gemm): every
# process then runs the same cuBLASLt picks, so a non-GEMM change is not hidden by the 0.2-0.3 ms
# that timed picks moved the 64-node step between processes. Both builds must have the switch
# (main from 1bef617 on).
set -u
tools_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # not "here": env.sh sets that
dev=.device out=${OUT:-/tmp/validate} tests="tree_attention_cuda_test cuda_model_test cuda_graph_test"
attn_rounds=2 step_rounds=3 trees=16,64 attn_filter="" step=1 attn=1 untimed=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=$2; shift ;;
    --out) out=$2; shift ;;
    --tests) tests=$2; shift ;;
    --attn-rounds) attn_rounds=$2; shift ;;
    --step-rounds) step_rounds=$2; shift ;;
    --trees) trees=$2; shift ;;
    --attn-filter) attn_filter=$2; shift ;;
    --no-step) step=0 ;;
    --no-attn) attn=0 ;;
    --untimed-gemm) untimed=(--untimed-gemm) ;;
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
model=/tmp/specd-8b
. "$tools_dir/checkpoint.sh"
if [ $step -eq 1 ]; then
  (ensure_checkpoint llama-3.1-8b "$model" > "$out/checkpoint.log" 2>&1
   touch "$out/.checkpoint.done") &
else
  touch "$out/.checkpoint.done"
fi
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null

# Tests: one line each, and the failures' first lines.
for t in $tests; do
  # A hung kernel (a new pipeline waiting forever) costs 5 minutes, not the whole call.
  timeout "${TEST_TIMEOUT_S:-300}" "$dev/bin/tests/$t" > "$out/$t.log" 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$out/$t.log" | head -5
done

prev=$dev/bin/bench-prev
if [ $attn -eq 1 ]; then
  filter_args=()
  [ -n "$attn_filter" ] && filter_args=(--filter "$attn_filter")
  bash "$tools_dir/gpu_run_attn_ab.sh" --dev "$dev" --rounds "$attn_rounds" "${filter_args[@]}" \
    "prev@BENCH=$prev/cuda_kernels_bench_prev" new "$@" > "$out/attn_ab.txt" 2>&1
  # Grouped by case, then by configuration.
  sort -k3,3 -k1,1 -s "$out/attn_ab.txt"
fi
if [ $step -eq 1 ]; then
  while [ ! -f "$out/.checkpoint.done" ]; do sleep 1; done
  bash "$tools_dir/gpu_run_ab.sh" --dev "$dev" --model "$model" "${untimed[@]}" \
    --rounds "$step_rounds" --runs 9 \
    --contexts 2048 --trees "$trees" "prev@BENCH=$prev/cuda_step_bench_prev" new "$@" \
    > "$out/step_ab.txt" 2>&1
  # Grouped by tree size, then in run order (configuration and round).
  grep -E '\| (decode|[0-9]+) \| [0-9.]+ \|' "$out/step_ab.txt" | sort -k13,13 -s
fi
rm -f "$out/.checkpoint.done"
