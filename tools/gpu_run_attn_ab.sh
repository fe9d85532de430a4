#!/usr/bin/env bash
# Side-by-side A/B of attention kernels in one GPU-host call: cuda_kernels_bench's attention cases
# (or any benchmark filter) under each configuration in turn, interleaved over rounds so that drift
# of the machine hits them alike; the counterpart of tools/gpu_run_ab.sh for whole steps.
#   tools/gpu_run_attn_ab.sh [--dev DIR] [--rounds 2] [--filter REGEX] CONFIG...
# CONFIG is label@VAR=value@VAR=value (no spaces); BENCH=path runs another cuda_kernels_bench
# binary (an A/B of two builds), e.g.
#   prev@BENCH=.device/bin/bench-prev/cuda_kernels_bench_prev  new  unsplit@BENCH_ATTN_UNSPLIT=1
# Prints one line per case and round: label, round, case, median µs (of 3 repetitions), and the
# case's split and CTA counters.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/ab_config.sh"
dev=.device rounds=2
filter='DecodeAttention/batch:1/context:(2048|8192)/masks:0|VerifyAttention/nodes:(16|64|256)/context:2048|VerifyAttention/nodes:64/context:8192'
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --filter) filter=$2; shift ;;
    --*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ $# -gt 0 ] || { echo "no configuration given" >&2; exit 2; }
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
for round in $(seq 1 "$rounds"); do
  for config in "$@"; do
    parse_ab_config "$config" "$dev/bin/bench/cuda_kernels_bench"
    # Median rows look like: BM_<case>/min_time:0.050/manual_time_median <ns> ... splits=17 ...
    env "${vars[@]}" timeout 300 "$bench" --benchmark_filter="$filter" --benchmark_repetitions=3 \
      --benchmark_report_aggregates_only=true 2>&1 |
      awk -v l="$label" -v r="$round" '/_median/ {
        name = $1; sub(/^BM_/, "", name); sub(/\/min_time.*/, "", name)
        extra = ""
        for (i = 3; i <= NF; ++i) if ($i ~ /^(splits|ctas)=/) extra = extra " " $i
        printf "%s r%s %s %.2f us%s\n", l, r, name, $2 / 1000, extra
      }'
  done
done
