#!/usr/bin/env bash
# The one entry point for work on a GPU host, run there from the repository root with a build
# packed by tools/gpu/pack.sh and unpacked into .device:
#
#   tools/gpu/run.sh [--dev DIR] [--out DIR] [--dry-run] COMMAND [ARGS...]
#
#   --dev DIR   the unpacked build (default .device); its env.sh is sourced
#   --out DIR   where logs and CSV files go (default $OUT, else /tmp/specd-gpu)
#   --dry-run   print the commands instead of running them (no GPU needed)
#
# Commands (`tools/gpu/run.sh COMMAND --help` shows each one's options):
#   tests      every tests/gpu binary: one PASS/FAIL line each, the failures' lines
#   sanitize   compute-sanitizer memcheck and racecheck over the sampling and attention tests
#   kernels    cuda_kernels_bench rows (attention, sampling, GEMM, ... by filter)
#   steps      whole-step benchmark (cuda_step_bench) of a random checkpoint of a model shape
#   allreduce  the custom all-reduce against NCCL (cuda_allreduce_bench, two GPUs or more)
#   ab         A/B of whole steps under several configurations, interleaved over rounds
#   attn-ab    A/B of the attention kernels under several configurations
#   validate   a kernel change against the build before it: tests, attn-ab, ab
#   trace      where a step's time goes as a graph replays it (CUPTI timeline, SM clock)
#   profile    ncu: every kernel of one decode and one verify step, summed by kernel
#   kernel-profile  ncu: one launch of a kernel inside a step and in cuda_kernels_bench, side
#              by side (time, occupancy and its limits, shared memory), then the step's phases
#   tp         the tensor-parallel suite: tests, all-reduce, 8B steps at TP=1 and 2, options
#   cluster    the three services on real models: lossless check and throughput rounds
#   baselines  peer implementations at the same shapes (bench/tools/baselines.sh PART...)
#   bf16check  transformers bf16 against fp32 on the model-family fixtures
#
# Random checkpoints (bench/tools/make_random_checkpoint.py) are written under /tmp on the host
# the first time a command needs one, never carried. NVLink multicast stays off.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dev=.device
out=${OUT:-/tmp/specd-gpu}
dry=0
exec 3>&1  # the dry run prints here, past the pipes and redirections of what it replaces

