#!/usr/bin/env bash
# One GPU-host call that asks why the verify attention kernel takes ~50 us inside a model step but
# ~33 us in cuda_kernels_bench for the same 64-node 4-ary tree at 2048 keys (ninth run: the same
# grid, instruction count, DRAM bytes and SM clock under ncu; neither random data, cold L2 nor
# in-order blocks closed the gap). It profiles one launch of TreeAttentionKernel in each, with
# the time, the achieved occupancy, what limits the occupancy, and the shared-memory
# configuration (a step that ran one CTA an SM would take two waves of its 200 CTAs), then the
# benchmark with the engine's mask_begin encoding (BENCH_ATTN_SPINE=1) beside its own, then
# where a verify step's wall time goes beside the device's own time (--phases 1).
#   tools/gpu_run_attn_in_step.sh [--dev DIR]
# A 2-layer checkpoint at the 8B shape (written here, ~10 s) is enough: the kernel's inputs are
# one layer's.
set -u
tools_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # not "here": env.sh sets that
dev=.device
[ "${1:-}" = "--dev" ] && dev=$2
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
model=/tmp/specd-8b-2layers
. "$tools_dir/checkpoint.sh"
ensure_checkpoint llama-3.1-8b "$model" --layers 2
metrics=gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers
metrics+=,launch__shared_mem_config_size,launch__shared_mem_per_block_dynamic
metrics+=,launch__registers_per_thread,launch__grid_size,sm__ctas_launched.max
metrics+=,smsp__inst_executed.sum,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second
show() { grep -E '"(gpu__|sm__|smsp__|dram__|launch__)' | awk -F'","' -v w="$1" '{print w, $13, $15}'; }
# In the step as a graph replays it, and launched eagerly (a graph-only cause would show here).
for graphs in on off; do
  SPECD_GEMM_TIMING=0 timeout 150 ncu --clock-control none --profile-from-start off \
    -k regex:TreeAttentionKernel --launch-count 1 --metrics "$metrics" --csv --print-units base \
    "$dev/bin/bench/cuda_step_bench" --model "$model" --tp 1 --graphs "$graphs" --runs 1 \
    --contexts 2048 --trees 64 --profile 64 2>&1 | show "step(graphs $graphs)"
done
timeout 100 ncu --clock-control none -k regex:TreeAttentionKernel --launch-skip 20 \
  --launch-count 1 --metrics "$metrics" --csv --print-units base \
  "$dev/bin/bench/cuda_kernels_bench" \
  --benchmark_filter='VerifyAttentionShape/nodes:64/context:2048/shape:3' 2>&1 | show bench
# The engine encodes a tree's spine (its leading chain below the pending token) by mask_begin,
# which then differs between the queries of a tile; the benchmark's trees share one mask_begin
# unless BENCH_ATTN_SPINE=1. The kernel forms one window group per run of equal mask_begin.
bash "$tools_dir/gpu_run_attn_ab.sh" --dev "$dev" --rounds 2 \
  --filter 'VerifyAttentionShape/nodes:(64|256)/context:2048/shape:(0|3)' \
  shared spine@BENCH_ATTN_SPINE=1 | sort -k3,3 -s
# Where a step's wall time goes beside the device's own (cuda_step_bench --phases 1): host work
# before the upload and after the outcomes, launch, waiting. Host work does not depend on the
# layer count, so the 2-layer checkpoint shows it as the 8B one would.
SPECD_GEMM_TIMING=0 timeout 120 "$dev/bin/bench/cuda_step_bench" --model "$model" --tp 1 \
  --graphs on --runs 9 --contexts 2048 --trees 16,64 --phases 1 2>&1 | grep -E '^# phases|^\|'
