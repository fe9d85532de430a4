#!/usr/bin/env bash
# Side-by-side A/B of the CUDA backend's environment switches in one GPU-host call: the whole-step
# benchmark (cuda_step_bench, 8B shape, graphs on) under each configuration in turn, the
# configurations interleaved over several rounds so that drift of the machine hits them alike.
#   tools/gpu_run_ab.sh [--dev DIR] [--tp "1 2"] [--rounds 2] [--runs 9] [--contexts 2048]
#       [--trees 64] [--model DIR] [--untimed-gemm] CONFIG...
# --untimed-gemm exports SPECD_GEMM_TIMING=0: every process then picks the same cuBLASLt
# algorithms (timed picks can differ between processes; the 64-node step moved by up to 0.3 ms
# between processes of one build in the eighth run), so an A/B of a non-GEMM change compares
# like with like.
# CONFIG is label@VAR=value@VAR=value (no spaces), e.g.
#   nopdl@SPECD_PDL=0  pdl  eager@SPECD_CUDA_GRAPHS=0
# BENCH=path runs another cuda_step_bench binary (an A/B of two builds), e.g.
#   before@BENCH=.device/bin/bench/cuda_step_bench_prev  after
# Needs the random 8B checkpoint (tools/bench/make_random_checkpoint.py; written here when
# missing). Prints each run's table rows prefixed by its label, round and TP.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/ab_config.sh"
. "$(dirname "${BASH_SOURCE[0]}")/checkpoint.sh"
dev=.device tps="1" rounds=2 runs=9 contexts=2048 trees=64 model=/tmp/specd-8b
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=$2; shift ;;
    --tp) tps=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --runs) runs=$2; shift ;;
    --contexts) contexts=$2; shift ;;
    --trees) trees=$2; shift ;;
    --model) model=$2; shift ;;
    --untimed-gemm) export SPECD_GEMM_TIMING=0 ;;
    --*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ $# -gt 0 ] || { echo "no configuration given" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
ensure_checkpoint llama-3.1-8b "$model" || exit 1
for round in $(seq 1 "$rounds"); do
  for tp in $tps; do
    for config in "$@"; do
      parse_ab_config "$config" "$dev/bin/bench/cuda_step_bench"
      echo "# $label round $round TP=$tp: $bench ${vars[*]:-(defaults)}"
      env "${vars[@]}" timeout 200 "$bench" --model "$model" --tp "$tp" \
        --custom_bytes -1 --graphs on --runs "$runs" --contexts "$contexts" --trees "$trees" 2>&1 |
        grep -E "^\|" | sed "s/^/$label r$round tp$tp /"
    done
  done
done