usage() { sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
# help_for FUNCTION: the comment block right above FUNCTION's definition (in this file or lib/).
help_for() {
  awk -v fn="$1()" '/^#/ {block = block substr($0, 3) "\n"; next}
    index($0, fn) == 1 {printf "%s", block; exit} {block = ""}' \
    "${BASH_SOURCE[0]}" "$repo"/tools/gpu/lib/*.sh
}

# x CMD...: runs CMD, or prints it in a dry run.
x() {
  if [ $dry -eq 1 ]; then
    local a line="+"
    for a in "$@"; do
      if [[ $a =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then line+=" $a"; else line+=" $(printf '%q' "$a")"; fi
    done
    echo "$line" >&3
    return 0
  fi
  "$@"
}

t0=$(date +%s)
stamp() { echo "--- $(($(date +%s) - t0)) s: $*"; }
gpu_info() { x nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm,driver_version \
  --format=csv,noheader; }
gpu_count() { if [ $dry -eq 1 ]; then echo 2; else nvidia-smi -L 2>/dev/null | wc -l; fi; }

# ensure_checkpoint SHAPE DIR [ARGS...]: writes the random checkpoint SHAPE (llama-3.1-8b,
# llama-3.2-1b, llama-3.1-70b, ...) to DIR with ARGS (e.g. --layers 2) unless DIR has one.
ensure_checkpoint() {
  local shape=$1 dir=$2 log rc
  shift 2
  [ -f "$dir/model.safetensors" ] && return 0
  if [ $dry -eq 1 ]; then
    x python3 "$repo/bench/tools/make_random_checkpoint.py" --shape "$shape" --out "$dir" "$@"
    return 0
  fi
  log=$(mktemp)
  python3 "$repo/bench/tools/make_random_checkpoint.py" --shape "$shape" --out "$dir" "$@" \
    >"$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || tail -3 "$log"
  rm -f "$log"
  return $rc
}

# parse_ab_config CONFIG DEFAULT_BENCH: one A/B configuration, label@VAR=value@VAR=value (no
# spaces), BENCH=path naming another benchmark binary (an A/B of two builds). Sets label, bench
# and vars (VAR=value words for env).
parse_ab_config() {
  local config=$1 rest part parts
  label=${config%%@*}
  vars=()
  bench=$2
  rest=${config#"$label"}
  IFS='@' read -r -a parts <<<"${rest#@}"
  for part in "${parts[@]}"; do
    case "$part" in
      BENCH=*) bench=${part#BENCH=} ;;
      ?*) vars+=("$part") ;;
    esac
  done
}

need() {  # need OPTION VALUE: the value an option takes, or exit 2
  [ $# -ge 2 ] && [ -n "$2" ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
}

# tests [--only "NAME ..."] [--timeout S]
#   Each tests/gpu binary of the pack (*_cuda_test, cuda_*_test, gemm_invariance_test), or the
#   named ones, under a timeout (default 300 s: a hung kernel costs that, not the whole call).
#   Logs go to OUT/test_NAME.log. Exit status 1 when one failed.
cmd_tests() {
  local only="" timeout=300 t name log s rc fail=0 list=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --only) need "$@"; only=$2; shift ;;
      --timeout) need "$@"; timeout=$2; shift ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "tests: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  if [ -n "$only" ]; then
    for t in $only; do list+=("$dev/bin/tests/$t"); done
  else
    for t in "$dev"/bin/tests/*_cuda_test "$dev"/bin/tests/cuda_*_test \
        "$dev"/bin/tests/gemm_invariance_test; do
      [ -x "$t" ] && list+=("$t")
    done
    if [ ${#list[@]} -eq 0 ] && [ $dry -eq 1 ]; then
      list=("$dev/bin/tests/*_cuda_test" "$dev/bin/tests/cuda_*_test" \
        "$dev/bin/tests/gemm_invariance_test")
    fi
  fi
  [ ${#list[@]} -gt 0 ] || { echo "tests: no GPU test binaries under $dev/bin/tests" >&2; return 2; }
  for t in "${list[@]}"; do
    name=$(basename "$t")
    log=$out/test_$name.log
    s=$(date +%s)
    x timeout "$timeout" "$t" >"$log" 2>&1
    rc=$?
    [ $dry -eq 1 ] && continue
    if [ $rc -eq 0 ]; then
      echo "PASS $name ($(($(date +%s) - s)) s): $(grep -E '^\[  PASSED  \]|SKIPPED \]' "$log" |
        tr '\n' ' ')"
    else
      fail=1
      echo "FAIL $name (exit $rc, $(($(date +%s) - s)) s):"
      grep -B2 -A14 -E 'Failure$|: Failure|FATAL' "$log" | head -90
      grep -E '^\[  FAILED  \]' "$log"
    fi
    # Lines the tests print for a report: match lengths, graph counts, acceptance, TP checks.
    grep -E '^(prompt|pycoder|TP=2|speculative|graphs captured|draft on|.* vs CPU: )' "$log" |
      head -20
  done
  return $fail
}

# sanitize
#   compute-sanitizer memcheck and racecheck over sampling_cuda_test and tree_attention_cuda_test
#   (racecheck on the edge rows and decode cases only: it is slow). Exit 1 on any error.
cmd_sanitize() {
  [ "${1:-}" = --help ] || [ "${1:-}" = -h ] && { help_for "${FUNCNAME[0]}"; return 0; }
  local t tool filter rc fail=0 log
  if [ $dry -eq 0 ] && ! command -v compute-sanitizer >/dev/null; then
    echo "sanitize: no compute-sanitizer on this host" >&2
    return 2
  fi
  for t in sampling_cuda_test tree_attention_cuda_test; do
    for tool in memcheck racecheck; do
      filter='*'
      [ $tool = racecheck ] && filter='*SplitPathEdgeRows*:*Decode*:*TiesFollow*'
      log=$out/sanitize_${t}_$tool.log
      x compute-sanitizer --tool $tool --error-exitcode 9 "$dev/bin/tests/$t" --gtest_brief=1 \
        --gtest_filter="$filter" >"$log" 2>&1
      rc=$?
      [ $dry -eq 1 ] && continue
      printf '%-28s %-9s rc=%d %s\n' "$t" "$tool" "$rc" "$(grep -E 'ERROR SUMMARY' "$log" | tail -1)"
      [ $rc -eq 0 ] || { fail=1; tail -30 "$log"; }
    done
  done
  return $fail
}

# kernels [--filter REGEX] [--min-time S]
#   cuda_kernels_bench, default filter 'Attention|Sample', printed as name, time and counters
#   (kv_GBps, splits, ctas). The full output goes to OUT/kernels.log.
cmd_kernels() {
  local filter='Attention|Sample' min_time=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --filter) need "$@"; filter=$2; shift ;;
      --min-time) need "$@"; min_time=$2; shift ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "kernels: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  x timeout 300 "$dev/bin/bench/cuda_kernels_bench" --benchmark_counters_tabular=true \
    --benchmark_filter="$filter" ${min_time:+--benchmark_min_time="$min_time"} \
    >"$out/kernels.log" 2>&1
  grep -E '^BM_|own_algo' "$out/kernels.log" | awk '{$4 = $5 = ""; print}' | sed 's/  */ /g'
}

# steps [--shape S] [--layers N] [--tp "1 2"] [--custom-bytes B] [--graphs on|off] [--runs N]
#       [--contexts LIST] [--trees LIST] [--label L] [-- MORE_BENCH_FLAGS]
#   cuda_step_bench on a random checkpoint of shape S (default llama-3.1-8b; llama-3.2-1b,
#   llama-3.1-70b with --layers) at each TP size (default 1): the step table rows. Custom bytes
#   -1 lets the benchmark choose the custom all-reduce; 0 is NCCL only.
cmd_steps() {
  local shape=llama-3.1-8b layers="" tps=1 cb=-1 graphs=on runs=9 contexts=2048 trees=16,64,128
  local label="" model tp more=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --shape) need "$@"; shape=$2; shift ;;
      --layers) need "$@"; layers=$2; shift ;;
      --tp) need "$@"; tps=$2; shift ;;
      --custom-bytes) need "$@"; cb=$2; shift ;;
      --graphs) need "$@"; graphs=$2; shift ;;
      --runs) need "$@"; runs=$2; shift ;;
      --contexts) need "$@"; contexts=$2; shift ;;
      --trees) need "$@"; trees=$2; shift ;;
      --label) need "$@"; label=$2; shift ;;
      --) shift; more=("$@"); break ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "steps: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  model=/tmp/specd-$shape${layers:+-$layers}
  label=${label:-$shape${layers:+/$layers}}
  ensure_checkpoint "$shape" "$model" ${layers:+--layers "$layers"} || return 1
  for tp in $tps; do
    stamp "$label steps, TP=$tp"
    x timeout 200 "$dev/bin/bench/cuda_step_bench" --model "$model" --label "$label" --tp "$tp" \
      --custom_bytes "$cb" --graphs "$graphs" --runs "$runs" --contexts "$contexts" \
      --trees "$trees" "${more[@]}" 2>&1 | tee -a "$out/steps.log" | grep -E '^\||^#'
  done
}

