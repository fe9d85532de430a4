#!/usr/bin/env bash
# GPU-host run for tensor parallelism and the CUDA speed work (issues 5 and 6), from the
# repository root with a packed build: every tests/gpu binary (one line each, failures in
# full), the all-reduce benchmark, the GEMM row-class benchmark, then whole-step benchmarks of
# a random Llama-3.1-8B-shaped checkpoint at TP=1 and TP=2 (custom all-reduce, and NCCL only)
# and, with --70b, of a Llama-3.1-70B-shaped checkpoint cut to LAYERS70 layers.
#   tools/gpu_run_tp.sh [--dev DIR] [--no-tests] [--no-8b] [--70b] [--attn] [--gptfast]
#       [--hf] [--1b] [--cluster] [--bf16check] [--nccl] [--gemm] [--profile]
# --gptfast adds gpt-fast at the 8B shape, TP=1 and TP=2 under torchrun
# (tools/bench/gpu_run_baselines.sh; needs .carry-gptfast), --hf transformers at 8B, --1b
# specd and gpt-fast at the Llama-3.2-1B shape, --profile the kernels of one 8B decode step and
# one 64-node verify step (ncu, TP=1; ncu aborted the two-GPU process in its first try)
# summarised by tools/bench/ncu_step_summary.py. Logs go to /tmp/tplogs and are tarred into
# $OUT/tp_logs.tgz at the end (the device tool returns at most 8 files). STREAMS="1 8 32" adds
# the cluster's end-to-end throughput rounds to --cluster.
set -u
profile=0 gemm=0 nccl=0 dev=.device tests=1 b8=1 b70=0 attn=0 gptfast=0 hf=0 b1=0 cluster=0 bf16check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=$2; shift ;;
    --no-tests) tests=0 ;;
    --no-8b) b8=0 ;;
    --70b) b70=1 ;;
    --attn) attn=1 ;;
    --gptfast) gptfast=1 ;;
    --hf) hf=1 ;;
    --1b) b1=1 ;;
    --cluster) cluster=1 ;;
    --nccl) nccl=1 ;;
    --gemm) gemm=1 ;;
    --profile) profile=1 ;;
    --bf16check) bf16check=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
