# shellcheck shell=bash
# Sourced by tools/gpu/run.sh: the `cluster` command.

# cluster [--draft-device cpu|cuda:N] [--verify-devices LIST] [--streams "1 8 32"]
#   The whole cluster on real models: specd-verify (models/pycoder-target; on GPU 0, or tensor
#   parallel over LIST, e.g. 0,1), specd-draft (models/pycoder-draft and the EAGLE-3 head
#   models/pycoder-eagle3 on cuda:0) and specd-router on free loopback ports, then the 16 prompts
#   of bench/prompts/code_prompts.json greedily through specd-cli, 64 new tokens each, one
#   request at a time, with speculation off, with the draft model and with the EAGLE-3 head (the
#   verify service's taps relayed to it). Lossless speculation means the same token ids in every
#   mode: each prompt whose ids differ prints a MISMATCH line and the command fails. Prints acceptance rate, mean
#   accepted length and median tokens/s of each mode (wall-clock figures of one run over
#   loopback gRPC, not a benchmark). --streams then runs N specd-cli streams at once for each
#   count N and mode and prints completion tokens over the round's wall time. Everything it
#   starts is stopped when it returns. About a minute on an H200.
cmd_cluster() (
  local draft_device=cuda:0 verify_devices=0 streams="" BIN exe f
  # A subshell: its traps, exits and functions stay its own.
  while [ $# -gt 0 ]; do
    case "$1" in
      --verify-devices) need "$@"; verify_devices=$2; shift 2 ;;
      --draft-device) need "$@"; draft_device=$2; shift 2 ;;
      --draft-device=*) draft_device=${1#*=}; shift ;;
      --streams) need "$@"; streams=$2; shift 2 ;;
      -h|--help) help_for cmd_cluster; exit 0 ;;
      *) echo "cluster: unknown option $1" >&2; exit 2 ;;
    esac
  done
  # pack.sh keeps paths relative to the build folder: executables of build/bin land in bin/bin.
  if [ -x "$dev/bin/bin/specd-router" ] || [ $dry -eq 1 ]; then BIN=$dev/bin/bin; else BIN=$dev/bin; fi
  if [ $dry -eq 0 ]; then
    for exe in specd-verify specd-draft specd-router specd-cli; do
      [ -x "$BIN/$exe" ] || { echo "cluster: no $BIN/$exe" >&2; exit 2; }
    done
  fi
  local prompts_json=bench/prompts/code_prompts.json report=$repo/tools/gpu/lib/cluster_report.py
  for f in models/pycoder-target/config.json models/pycoder-draft/config.json \
      models/pycoder-eagle3/config.json "$prompts_json" scripts/lib/cluster.sh; do
    [ -f "$f" ] || { echo "cluster: no $f (run from the repository root)" >&2; exit 2; }
  done
  . scripts/lib/cluster.sh
  gpu_info

  local work pids=()
  work=$(mktemp -d "${TMPDIR:-/tmp}/specd-cluster.XXXXXX")
  # This function runs in a subshell: the trap is its own.
  trap 'stop_services "$work" "${pids[@]}"' EXIT
  trap 'exit 130' INT TERM

  local verify draft router tp start failed=0 rc mode id ids n i t0 t1 pid spids ids_list
  if [ $dry -eq 1 ]; then  # ports are picked when it runs
    verify=127.0.0.1:50052 draft=127.0.0.1:50051 router=127.0.0.1:50050
  else
    verify=127.0.0.1:$(free_port)
    draft=127.0.0.1:$(free_port)
    router=127.0.0.1:$(free_port)
  fi
  tp=$(echo "$verify_devices" | tr ',' '\n' | wc -l)
  echo "== verify on GPUs $verify_devices (tensor parallel $tp), draft $draft_device, router $router"
  x "$BIN/specd-verify" --address "$verify" --metrics_port 0 --tensor_parallel "$tp" \
    --devices "$verify_devices" --model models/pycoder-target --kv_capacity_tokens 65536 \
    >"$work/verify.log" 2>&1 &
  pids+=($!)
  x "$BIN/specd-draft" --address "$draft" --metrics_port 0 --device "$draft_device" \
    --model models/pycoder-draft --eagle_head models/pycoder-eagle3 \
    --eagle_target models/pycoder-target --kv_capacity_tokens 65536 >"$work/draft.log" 2>&1 &
  pids+=($!)
  x "$BIN/specd-router" --address "$router" --metrics_port 0 --model models/pycoder-target \
    --verify_address "$verify" --draft_address "$draft" >"$work/router.log" 2>&1 &
  pids+=($!)

  # Ready when the router reports the draft service and a one-token generation goes through.
  start=$SECONDS
  if [ $dry -eq 0 ]; then
    wait_for_cluster "$BIN" "$router" "$work" 60 "${pids[@]}" || exit 1
    echo "== ready after $((SECONDS - start)) s"
  fi

  python3 "$report" prompts "$prompts_json" >"$work/prompts.txt" || exit 2
  for mode in off draft_model eagle3; do
    while read -r id ids; do
      if ! x timeout 60 "$BIN/specd-cli" generate --server "$router" --prompt-ids "$ids" \
          --max-new-tokens 64 --temperature 0 --ignore-eos --speculation "$mode" --json \
          >"$work/$mode.$id.jsonl" 2>"$work/$mode.$id.err"; then
        echo "FAILED prompt $id ($mode): $(cat "$work/$mode.$id.err")"
        failed=1
      fi
      [ $dry -eq 1 ] && break  # one prompt a mode shows the command
    done <"$work/prompts.txt"
  done
  [ $dry -eq 1 ] && exit 0
  [ "$failed" = 0 ] || { tail -n 20 "$work"/*.log >&2; exit 1; }
  python3 "$report" compare "$work" "$work/prompts.txt"
  rc=$?
  [ -n "$streams" ] || exit $rc

  mapfile -t ids_list < <(cut -d' ' -f2 "$work/prompts.txt")
  echo "| speculation | streams | completion tokens | wall s | tokens/s |"
  echo "|---|---:|---:|---:|---:|"
  for n in $streams; do
    for mode in off draft_model eagle3; do
      rm -f "$work"/stream.*.jsonl
      t0=$(date +%s.%N)
      spids=()
      for ((i = 0; i < n; ++i)); do
        timeout 300 "$BIN/specd-cli" generate --server "$router" \
          --prompt-ids "${ids_list[i % ${#ids_list[@]}]}" --max-new-tokens 64 --temperature 0 \
          --ignore-eos --speculation "$mode" --json >"$work/stream.$i.jsonl" 2>/dev/null &
        spids+=($!)
      done
      for pid in "${spids[@]}"; do wait "$pid" || echo "a stream failed ($mode, $n streams)"; done
      t1=$(date +%s.%N)
      python3 "$report" round "$work" "$n" "$mode" "$t0" "$t1"
    done
  done
  exit $rc
)