# allreduce
#   cuda_allreduce_bench: the custom all-reduce beside NCCL's over message sizes (two GPUs).
cmd_allreduce() {
  [ "${1:-}" = --help ] || [ "${1:-}" = -h ] && { help_for "${FUNCNAME[0]}"; return 0; }
  [ "$(gpu_count)" -ge 2 ] || { echo "allreduce: needs two GPUs" >&2; return 2; }
  x timeout 120 "$dev/bin/bench/cuda_allreduce_bench" 2>&1 | tee "$out/allreduce.log" | tail -30
}

# ab [--tp "1 2"] [--rounds 2] [--runs 9] [--contexts 2048] [--trees 64] [--shape S]
#    [--untimed-gemm] CONFIG...
#   The whole-step benchmark (graphs on) under each configuration in turn, interleaved over
#   rounds so that drift of the machine hits them alike. CONFIG is label@VAR=value@... (no
#   spaces), e.g. `pdl nopdl@SPECD_PDL=0 eager@SPECD_CUDA_GRAPHS=0`; BENCH=path runs another
#   binary, e.g. `prev@BENCH=.device/bin/bench-prev/cuda_step_bench_prev new`. --untimed-gemm
#   sets SPECD_GEMM_TIMING=0: every process then runs the same cuBLASLt algorithms (timed picks
#   can differ between processes by tenths of a millisecond a step), so an A/B of a non-GEMM
#   change compares like with like. Rows are prefixed by label, round and TP.
cmd_ab() {
  local tps=1 rounds=2 runs=9 contexts=2048 trees=64 shape=llama-3.1-8b untimed=() round tp config
  while [ $# -gt 0 ]; do
    case "$1" in
      --tp) need "$@"; tps=$2; shift ;;
      --rounds) need "$@"; rounds=$2; shift ;;
      --runs) need "$@"; runs=$2; shift ;;
      --contexts) need "$@"; contexts=$2; shift ;;
      --trees) need "$@"; trees=$2; shift ;;
      --shape) need "$@"; shape=$2; shift ;;
      --untimed-gemm) untimed=(SPECD_GEMM_TIMING=0) ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      --*) echo "ab: unknown option $1" >&2; return 2 ;;
      *) break ;;
    esac
    shift
  done
  [ $# -gt 0 ] || { echo "ab: no configuration given" >&2; return 2; }
  ensure_checkpoint "$shape" "/tmp/specd-$shape" || return 1
  for round in $(seq 1 "$rounds"); do
    for tp in $tps; do
      for config in "$@"; do
        parse_ab_config "$config" "$dev/bin/bench/cuda_step_bench"
        echo "# $label round $round TP=$tp: $bench ${untimed[*]:+${untimed[*]} }${vars[*]:-(defaults)}"
        x env "${untimed[@]}" "${vars[@]}" timeout 200 "$bench" --model "/tmp/specd-$shape" \
          --tp "$tp" --custom_bytes -1 --graphs on --runs "$runs" --contexts "$contexts" \
          --trees "$trees" 2>&1 | grep -E '^\|' | sed "s/^/$label r$round tp$tp /"
      done
    done
  done
}

