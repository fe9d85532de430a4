#!/usr/bin/env bash
# GPU-host check of the whole cluster, from the repository root with a packed build carried
# along (../shared/device/pack.sh build-gpu .device):
#   tools/gpu_cluster_check.sh [PACKED_DIR] [--draft-device DEV] [--verify-devices LIST]
#       [--streams "1 8 32"]
#       (defaults .device, cuda:0, 0; --verify-devices 0,1 runs specd-verify tensor parallel
#       over those GPUs: --tensor_parallel 2 --devices 0,1)
# Starts specd-verify (models/pycoder-target) and specd-draft (models/pycoder-draft) on cuda:0
# and specd-router on free loopback ports, then runs the 16 prompts of
# bench/prompts/code_prompts.json greedily through specd-cli, 64 new tokens each, once with
# speculation off and once with the draft model, one request at a time. Lossless speculation
# means the token ids are the same in both modes: every prompt whose ids differ prints a
# MISMATCH line and the script exits 1. Prints the acceptance rate, mean accepted length and
# median tokens/s of each mode (from the CLI's --json summary lines). Everything it starts is
# stopped when it exits, however it exits. About a minute on an H200.
# The tokens/s are wall-clock figures of one run over loopback gRPC, not a benchmark.
# --streams then measures end-to-end throughput: for each count N and each mode, N specd-cli
# streams at once (prompt i mod 16, 64 greedy tokens each), and prints the total completion
# tokens over the wall time of the round.
set -uo pipefail

dev=.device
draft_device=cuda:0
verify_devices=0
streams=""
while [ $# -gt 0 ]; do
  case "$1" in
    --verify-devices) verify_devices=${2:?--verify-devices needs a value}; shift 2 ;;
    --draft-device) draft_device=${2:?--draft-device needs a value}; shift 2 ;;
    --draft-device=*) draft_device=${1#*=}; shift ;;
    --streams) streams=${2:?--streams needs a list}; shift 2 ;;
    -*) echo "usage: $0 [PACKED_DIR] [--draft-device cpu|cuda:N] [--verify-devices LIST]" \
          "[--streams \"1 8 32\"]" >&2; exit 2 ;;
    *) dev=$1; shift ;;
  esac
done
[ -f "$dev/env.sh" ] && . "$dev/env.sh"
# pack.sh keeps paths relative to the build folder: executables of build/bin land in bin/bin.
if [ -x "$dev/bin/bin/specd-router" ]; then BIN=$dev/bin/bin; else BIN=$dev/bin; fi
for exe in specd-verify specd-draft specd-router specd-cli; do
  [ -x "$BIN/$exe" ] || { echo "no $BIN/$exe" >&2; exit 2; }
done
PROMPTS_JSON=bench/prompts/code_prompts.json
for f in models/pycoder-target/config.json models/pycoder-draft/config.json "$PROMPTS_JSON" \
    scripts/lib/cluster.sh; do
  [ -f "$f" ] || { echo "no $f (run from the repository root)" >&2; exit 2; }
done
. scripts/lib/cluster.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd-cluster.XXXXXX")
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
VERIFY=127.0.0.1:$(free_port)
DRAFT=127.0.0.1:$(free_port)
ROUTER=127.0.0.1:$(free_port)

tp=$(echo "$verify_devices" | tr ',' '\n' | wc -l)
echo "== verify on GPUs $verify_devices (tensor parallel $tp), draft $draft_device, router $ROUTER"
"$BIN/specd-verify" --address "$VERIFY" --metrics_port 0 --tensor_parallel "$tp" \
  --devices "$verify_devices" \
  --model models/pycoder-target --kv_capacity_tokens 65536 >"$WORK/verify.log" 2>&1 &
PIDS+=($!)
"$BIN/specd-draft" --address "$DRAFT" --metrics_port 0 --device "$draft_device" \
  --model models/pycoder-draft --kv_capacity_tokens 65536 >"$WORK/draft.log" 2>&1 &
PIDS+=($!)
"$BIN/specd-router" --address "$ROUTER" --metrics_port 0 --model models/pycoder-target \
  --verify_address "$VERIFY" --draft_address "$DRAFT" >"$WORK/router.log" 2>&1 &
PIDS+=($!)

# Ready when the router reports the draft service and a one-token generation goes through.
start=$SECONDS
wait_for_cluster "$BIN" "$ROUTER" "$WORK" 60 "${PIDS[@]}" || exit 1
echo "== ready after $((SECONDS - start)) s"