logs=/tmp/tplogs
mkdir -p "$logs"
t0=$(date +%s)
stamp() { echo "--- $(( $(date +%s) - t0 )) s: $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
ngpu=$(nvidia-smi -L | wc -l)

if [ $tests -eq 1 ]; then
  stamp "GPU tests"
  for t in "$dev"/bin/tests/*_cuda_test "$dev"/bin/tests/cuda_*_test "$dev"/bin/tests/gemm_invariance_test; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    log=$logs/tp_$name.log
    s=$(date +%s)
    if timeout 240 "$t" > "$log" 2>&1; then
      echo "PASS $name ($(( $(date +%s) - s )) s): $(grep -E '^\[  PASSED  \]|SKIPPED \]' "$log" | tr '\n' ' ')"
    else
      rc=$?
      echo "FAIL $name (exit $rc, $(( $(date +%s) - s )) s):"
      grep -B2 -A14 -E 'Failure$|: Failure|FATAL' "$log" | head -90
      grep -E '^\[  FAILED  \]' "$log"
    fi
    grep -E '^(prompt|pycoder|TP=2|speculative|.* vs CPU: )' "$log" | head -20
  done
fi

if [ $bf16check -eq 1 ]; then
  stamp "transformers bf16 vs fp32 on the family fixtures"
  timeout 120 python3 tools/oracle/bf16_error.py 2>&1 | tail -8
fi
if [ $cluster -eq 1 ] && [ "$ngpu" -ge 2 ]; then
  stamp "cluster: verify tensor parallel on GPUs 0,1, draft on GPU 0"
  timeout 300 tools/gpu_cluster_check.sh "$dev" --verify-devices 0,1 ${STREAMS:+--streams "$STREAMS"} 2>&1 |
    tee "$logs/tp_cluster.log" | tail -24
fi

stamp "all-reduce benchmark"
[ "$ngpu" -ge 2 ] && timeout 120 "$dev/bin/bench/cuda_allreduce_bench" 2>&1 | tee "$logs/tp_allreduce_bench.log" | tail -30

if [ $gemm -eq 1 ]; then
stamp "GEMM row classes"
timeout 150 "$dev/bin/bench/cuda_kernels_bench" --benchmark_filter=Gemm --benchmark_counters_tabular=true \
  --benchmark_min_time=0.05 > "$logs/tp_gemm_bench.log" 2> "$logs/tp_gemm_bench.err"
grep -E "^BM_Gemm|Name|own_algo" "$logs/tp_gemm_bench.log" | head -60
fi

if [ $attn -eq 1 ]; then
  stamp "attention kernels"
  timeout 120 "$dev/bin/bench/cuda_kernels_bench" --benchmark_filter=Attention --benchmark_min_time=0.05 \
    2>&1 | tee "$logs/tp_attn_bench.log" | grep -E "^BM_" | head -40
fi

. "$(dirname "${BASH_SOURCE[0]}")/checkpoint.sh"
ensure_8b() {  # the random Llama-3.1-8B-shaped checkpoint, written once per host
  ensure_checkpoint llama-3.1-8b /tmp/specd-8b
}
steps() {  # model label tp custom_bytes extra...
  local model=$1 label=$2 tp=$3 cb=$4; shift 4
  timeout 200 "$dev/bin/bench/cuda_step_bench" --model "$model" --label "$label" --tp "$tp" \
    --custom_bytes "$cb" --graphs on "$@" 2>&1 | tee -a "$logs/tp_steps.log" | grep -E "^\||^#"
}
if [ $b8 -eq 1 ]; then
  stamp "8B checkpoint"
  ensure_8b
  stamp "8B steps, TP=1"
  steps /tmp/specd-8b llama-3.1-8b 1 -1 --runs 9 --contexts 2048 --trees 16,64,128
  if [ "$ngpu" -ge 2 ]; then
    stamp "8B steps, TP=2 custom"
    steps /tmp/specd-8b llama-3.1-8b 2 -1 --runs 9 --contexts 2048 --trees 16,64,128
    if [ $nccl -eq 1 ]; then
      stamp "8B steps, TP=2 NCCL only"
      steps /tmp/specd-8b llama-3.1-8b 2 0 --runs 9 --contexts 2048 --trees 64
    fi
  fi
fi
if [ $profile -eq 1 ]; then
  ensure_8b
  for nodes in 0 64; do
    stamp "ncu: 8B TP=1, one step of $nodes tree nodes"
    csv=$logs/ncu_tp1_n${nodes}.csv
    timeout 300 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
      --csv --print-units base "$dev/bin/bench/cuda_step_bench" --model /tmp/specd-8b --tp 1 \
      --graphs on --runs 3 --contexts 2048 --trees 64 --profile "$nodes" > "$csv" 2> "$csv.err"
    grep -E "^\|" "$csv" | head -4
    python3 tools/bench/ncu_step_summary.py "$csv" | head -30
    tail -3 "$csv.err"
  done
fi
if [ $b70 -eq 1 ]; then
  L=${LAYERS70:-8}
  stamp "70B-shaped checkpoint, $L layers"
  ensure_checkpoint llama-3.1-70b /tmp/specd-70b --layers "$L"
  stamp "70B steps, TP=1"
  steps /tmp/specd-70b "llama-3.1-70b/$L" 1 -1 --runs 9 --contexts 2048 --trees 64
  if [ "$ngpu" -ge 2 ]; then
    stamp "70B steps, TP=2"
    steps /tmp/specd-70b "llama-3.1-70b/$L" 2 -1 --runs 9 --contexts 2048 --trees 64
  fi
fi
if [ $gptfast -eq 1 ]; then
  stamp "gpt-fast 8B, TP=1 and TP=2"
  parts="gptfast:8b"
  [ "$ngpu" -ge 2 ] && parts="$parts gptfast-tp2:8b"
  OUT=$logs GF_TREES=${GF_TREES:-64} GF_BUDGET_S=${GF_BUDGET_S:-100} GF_TIMEOUT_S=${GF_TIMEOUT_S:-200} \
    CONTEXTS=${CONTEXTS:-2048} timeout 480 tools/bench/gpu_run_baselines.sh $parts 2>&1 | tail -40
fi
if [ $hf -eq 1 ]; then
  stamp "transformers 8B"
  OUT=$logs CONTEXTS=${CONTEXTS:-2048} timeout 200 tools/bench/gpu_run_baselines.sh hf:8b 2>&1 | tail -20
fi
if [ $b1 -eq 1 ]; then
  stamp "1B checkpoint"
  ensure_checkpoint llama-3.2-1b /tmp/specd-1b
  steps /tmp/specd-1b llama-3.2-1b 1 -1 --runs 9 --contexts 512,2048,8192 --trees 16,64,128,256
  OUT=$logs GF_TREES=${GF_TREES:-64} GF_BUDGET_S=${GF_BUDGET_S:-100} GF_TIMEOUT_S=${GF_TIMEOUT_S:-200} \
    CONTEXTS=${CONTEXTS:-2048} timeout 300 tools/bench/gpu_run_baselines.sh gptfast:1b 2>&1 | tail -20
fi
stamp "done"
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/tp_logs.tgz" -C "$logs" . ; fi