# attn-ab [--rounds 2] [--filter REGEX] CONFIG...
#   cuda_kernels_bench's attention cases under each configuration (as for ab; BENCH=path names
#   another cuda_kernels_bench, e.g. .device/bin/bench-prev/cuda_kernels_bench_prev),
#   interleaved over rounds: one line per case and round with the median of 3 repetitions in
#   µs and the case's split and CTA counters.
cmd_attn_ab() {
  local rounds=2 round config
  local filter='DecodeAttention/batch:1/context:(2048|8192)/masks:0|VerifyAttention/nodes:(16|64|256)/context:2048|VerifyAttention/nodes:64/context:8192'
  while [ $# -gt 0 ]; do
    case "$1" in
      --rounds) need "$@"; rounds=$2; shift ;;
      --filter) need "$@"; filter=$2; shift ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      --*) echo "attn-ab: unknown option $1" >&2; return 2 ;;
      *) break ;;
    esac
    shift
  done
  [ $# -gt 0 ] || { echo "attn-ab: no configuration given" >&2; return 2; }
  for round in $(seq 1 "$rounds"); do
    for config in "$@"; do
      parse_ab_config "$config" "$dev/bin/bench/cuda_kernels_bench"
      # Median rows: BM_<case>/min_time:0.050/manual_time_median <ns> ... splits=17 ...
      x env "${vars[@]}" timeout 300 "$bench" --benchmark_filter="$filter" \
        --benchmark_repetitions=3 --benchmark_report_aggregates_only=true 2>&1 |
        awk -v l="$label" -v r="$round" '/_median/ {
          name = $1; sub(/^BM_/, "", name); sub(/\/min_time.*/, "", name)
          extra = ""
          for (i = 3; i <= NF; ++i) if ($i ~ /^(splits|ctas)=/) extra = extra " " $i
          printf "%s r%s %s %.2f us%s\n", l, r, name, $2 / 1000, extra
        }'
    done
  done
}

