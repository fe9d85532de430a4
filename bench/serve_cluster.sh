#!/usr/bin/env bash
# Starts specd-verify, specd-draft and specd-router on free loopback ports, waits until they
# serve, runs bench/serve_bench.py against the router with every argument this script does not
# know, and stops the services when it exits (also on an error or Ctrl-C).
#
#   bench/serve_cluster.sh --cpu --concurrency 1,4,16,64 \
#       --speculation off,draft_model,ngram,auto --json results.json --plot results.png
#   bench/serve_cluster.sh --device cuda:0 --verify-devices 1,2,3,4 --target-model M ...
#
# Options (the rest go to serve_bench.py; see bench/serve_bench.py --help):
#   --target-model DIR   target folder (default models/pycoder-target)
#   --draft-model DIR    draft folder (default models/pycoder-draft)
#   --eagle-head DIR     also serve this EAGLE head for the target in the draft service
#                        (speculation mode eagle3; docs/eagle.md)
#   --cpu                pin verify to core 0 and draft to core 1 (taskset), one engine thread
#                        each, so that neither model steals the other's core; the router and
#                        the benchmark client share the cores. Needs 2 cores.
#   --device DEV         cpu (default) or cuda:N, for both model services
#   --draft-device DEV   the draft service's device, if not --device
#   --verify-devices L   GPUs of the verify service, one tensor-parallel rank each ("1,2,3")
#   --verify-flags "..." --draft-flags "..." --router-flags "..."   extra service flags
#   --build DIR          build folder whose bin/ holds the executables (default build)
#   --bin DIR            folder of the executables (packed binaries), instead of --build
#   --logs DIR           keep the services' logs there (default: a temporary folder, removed)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
COMMAND="bench/serve_cluster.sh $*"
. "$ROOT/scripts/lib/cluster.sh"

TARGET=$ROOT/models/pycoder-target
DRAFT=$ROOT/models/pycoder-draft
EAGLE_HEAD=
PIN=0
DEVICE=cpu
DRAFT_DEVICE=
VERIFY_DEVICES=
VERIFY_FLAGS=
DRAFT_FLAGS=
ROUTER_FLAGS=
BIN=
BUILD=build
LOGS=
BENCH_ARGS=()
need() { [ $# -ge 2 ] || { echo "serve_cluster.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --target-model) need "$@"; TARGET=$2; shift 2 ;;
    --draft-model) need "$@"; DRAFT=$2; shift 2 ;;
    --eagle-head) need "$@"; EAGLE_HEAD=$2; shift 2 ;;
    --cpu) PIN=1; shift ;;
    --device) need "$@"; DEVICE=$2; shift 2 ;;
    --draft-device) need "$@"; DRAFT_DEVICE=$2; shift 2 ;;
    --verify-devices) need "$@"; VERIFY_DEVICES=$2; shift 2 ;;
    --verify-flags) need "$@"; VERIFY_FLAGS=$2; shift 2 ;;
    --draft-flags) need "$@"; DRAFT_FLAGS=$2; shift 2 ;;
    --router-flags) need "$@"; ROUTER_FLAGS=$2; shift 2 ;;
    --build) need "$@"; BUILD=$2; shift 2 ;;
    --bin) need "$@"; BIN=$2; shift 2 ;;
    --logs) need "$@"; LOGS=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) BENCH_ARGS+=("$1"); shift ;;
  esac