# One line per prompt: "id comma,separated,ids".
python3 - "$PROMPTS_JSON" >"$WORK/prompts.txt" <<'EOF' || exit 2
import json, sys
for p in json.load(open(sys.argv[1]))["prompts"]:
    print(p["id"], ",".join(str(i) for i in p["ids"]))
EOF

failed=0
for mode in off draft_model; do
  while read -r id ids; do
    if ! timeout 60 "$BIN/specd-cli" generate --server "$ROUTER" --prompt-ids "$ids" \
        --max-new-tokens 64 --temperature 0 --ignore-eos --speculation "$mode" --json \
        >"$WORK/$mode.$id.jsonl" 2>"$WORK/$mode.$id.err"; then
      echo "FAILED prompt $id ($mode): $(cat "$WORK/$mode.$id.err")"
      failed=1
    fi
  done <"$WORK/prompts.txt"
done
[ "$failed" = 0 ] || { tail -n 20 "$WORK"/*.log >&2; exit 1; }

python3 - "$WORK" "$WORK/prompts.txt" <<'EOF'
import json, statistics, sys
work, prompts = sys.argv[1], [l.split()[0] for l in open(sys.argv[2])]
modes = ("off", "draft_model")
tokens, summary = {}, {}
for mode in modes:
    for pid in prompts:
        lines = [json.loads(l) for l in open(f"{work}/{mode}.{pid}.jsonl") if l.strip()]
        # Streamed chunks carry token_ids; the last line is the summary.
        tokens[mode, pid] = [t for l in lines[:-1] for t in l.get("token_ids", [])]
        summary[mode, pid] = lines[-1]
mismatches = 0
for pid in prompts:
    a, b = tokens["off", pid], tokens["draft_model", pid]
    if a != b:
        mismatches += 1
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"MISMATCH prompt {pid}: {len(a)} tokens off vs {len(b)} draft_model, first "
              f"difference at token {first}: off {a[first:first + 4]} draft_model "
              f"{b[first:first + 4]}")
print(f"{'speculation':<12} {'tokens':>7} {'acceptance':>11} {'mean accepted length':>21} "
      f"{'median tokens/s':>16}")
for mode in modes:
    rows = [summary[mode, pid] for pid in prompts]
    n = sum(r["usage"]["completion_tokens"] for r in rows)
    steps = sum(r["speculation"]["steps"] for r in rows)
    drafted = sum(r["speculation"]["draft_tokens"] for r in rows)
    accepted = sum(r["speculation"]["accepted_tokens"] for r in rows)
    acc = f"{accepted / drafted:.3f}" if drafted else "-"
    mal = f"{1 + accepted / steps:.2f}" if steps and drafted else "-"
    tps = statistics.median(r["tokens_per_second"] for r in rows)
    print(f"{mode:<12} {n:>7} {acc:>11} {mal:>21} {tps:>16.1f}")
print(f"{len(prompts) - mismatches} of {len(prompts)} prompts: identical token ids with "
      f"speculation off and draft_model (greedy, 64 new tokens)")
sys.exit(1 if mismatches else 0)
EOF
rc=$?
[ -n "$streams" ] || exit $rc

mapfile -t ids_list < <(cut -d' ' -f2 "$WORK/prompts.txt")
echo "| speculation | streams | completion tokens | wall s | tokens/s |"
echo "|---|---:|---:|---:|---:|"
for n in $streams; do
  for mode in off draft_model; do
    rm -f "$WORK"/stream.*.jsonl
    t0=$(date +%s.%N)
    spids=()
    for ((i = 0; i < n; ++i)); do
      timeout 300 "$BIN/specd-cli" generate --server "$ROUTER" \
        --prompt-ids "${ids_list[i % ${#ids_list[@]}]}" --max-new-tokens 64 --temperature 0 \
        --ignore-eos --speculation "$mode" --json >"$WORK/stream.$i.jsonl" 2>/dev/null &
      spids+=($!)
    done
    for pid in "${spids[@]}"; do wait "$pid" || echo "a stream failed ($mode, $n streams)"; done
    t1=$(date +%s.%N)
    python3 - "$WORK" "$n" "$mode" "$t0" "$t1" <<'EOF'
import json, sys
work, n, mode, t0, t1 = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
tokens = 0
for i in range(n):
    lines = [l for l in open(f"{work}/stream.{i}.jsonl") if l.strip()]
    if lines:
        tokens += json.loads(lines[-1]).get("usage", {}).get("completion_tokens", 0)
print(f"| {mode} | {n} | {tokens} | {t1 - t0:.2f} | {tokens / (t1 - t0):.0f} |")
EOF
  done
done
exit $rc