# validate [--tests "NAME ..."] [--attn-rounds 2] [--step-rounds 3] [--trees 16,64]
#          [--attn-filter REGEX] [--no-step] [--no-attn] [--untimed-gemm] [-- CONFIG...]
#   A kernel change against the build before it, whose benchmarks travel as
#   DEV/bin/bench-prev/cuda_{kernels,step}_bench_prev (build/bench-prev/ here; pack.sh keeps
#   them): the named tests (default tree attention, the op table, model, graphs), then attn-ab
#   and ab of "prev" against "new" plus the CONFIGs after --. The 8B checkpoint is written meanwhile.
#   Results go to OUT/attn_ab.txt and OUT/step_ab.txt; sorted summaries are printed.
cmd_validate() {
  local tests="tree_attention_cuda_test ops_cuda_test cuda_model_test cuda_graph_test"
  local attn_rounds=2
  local step_rounds=3 trees=16,64 attn_filter="" step=1 attn=1 untimed=() ckpt=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --tests) need "$@"; tests=$2; shift ;;
      --attn-rounds) need "$@"; attn_rounds=$2; shift ;;
      --step-rounds) need "$@"; step_rounds=$2; shift ;;
      --trees) need "$@"; trees=$2; shift ;;
      --attn-filter) need "$@"; attn_filter=$2; shift ;;
      --no-step) step=0 ;;
      --no-attn) attn=0 ;;
      --untimed-gemm) untimed=(--untimed-gemm) ;;
      --) shift; break ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "validate: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  local prev=$dev/bin/bench-prev
  if [ $step -eq 1 ] && [ $dry -eq 0 ]; then
    ensure_checkpoint llama-3.1-8b /tmp/specd-llama-3.1-8b >"$out/checkpoint.log" 2>&1 &
    ckpt=$!
  fi
  gpu_info
  cmd_tests --only "$tests"
  if [ $attn -eq 1 ]; then
    cmd_attn_ab --rounds "$attn_rounds" ${attn_filter:+--filter "$attn_filter"} \
      "prev@BENCH=$prev/cuda_kernels_bench_prev" new "$@" >"$out/attn_ab.txt" 2>&1
    sort -k3,3 -k1,1 -s "$out/attn_ab.txt"  # by case, then by configuration
  fi
  if [ $step -eq 1 ]; then
    [ -n "$ckpt" ] && wait "$ckpt"
    cmd_ab "${untimed[@]}" --rounds "$step_rounds" --runs 9 --contexts 2048 --trees "$trees" \
      "prev@BENCH=$prev/cuda_step_bench_prev" new "$@" >"$out/step_ab.txt" 2>&1
    # By tree size, then in run order (configuration and round).
    grep -E '\| (decode|[0-9]+) \| [0-9.]+ \|' "$out/step_ab.txt" | sort -k13,13 -s
  fi
}