done
[ -n "$BIN" ] || BIN=$ROOT/$BUILD/bin
case "$BIN" in /*) ;; *) BIN=$(pwd)/$BIN ;; esac
for exe in specd-verify specd-draft specd-router specd-cli; do
  if [ ! -x "$BIN/$exe" ]; then
    echo "serve_cluster.sh: $BIN/$exe not found (build it, or --bin DIR)" >&2
    exit 2
  fi
done
for m in "$TARGET" "$DRAFT"; do
  [ -f "$m/config.json" ] || { echo "serve_cluster.sh: $m/config.json not found" >&2; exit 2; }
done
TARGET=$(cd "$TARGET" && pwd)
DRAFT=$(cd "$DRAFT" && pwd)
# The first Python that has grpcio: Debian's here, a host's own python3 on GPU machines.
if [ -z "${PYTHON:-}" ]; then
  for p in /usr/bin/python3 python3; do
    if "$p" -c "import grpc, google.protobuf" 2>/dev/null; then PYTHON=$p; break; fi
  done
  [ -n "${PYTHON:-}" ] || { echo "serve_cluster.sh: no python3 with grpcio (set PYTHON)" >&2; exit 2; }
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd-bench.XXXXXX")
if [ -n "$LOGS" ]; then mkdir -p "$LOGS"; LOGDIR=$(cd "$LOGS" && pwd); else LOGDIR=$WORK; fi
PIDS=()
trap 'stop_services "$WORK" "${PIDS[@]}"' EXIT
trap 'exit 130' INT TERM

VERIFY_ADDR=127.0.0.1:$(free_port)
DRAFT_ADDR=127.0.0.1:$(free_port)
ROUTER_ADDR=127.0.0.1:$(free_port)
VERIFY_METRICS=$(free_port)
DRAFT_METRICS=$(free_port)
ROUTER_METRICS=$(free_port)

VERIFY_CMD=("$BIN/specd-verify" --address "$VERIFY_ADDR" --metrics_port "$VERIFY_METRICS"
            --model "$TARGET")
DRAFT_CMD=("$BIN/specd-draft" --address "$DRAFT_ADDR" --metrics_port "$DRAFT_METRICS"
           --model "$DRAFT" --device "${DRAFT_DEVICE:-$DEVICE}")
if [ -n "$EAGLE_HEAD" ]; then
  DRAFT_CMD+=(--eagle_head "$EAGLE_HEAD" --eagle_target "$TARGET")
fi
if [ -n "$VERIFY_DEVICES" ]; then
  ranks=$(awk -F, '{print NF}' <<<"$VERIFY_DEVICES")
  VERIFY_CMD+=(--devices "$VERIFY_DEVICES" --tensor_parallel "$ranks")
else
  VERIFY_CMD+=(--device "$DEVICE")
fi
PINNING="none"
if [ "$PIN" = 1 ]; then
  if [ "$(nproc)" -lt 2 ] || ! command -v taskset >/dev/null; then
    echo "serve_cluster.sh: --cpu needs 2 cores and taskset; running unpinned" >&2
  else
    VERIFY_CMD=(taskset -c 0 "${VERIFY_CMD[@]}" --num_threads 1)
    DRAFT_CMD=(taskset -c 1 "${DRAFT_CMD[@]}" --num_threads 1)
    PINNING="verify on core 0, draft on core 1 (taskset, 1 engine thread each);"
    PINNING+=" router and client unpinned"
  fi
fi
# shellcheck disable=SC2206  # the extra flags are meant to split on spaces
VERIFY_CMD+=($VERIFY_FLAGS)
# shellcheck disable=SC2206
DRAFT_CMD+=($DRAFT_FLAGS)
ROUTER_CMD=("$BIN/specd-router" --address "$ROUTER_ADDR" --metrics_port "$ROUTER_METRICS"
            --model "$TARGET" --verify_address "$VERIFY_ADDR" --draft_address "$DRAFT_ADDR")
# shellcheck disable=SC2206
ROUTER_CMD+=($ROUTER_FLAGS)

echo "== serve_cluster: target $TARGET, draft $DRAFT" >&2
echo "   pinning: $PINNING" >&2
"${VERIFY_CMD[@]}" >"$LOGDIR/verify.log" 2>&1 &
PIDS+=($!)
"${DRAFT_CMD[@]}" >"$LOGDIR/draft.log" 2>&1 &
PIDS+=($!)
"${ROUTER_CMD[@]}" >"$LOGDIR/router.log" 2>&1 &
PIDS+=($!)
echo "   router $ROUTER_ADDR, verify $VERIFY_ADDR, draft $DRAFT_ADDR; logs in $LOGDIR" >&2
wait_for_cluster "$BIN" "$ROUTER_ADDR" "$LOGDIR" "${SERVE_CLUSTER_TIMEOUT_S:-600}" "${PIDS[@]}" ||
  exit 1

BUILD_TYPE=
if [ -f "$BIN/../CMakeCache.txt" ]; then
  BUILD_TYPE=$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$BIN/../CMakeCache.txt")
fi
META=$("$PYTHON" - "$TARGET" "$DRAFT" "$PINNING" "$BIN" "$BUILD_TYPE" "${VERIFY_CMD[*]}" \
  "${DRAFT_CMD[*]}" "${ROUTER_CMD[*]}" "$COMMAND" <<'EOF'
import json, sys
print(json.dumps({"target_dir": sys.argv[1], "draft_dir": sys.argv[2], "pinning": sys.argv[3],
                  "bin": sys.argv[4], "build_type": sys.argv[5], "verify_cmd": sys.argv[6],
                  "draft_cmd": sys.argv[7], "router_cmd": sys.argv[8],
                  "launcher": "bench/serve_cluster.sh", "launcher_command": sys.argv[9]}))
EOF
)
set +e
SPECD_BENCH_META=$META "$PYTHON" "$ROOT/bench/serve_bench.py" --target "$ROUTER_ADDR" \
  --metrics "router=http://127.0.0.1:$ROUTER_METRICS/metrics" \
  --metrics "verify=http://127.0.0.1:$VERIFY_METRICS/metrics" \
  --metrics "draft=http://127.0.0.1:$DRAFT_METRICS/metrics" "${BENCH_ARGS[@]}"
rc=$?
set -e
for pid in "${PIDS[@]}"; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "serve_cluster.sh: a service exited during the run; its logs:" >&2
    tail -n 20 "$LOGDIR"/*.log >&2
    rc=1
  fi
done
exit $rc
