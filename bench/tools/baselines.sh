#!/usr/bin/env bash
# Peer baselines on the GPU host (issues 5 and 6), from the repository root, with gpt-fast's
# sources carried along in the ignored folder .carry-gptfast (made here, on the development
# machine, by bench/tools/fetch_gpt_fast.sh; never committed):
#
#   bench/tools/baselines.sh PART...
#
# PART is IMPL:SHAPE with IMPL one of
#   hf           transformers eager (bench/hf_step_baseline.py), about 1 minute a shape
#   gptfast      gpt-fast, torch.compile + CUDA graphs, one GPU (bench/tools/gpt_fast_bench.py);
#                every case compiles once, so this takes up to GF_BUDGET_S (+ one case)
#   gptfast-tp2  the same under torchrun --nproc_per_node 2 with gpt-fast's tp.apply_tp
#                (needs 2 GPUs)
# and SHAPE one of 8b (Llama-3.1-8B), 1b (Llama-3.2-1B). Example, one command each so that each
# stays under 10 minutes:
#   bench/tools/baselines.sh hf:8b hf:1b
#   bench/tools/baselines.sh gptfast:8b
#   GF_TREES=16,64 bench/tools/baselines.sh gptfast:1b gptfast-tp2:8b
#
# Settings (environment):
#   CONTEXTS        512,2048,8192
#   TREES           64,16,256,128,1: tree node counts in the order they run (decode first, each
#                   case at every context), so the cases that matter most are done when a budget
#                   cuts a run short; a verify row forwards nodes + 1 tokens
#   GF_CONTEXTS, GF_TREES, HF_CONTEXTS, HF_TREES   per implementation (default the above)
#   GF_BUDGET_S     230: no new gpt-fast case after that many seconds (HF_BUDGET_S 110)
#   GF_TIMEOUT_S    budget + 240 (HF_TIMEOUT_S budget + 120): the part is killed then; its rows
#                   so far stay in its log
#   RUNS            20 timed steps per case (twice: synchronized, back-to-back)
#   GF_ARGS, HF_ARGS  more flags, e.g. GF_ARGS="--cache shared": one gpt-fast cache of
#                   max(context) + 300 for all contexts, one compile per token count instead of
#                   one per context and token count (its short-context rows then attend over the
#                   long cache)
#   GPT_FAST_DIR    .carry-gptfast/gpt-fast
#   GF_PARALLEL     K > 1: gpt-fast's cases (every GF_CONTEXTS x (decode unless --no-decode in
#                   GF_ARGS, GF_TREES), or GF_CASES) run as single-case processes, K at a time:
#                   the K compile side by side (each with nproc / K inductor compile threads),
#                   then time one after another, none while another compiles (--gate-dir of
#                   gpt_fast_bench.py). Compilation is most of a case's time, so this takes
#                   about one case's time per K cases. Mind the GPU memory: K weights.
#   GF_CASES        with GF_PARALLEL: CONTEXT:NODES,... (NODES 0 = decode), in place of the grid
#
# Writes OUT/IMPL-SHAPE.log (everything) and OUT/IMPL-SHAPE.json (rows + versions) for each
# part, OUT defaulting to /tmp/specd-baselines; prints each part's final table. NVLink
# multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Exit status: the
# number of parts that failed outright (their rows may still be partly there).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/specd-baselines}
mkdir -p "$out"
contexts=${CONTEXTS:-512,2048,8192}
trees=${TREES:-64,16,256,128,1}
runs=${RUNS:-20}
gf_budget=${GF_BUDGET_S:-230}
hf_budget=${HF_BUDGET_S:-110}
gf_dir=${GPT_FAST_DIR:-.carry-gptfast/gpt-fast}
[ $# -gt 0 ] || { sed -n '2,30p' "$0"; exit 2; }

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'

# gptfast_parallel SHAPE NAME: see GF_PARALLEL. Each case logs to OUT/NAME-cCONTEXT-nNODES.log
# (and .json); the rows of every case are printed at the end.
gptfast_parallel() {
  local full=$1 name=$2 k=${GF_PARALLEL} cases=() c n
  if [ -n "${GF_CASES:-}" ]; then
    IFS=, read -r -a cases <<< "$GF_CASES"
  else
    local ctxs trs
    IFS=, read -r -a ctxs <<< "${GF_CONTEXTS:-$contexts}"
    IFS=, read -r -a trs <<< "${GF_TREES:-$trees}"
    case " ${GF_ARGS:-} " in *" --no-decode "*) ;; *) trs=(0 "${trs[@]}") ;; esac
    for n in "${trs[@]}"; do for c in "${ctxs[@]}"; do cases+=("$c:$n"); done; done
  fi
  local threads=$(( $(nproc) / k )) rc=0 batch=0 i
  [ "$threads" -ge 1 ] || threads=1
  echo "== $name: ${#cases[@]} cases, $k at a time, $threads compile threads each"
  for ((i = 0; i < ${#cases[@]}; i += k)); do
    local part=("${cases[@]:i:k}") gate="$out/gate-$name-$batch" pids=() logs=()
    batch=$((batch + 1))
    rm -rf "$gate"
    local start=$(date +%s)
    for cn in "${part[@]}"; do
      c=${cn%%:*}; n=${cn#*:}
      local tag="$name-c$c-n$n" targs=(--trees=)  # NODES 0: decode alone
      [ "$n" = 0 ] || targs=(--trees "$n" --no-decode)
      logs+=("$out/$tag.log")
      TORCHINDUCTOR_COMPILE_THREADS=$threads timeout "${GF_TIMEOUT_S:-600}" python3 \
        bench/tools/gpt_fast_bench.py --shape "$full" --gpt-fast-dir "$gf_dir" --contexts "$c" \
        "${targs[@]}" --runs "$runs" --budget-s 1e9 --json "$out/$tag.json" \
        --gate-dir "$gate" --gate-count "${#part[@]}" ${GF_ARGS:-} > "$out/$tag.log" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    echo "== $name batch $batch (${part[*]}): $(( $(date +%s) - start )) s"
    for log in "${logs[@]}"; do
      grep -h 'gate:' "$log" | sed "s|^|   $(basename "$log" .log): |"
    done
  done
  echo "## gpt-fast, $full, single-case processes ($k at a time)"
  local header=0
  for cn in "${cases[@]}"; do
    c=${cn%%:*}; n=${cn#*:}
    local log="$out/$name-c$c-n$n.log" table
    # The final section's table: its header once, then each case's row.
    table=$(sed -n '/^## /,$p' "$log" | grep '^|')
    if [ -z "$table" ]; then
      echo "$cn: no rows; end of $log:"; tail -n 5 "$log"; rc=1; continue
    fi
    [ $header = 1 ] || { head -n 2 <<< "$table"; header=1; }
    tail -n +3 <<< "$table"
  done
  return $rc
}

fail=0
for part in "$@"; do
  impl=${part%%:*}
  shape=${part#*:}
  case "$shape" in
    8b) full=llama-3.1-8b ;;
    1b) full=llama-3.2-1b ;;
    tiny) full=tiny ;;  # smoke tests only (with GF_ARGS="--device cpu --no-compile")
    *) echo "unknown shape in $part (8b or 1b)" >&2; fail=$((fail + 1)); continue ;;
  esac
  name=$impl-$shape
  log=$out/$name.log
  json=$out/$name.json
  case "$impl" in
    hf)
      cmd=(timeout ${HF_TIMEOUT_S:-$((hf_budget + 120))} python3 bench/hf_step_baseline.py --shape "$full"
           --contexts "${HF_CONTEXTS:-$contexts}" --trees "${HF_TREES:-$trees}" --runs "$runs"
           --budget-s "$hf_budget" --json "$json" ${HF_ARGS:-}) ;;
    gptfast|gptfast-tp2)
      if [ "$impl" = gptfast ] && [ "${GF_PARALLEL:-1}" -gt 1 ]; then
        gptfast_parallel "$full" "$name" || fail=$((fail + 1))
        continue
      fi
      if [ ! -f "$gf_dir/model.py" ]; then
        echo "== $name: no $gf_dir/model.py (run bench/tools/fetch_gpt_fast.sh on the" \
             "development machine and carry .carry-gptfast)" >&2
        fail=$((fail + 1))
        continue
      fi
      launcher=(python3)
      [ "$impl" = gptfast-tp2 ] && launcher=(python3 -m torch.distributed.run --standalone
                                             --nproc_per_node 2)
      cmd=(timeout ${GF_TIMEOUT_S:-$((gf_budget + 240))} "${launcher[@]}" bench/tools/gpt_fast_bench.py
           --shape "$full" --gpt-fast-dir "$gf_dir" --contexts "${GF_CONTEXTS:-$contexts}"
           --trees "${GF_TREES:-$trees}" --runs "$runs" --budget-s "$gf_budget" --json "$json"
           ${GF_ARGS:-}) ;;
    *) echo "unknown implementation in $part (hf, gptfast, gptfast-tp2)" >&2
       fail=$((fail + 1)); continue ;;
  esac
  echo "== $name: ${cmd[*]}"
  start=$(date +%s)
  "${cmd[@]}" > "$log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s; log $log"
  # The final section (heading, notes, whole table) or, without one, the end of the log.
  if grep -q '^## ' "$log"; then
    sed -n '/^## /,$p' "$log"
  else
    tail -n 40 "$log"
  fi
  [ "$rc" -eq 0 ] || { fail=$((fail + 1)); grep -E 'Error|error:' "$log" | sort | uniq -c |
                       sort -rn | head -n 8; }
done
exit $fail