# trace [--trees 64] [--context 2048] [--graphs on] [--tag NAME] [--bench PATH] [-- VAR=value...]
#   CUPTI's kernel timeline of 8B steps (cuda_step_bench --trace) for decode and each tree size:
#   the span, the time kernels ran, the idle time between them, by kernel and by the pair of
#   kernels around each gap. Timelines go to OUT as CSV files named by --tag. Variables after --
#   go to the benchmark's environment; --bench traces another build's cuda_step_bench. The SM
#   clock and power are sampled meanwhile (a compute-bound kernel slows when the clock drops).
cmd_trace() {
  local trees=64 context=2048 graphs=on tag=default bench="" nodes smi top clocks
  while [ $# -gt 0 ]; do
    case "$1" in
      --trees) need "$@"; trees=$2; shift ;;
      --context) need "$@"; context=$2; shift ;;
      --graphs) need "$@"; graphs=$2; shift ;;
      --tag) need "$@"; tag=$2; shift ;;
      --bench) need "$@"; bench=$2; shift ;;
      --) shift; break ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "trace: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  ensure_checkpoint llama-3.1-8b /tmp/specd-llama-3.1-8b || return 1
  # One traced size a process (--trace takes one); untimed GEMM picks so that every process
  # runs the same cuBLASLt kernels.
  for nodes in 0 ${trees//,/ }; do
    if [ $dry -eq 0 ]; then
      nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 \
        >"$out/smi.txt" 2>/dev/null &
      smi=$!
    fi
    x env SPECD_GEMM_TIMING=0 "$@" timeout 200 "${bench:-$dev/bin/bench/cuda_step_bench}" \
      --model /tmp/specd-llama-3.1-8b --tp 1 --graphs "$graphs" --runs 5 --contexts "$context" \
      --trees "$trees" --trace "$nodes" --trace_csv "$out/${tag}_" >"$out/${tag}_$nodes.log" 2>&1
    [ $dry -eq 1 ] && continue
    kill "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
    grep -E '^# trace|^\| model' "$out/${tag}_$nodes.log" | sed "s/^/$tag /"
    # The SM clock under load: samples drawing at least 80% of the most power seen.
    top=$(awk -F', ' '$2 > m {m = $2} END {print m + 0}' "$out/smi.txt")
    mapfile -t clocks < <(awk -F', ' -v t="$top" '$2 >= 0.8 * t {print $1}' "$out/smi.txt" |
      sort -n)
    [ ${#clocks[@]} -gt 0 ] && echo "$tag smi(trace $nodes): ${#clocks[@]} samples at >= 80%" \
      "of $top W, SM MHz min ${clocks[0]} median ${clocks[$((${#clocks[@]} / 2))]}"
  done
  rm -f "$out/smi.txt"
}

# profile [--nodes "0 64"]
#   ncu over every kernel of one 8B step at TP=1 (0 nodes: decode; N: an N-node verify step),
#   summed by kernel (bench/tools/ncu_step_summary.py). CSVs go to OUT/ncu_nN.csv.
cmd_profile() {
  local nodes_list="0 64" nodes csv
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) need "$@"; nodes_list=$2; shift ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "profile: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  ensure_checkpoint llama-3.1-8b /tmp/specd-llama-3.1-8b || return 1
  for nodes in $nodes_list; do
    stamp "ncu: 8B TP=1, one step of $nodes tree nodes"
    csv=$out/ncu_n$nodes.csv
    x timeout 300 ncu --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv --print-units base \
      "$dev/bin/bench/cuda_step_bench" --model /tmp/specd-llama-3.1-8b --tp 1 --graphs on \
      --runs 3 --contexts 2048 --trees 64 --profile "$nodes" >"$csv" 2>"$csv.err"
    [ $dry -eq 1 ] && continue
    grep -E '^\|' "$csv" | head -4
    python3 "$repo/bench/tools/ncu_step_summary.py" "$csv" | head -30
    tail -3 "$csv.err"
  done
}

# kernel-profile [--kernel REGEX] [--bench-filter FILTER] [--nodes 64] [--context 2048]
#   One launch of the kernel (default TreeAttentionKernel) under ncu inside a verify step of a
#   2-layer 8B-shaped checkpoint, as a graph replays it and launched eagerly, and inside
#   cuda_kernels_bench (FILTER, default the same 64-node tree at 2048 keys): time, achieved
#   occupancy, what limits it, shared-memory configuration, instructions, DRAM bytes, SM clock.
#   Then the benchmark's trees with the engine's mask encoding of a tree's spine
#   (BENCH_ATTN_SPINE=1) beside its own, and where the step's wall time goes beside the
#   device's (cuda_step_bench --phases 1: host work, launch, waiting).
cmd_kernel_profile() {
  local kernel=TreeAttentionKernel nodes=64 context=2048 graphs metrics bench_filter=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --kernel) need "$@"; kernel=$2; shift ;;
      --bench-filter) need "$@"; bench_filter=$2; shift ;;
      --nodes) need "$@"; nodes=$2; shift ;;
      --context) need "$@"; context=$2; shift ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "kernel-profile: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  bench_filter=${bench_filter:-VerifyAttentionShape/nodes:$nodes/context:$context/shape:3}
  local model=/tmp/specd-llama-3.1-8b-2
  ensure_checkpoint llama-3.1-8b "$model" --layers 2 || return 1
  metrics=gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers
  metrics+=,launch__shared_mem_config_size,launch__shared_mem_per_block_dynamic
  metrics+=,launch__registers_per_thread,launch__grid_size,sm__ctas_launched.max
  metrics+=,smsp__inst_executed.sum,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second
  show() { grep -E '"(gpu__|sm__|smsp__|dram__|launch__)' | awk -F'","' -v w="$1" '{print w, $13, $15}'; }
  for graphs in on off; do
    x env SPECD_GEMM_TIMING=0 timeout 150 ncu --clock-control none --profile-from-start off \
      -k "regex:$kernel" --launch-count 1 --metrics "$metrics" --csv --print-units base \
      "$dev/bin/bench/cuda_step_bench" --model "$model" --tp 1 --graphs "$graphs" --runs 1 \
      --contexts "$context" --trees "$nodes" --profile "$nodes" 2>&1 | show "step(graphs $graphs)"
  done
  x timeout 100 ncu --clock-control none -k "regex:$kernel" --launch-skip 20 --launch-count 1 \
    --metrics "$metrics" --csv --print-units base "$dev/bin/bench/cuda_kernels_bench" \
    --benchmark_filter="$bench_filter" 2>&1 | show bench
  # The engine encodes a tree's spine (its leading chain below the pending token) by mask_begin,
  # which then differs between the queries of a tile; the benchmark's trees share one unless
  # BENCH_ATTN_SPINE=1.
  cmd_attn_ab --rounds 2 \
    --filter "VerifyAttentionShape/nodes:($nodes|256)/context:$context/shape:(0|3)" \
    shared spine@BENCH_ATTN_SPINE=1 | sort -k3,3 -s
  # Host work does not depend on the layer count: the 2-layer checkpoint shows it as 8B would.
  x env SPECD_GEMM_TIMING=0 timeout 120 "$dev/bin/bench/cuda_step_bench" --model "$model" \
    --tp 1 --graphs on --runs 9 --contexts "$context" --trees "16,$nodes" --phases 1 2>&1 |
    grep -E '^# phases|^\|'
}

