#!/usr/bin/env bash
# tools/gpu/run.sh and tools/gpu/pack.sh without a GPU: every command's dry run prints the
# commands it stands for, bad arguments are refused, and the pack of this build carries the
# service libraries but none of the C/C++ runtime or CUDA libraries the GPU host has.
#   tests/tools/gpu_tools_test.sh BUILD_DIR        (from the repository root)
set -uo pipefail
build=${1:?usage: gpu_tools_test.sh BUILD_DIR}
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect ARGS -- PATTERN...: the dry run of ARGS succeeds and prints each extended regex.
expect() {
  local args=() out rc pattern
  while [ "$1" != -- ]; do args+=("$1"); shift; done
  shift
  out=$(tools/gpu/run.sh --dry-run --dev /nonexistent "${args[@]}" 2>&1)
  rc=$?
  [ $rc -eq 0 ] || { fail "run.sh ${args[*]}: exit $rc: $out"; return; }
  for pattern in "$@"; do
    grep -qE -- "$pattern" <<<"$out" || fail "run.sh ${args[*]}: no line matching '$pattern' in:
$out"
  done
}
expect tests -- '^\+ timeout 300 /nonexistent/bin/tests/\\\*_cuda_test$'
expect tests --only "a_cuda_test b_cuda_test" --timeout 9 -- \
  '^\+ timeout 9 /nonexistent/bin/tests/a_cuda_test$' '^\+ timeout 9 /nonexistent/bin/tests/b_'
expect sanitize -- 'compute-sanitizer --tool memcheck .*tree_attention_cuda_test' \
  'compute-sanitizer --tool racecheck .*sampling_cuda_test'
expect kernels --filter Gemm -- 'cuda_kernels_bench .*--benchmark_filter=Gemm'
expect steps --shape llama-3.1-70b --layers 8 --tp "1 2" -- \
  'make_random_checkpoint.py --shape llama-3.1-70b --out /tmp/specd-llama-3.1-70b-8 --layers 8' \
  'cuda_step_bench --model /tmp/specd-llama-3.1-70b-8 .*--tp 1 ' \
  'cuda_step_bench --model /tmp/specd-llama-3.1-70b-8 .*--tp 2 '
expect allreduce -- 'cuda_allreduce_bench$'
expect ab --untimed-gemm --rounds 1 base nopdl@SPECD_PDL=0 prev@BENCH=/p/cuda_step_bench_prev -- \
  '^\+ env SPECD_GEMM_TIMING=0 timeout 200 /nonexistent/bin/bench/cuda_step_bench ' \
  '^\+ env SPECD_GEMM_TIMING=0 SPECD_PDL=0 timeout 200 /nonexistent/bin/bench/cuda_step_bench ' \
  '^\+ env SPECD_GEMM_TIMING=0 timeout 200 /p/cuda_step_bench_prev '
expect attn-ab --rounds 1 a b@BENCH_ATTN_SPINE=1 -- \
  '^\+ env timeout 300 .*cuda_kernels_bench --benchmark_filter=' \
  '^\+ env BENCH_ATTN_SPINE=1 timeout 300 '
expect validate --no-step -- 'tree_attention_cuda_test$' 'bench-prev/cuda_kernels_bench_prev'
expect trace --trees 16,64 -- '--trace 0 ' '--trace 16 ' '--trace 64 '
expect profile -- 'ncu .*cuda_step_bench .*--profile 0$' 'ncu .*--profile 64$'
expect kernel-profile -- 'ncu .*-k regex:TreeAttentionKernel .*cuda_step_bench' '--phases 1'
expect tp --no-tests --70b -- 'cuda_allreduce_bench' 'shape llama-3.1-70b' '--tp 2 '
expect cluster -- 'specd-verify --address 127\.0\.0\.1:[0-9]+ ' \
  'specd-draft .*--eagle_head models/pycoder-eagle3' \
  'specd-router .*--draft_address' 'specd-cli generate .*--speculation off' \
  'specd-cli generate .*--speculation draft_model' 'specd-cli generate .*--speculation eagle3'
expect baselines hf:8b -- 'bench/tools/baselines\.sh hf:8b$'
expect bf16check -- 'tools/oracle/bf16_error\.py$'

for bad in "nosuchcommand" "tests --bogus" "ab" "ab --rounds" "steps --tp"; do
  # shellcheck disable=SC2086  # words on purpose
  if tools/gpu/run.sh --dry-run $bad >/dev/null 2>&1; then fail "run.sh $bad: accepted"; fi
done

out=$(tools/gpu/pack.sh --build "$build" --all --dry-run 2>&1)
rc=$?
if [ $rc -ne 0 ]; then
  fail "pack.sh --dry-run: exit $rc: $out"
else
  grep -qE '^executable tests/' <<<"$out" || fail "pack.sh: no test executable in: $out"
  if grep -E '^library ' <<<"$out" |
      grep -E '/(libc|libstdc\+\+|libgcc_s|libm|ld-linux[^/]*|libcuda|libcudart|libcublas|libnccl)\.so'; then
    fail "pack.sh: packs a library the GPU host has"
  fi
  grep -qE '^would pack [0-9]+ executables and [0-9]+ libraries' <<<"$out" ||
    fail "pack.sh: no summary line in: $out"
fi
tools/gpu/pack.sh --build /nonexistent >/dev/null 2>&1 && fail "pack.sh: accepted a missing build"

[ $fails -eq 0 ] && echo "all passed"
exit $((fails > 0))
