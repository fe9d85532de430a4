#!/usr/bin/env bash
# One GPU-host call that shows where an 8B step's time goes as the step really runs (graph
# replay), from CUPTI's kernel timeline (cuda_step_bench --trace, bench/kernel_trace.h): for
# decode and each listed tree size, the span, the time kernels ran, the idle time between them,
# the time by kernel, and the idle time by the pair of kernels around it. The timelines go to
# $OUT (or --out DIR) as CSV files.
#   tools/gpu_run_trace.sh [--dev DIR] [--out DIR] [--trees 64] [--context 2048] [--graphs on]
#       [--tag NAME] [--bench PATH] [-- VAR=value ...]
# Variables after -- go to cuda_step_bench's environment (e.g. SPECD_PDL=0), and --tag names the
# files of that configuration; --bench PATH traces another build's cuda_step_bench (e.g. the
# carried bench-prev/cuda_step_bench_prev). The SM clock and power are sampled while each
# process runs (nvidia-smi, every 100 ms): a compute-bound kernel slows when the clock drops
# under load.
set -u
tools_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # not "here": env.sh sets that
dev=.device out=${OUT:-/tmp/trace} trees=64 context=2048 graphs=on tag=default bench=
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=$2; shift ;;
    --out) out=$2; shift ;;
    --trees) trees=$2; shift ;;
    --context) context=$2; shift ;;
    --graphs) graphs=$2; shift ;;
    --tag) tag=$2; shift ;;
    --bench) bench=$2; shift ;;
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
model=/tmp/specd-8b
. "$tools_dir/checkpoint.sh"
ensure_checkpoint llama-3.1-8b "$model"
# One traced size a process (--trace takes one); untimed GEMM picks, so that every process runs
# the same cuBLASLt kernels.
for nodes in 0 ${trees//,/ }; do
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
    > "$out/smi.txt" 2>/dev/null &
  smi=$!
  env SPECD_GEMM_TIMING=0 "$@" timeout 200 "${bench:-$dev/bin/bench/cuda_step_bench}" \
    --model "$model" --tp 1 --graphs "$graphs" --runs 5 --contexts "$context" --trees "$trees" --trace "$nodes" \
    --trace_csv "$out/${tag}_" > "$out/${tag}_$nodes.log" 2>&1
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  grep -E '^# trace|^\| model' "$out/${tag}_$nodes.log" | sed "s/^/$tag /"
  # The SM clock while the steps ran: over the samples drawing at least 80% of the most power
  # seen (the load, not the idle start or the checkpoint load).
  top=$(awk -F', ' '$2 > m {m = $2} END {print m + 0}' "$out/smi.txt")
  mapfile -t clocks < <(awk -F', ' -v t="$top" '$2 >= 0.8 * t {print $1}' "$out/smi.txt" | sort -n)
  [ ${#clocks[@]} -gt 0 ] && echo "$tag smi(trace $nodes): ${#clocks[@]} samples at >= 80% of" \
    "$top W, SM MHz min ${clocks[0]} median ${clocks[$(( ${#clocks[@]} / 2 ))]}"
done
rm -f "$out/smi.txt"