# tp [--no-tests] [--no-8b] [--nccl] [--70b] [--1b] [--attn] [--gemm] [--profile] [--cluster]
#    [--gptfast] [--hf] [--bf16check]
#   The tensor-parallel suite: every GPU test, the all-reduce benchmark, 8B steps at TP=1 and
#   TP=2 (custom all-reduce; --nccl adds NCCL only), and on request: a 70B-shaped checkpoint
#   cut to LAYERS70 (default 8) layers at TP=1 and 2, the 1B shape with gpt-fast beside it,
#   the attention and GEMM kernel benchmarks, ncu step profiles, the cluster with the verify
#   service over GPUs 0,1 (STREAMS="1 8 32" adds throughput rounds), gpt-fast at 8B at TP=1 and
#   2 (needs .carry-gptfast), transformers at 8B, transformers bf16 against fp32. Logs are
#   tarred into OUT/tp_logs.tgz at the end.
cmd_tp() {
  local tests=1 b8=1 nccl=0 b70=0 b1=0 attn=0 gemm=0 profile=0 cluster=0 gptfast=0 hf=0 bf16=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --no-tests) tests=0 ;;
      --no-8b) b8=0 ;;
      --nccl) nccl=1 ;;
      --70b) b70=1 ;;
      --1b) b1=1 ;;
      --attn) attn=1 ;;
      --gemm) gemm=1 ;;
      --profile) profile=1 ;;
      --cluster) cluster=1 ;;
      --gptfast) gptfast=1 ;;
      --hf) hf=1 ;;
      --bf16check) bf16=1 ;;
      -h|--help) help_for "${FUNCNAME[0]}"; return 0 ;;
      *) echo "tp: unknown option $1" >&2; return 2 ;;
    esac
    shift
  done
  local ngpu tps="1" parts
  ngpu=$(gpu_count)
  [ "$ngpu" -ge 2 ] && tps="1 2"
  gpu_info
  [ $dry -eq 0 ] && nvidia-smi topo -m 2>/dev/null | head -4
  [ $tests -eq 1 ] && { stamp "GPU tests"; cmd_tests --timeout 240; }
  [ $bf16 -eq 1 ] && { stamp "transformers bf16 against fp32"; cmd_bf16check; }
  if [ $cluster -eq 1 ] && [ "$ngpu" -ge 2 ]; then
    stamp "cluster: verify tensor parallel on GPUs 0,1, draft on GPU 0"
    cmd_cluster --verify-devices 0,1 ${STREAMS:+--streams "$STREAMS"} 2>&1 |
      tee "$out/cluster.log" | tail -24
  fi
  [ "$ngpu" -ge 2 ] && { stamp "all-reduce benchmark"; cmd_allreduce; }
  [ $gemm -eq 1 ] && { stamp "GEMM row classes"; cmd_kernels --filter Gemm --min-time 0.05 | head -60; }
  [ $attn -eq 1 ] && { stamp "attention kernels"; cmd_kernels --filter Attention --min-time 0.05 | head -40; }
  if [ $b8 -eq 1 ]; then
    cmd_steps --shape llama-3.1-8b --tp "$tps"
    [ $nccl -eq 1 ] && [ "$ngpu" -ge 2 ] && cmd_steps --shape llama-3.1-8b --tp 2 \
      --custom-bytes 0 --trees 64 --label llama-3.1-8b/nccl
  fi
  [ $profile -eq 1 ] && cmd_profile
  [ $b70 -eq 1 ] && cmd_steps --shape llama-3.1-70b --layers "${LAYERS70:-8}" --tp "$tps" --trees 64
  if [ $gptfast -eq 1 ]; then
    parts="gptfast:8b"
    [ "$ngpu" -ge 2 ] && parts+=" gptfast-tp2:8b"
    stamp "gpt-fast 8B"
    # shellcheck disable=SC2086  # parts is a word list
    GF_TREES=${GF_TREES:-64} GF_BUDGET_S=${GF_BUDGET_S:-100} GF_TIMEOUT_S=${GF_TIMEOUT_S:-200} \
      CONTEXTS=${CONTEXTS:-2048} BASELINES_TIMEOUT=480 cmd_baselines $parts | tail -40
  fi
  [ $hf -eq 1 ] && { stamp "transformers 8B"; CONTEXTS=${CONTEXTS:-2048} BASELINES_TIMEOUT=200 \
    cmd_baselines hf:8b | tail -20; }
  if [ $b1 -eq 1 ]; then
    cmd_steps --shape llama-3.2-1b --contexts 512,2048,8192 --trees 16,64,128,256
    GF_TREES=${GF_TREES:-64} GF_BUDGET_S=${GF_BUDGET_S:-100} GF_TIMEOUT_S=${GF_TIMEOUT_S:-200} \
      CONTEXTS=${CONTEXTS:-2048} BASELINES_TIMEOUT=300 cmd_baselines gptfast:1b | tail -20
  fi
  stamp "done"
  [ $dry -eq 1 ] || tar -czf "$out/tp_logs.tgz" -C "$out" --exclude tp_logs.tgz .
}

# baselines PART...
#   bench/tools/baselines.sh (transformers, gpt-fast, gpt-fast under torchrun) with its logs in
#   OUT; PART is IMPL:SHAPE, e.g. hf:8b gptfast:1b gptfast-tp2:8b (its header has the settings).
cmd_baselines() {
  [ "${1:-}" = --help ] || [ "${1:-}" = -h ] && { help_for "${FUNCNAME[0]}"; return 0; }
  [ $# -gt 0 ] || { echo "baselines: no PART given" >&2; return 2; }
  OUT=$out x timeout "${BASELINES_TIMEOUT:-600}" "$repo/bench/tools/baselines.sh" "$@" 2>&1
}

# bf16check
#   transformers in bf16 against fp32 on the model-family fixtures (tools/oracle/bf16_error.py).
cmd_bf16check() {
  x timeout 120 python3 "$repo/tools/oracle/bf16_error.py" 2>&1 | tail -8
}

. "$repo/tools/gpu/lib/cluster_check.sh"

while [ $# -gt 0 ]; do
  case "$1" in
    --dev) need "$@"; dev=$2; shift ;;
    --out) need "$@"; out=$2; shift ;;
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
[ $# -gt 0 ] || { usage >&2; exit 2; }
command=$1
shift
case "$command" in
  tests|sanitize|kernels|steps|allreduce|ab|validate|trace|profile|tp|cluster|baselines|\
  bf16check) fn=cmd_$command ;;
  attn-ab) fn=cmd_attn_ab ;;
  kernel-profile) fn=cmd_kernel_profile ;;
  *) echo "run.sh: unknown command $command" >&2; usage >&2; exit 2 ;;
esac
if [ $dry -eq 1 ]; then
  # Nothing is written in a dry run but the empty logs the printed commands stand in for.
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
else
  mkdir -p "$out"
  [ -f "$dev/env.sh" ] && . "$dev/env.sh"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$fn" "$@"
rc=$?
# In a dry run the filters after a printed command see no output; their status means nothing.
[ $dry -eq 1 ] && [ $rc -eq 1 ] && rc=0
exit $rc
