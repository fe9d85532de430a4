#!/usr/bin/env bash
# Starts specd-verify, specd-draft and specd-router on free loopback ports (one or more verify
# groups and draft services behind the router), waits until they all serve, runs
# bench/serve_bench.py against the router with every argument this script does not know, and
# stops the services when it exits (also on an error or Ctrl-C).
#
#   bench/serve_cluster.sh --cpu --concurrency 1,4,16,64 \
#       --speculation off,draft_model,ngram,auto --json results.json --plot results.png
#   bench/serve_cluster.sh --device cuda:0 --verify-devices 1,2,3,4 --target-model M ...
#   bench/serve_cluster.sh --cpu --threads-per-service 4 --verify-groups 2 --drafts 2 ...
#
# Options (the rest go to serve_bench.py; see bench/serve_bench.py --help):
#   --target-model DIR   target folder (default models/pycoder-target)
#   --draft-model DIR    draft folder (default models/pycoder-draft)
#   --eagle-head DIR     also serve this EAGLE head for the target in the draft service
#                        (speculation mode eagle3; docs/eagle.md)
#   --verify-groups N    N specd-verify services (verify groups; default 1), given to the router
#                        as a list; each new sequence goes to the least-loaded group
#   --drafts N           N specd-draft services (default 1); each sequence drafts on the
#                        least-loaded one
#   --cpu                pin each model service to its own cores (taskset): the verify services,
#                        then the draft services, take --threads-per-service consecutive cores
#                        each (wrapping around when there are too few) and run that many engine
#                        threads, so that no model steals another's cores; the router and the
#                        benchmark client share the cores. Needs 2 cores.
#   --threads-per-service T   cores and engine threads per model service with --cpu (default 1)
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
GROUPS_N=1
DRAFTS_N=1
THREADS=1
need() { [ $# -ge 2 ] || { echo "serve_cluster.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --target-model) need "$@"; TARGET=$2; shift 2 ;;
    --draft-model) need "$@"; DRAFT=$2; shift 2 ;;
    --eagle-head) need "$@"; EAGLE_HEAD=$2; shift 2 ;;
    --cpu) PIN=1; shift ;;
    --verify-groups) need "$@"; GROUPS_N=$2; shift 2 ;;
    --drafts) need "$@"; DRAFTS_N=$2; shift 2 ;;
    --threads-per-service) need "$@"; THREADS=$2; shift 2 ;;
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
for n in "$GROUPS_N" "$DRAFTS_N" "$THREADS"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "serve_cluster.sh: '$n' is not a count >= 1" >&2; exit 2; }
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

ROUTER_ADDR=127.0.0.1:$(free_port)
ROUTER_METRICS=$(free_port)
PINNING="none"
if [ "$PIN" = 1 ] && { [ "$(nproc)" -lt 2 ] || ! command -v taskset >/dev/null; }; then
  echo "serve_cluster.sh: --cpu needs 2 cores and taskset; running unpinned" >&2
  PIN=0
fi
NEXT_CORE=0
# The cores this script may use (taskset or a cgroup may have narrowed them), in order: pinning
# counts through these, so that a benchmark started under `taskset -c 4-7` pins to 4, 5, ...
mapfile -t ALLOWED_CORES < <("$PYTHON" -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
# pin CMD...: sets PINNED to CMD, pinned to the next --threads-per-service cores with --cpu.
PINNED=()
pin() {
  PINNED=("$@")
  [ "$PIN" = 1 ] || return 0
  local cores=() i
  for ((i = 0; i < THREADS; i++)); do
    cores+=("${ALLOWED_CORES[$(((NEXT_CORE + i) % ${#ALLOWED_CORES[@]}))]}")
  done
  NEXT_CORE=$((NEXT_CORE + THREADS))
  PINNED=(taskset -c "$(IFS=,; echo "${cores[*]}")" "$@" --num_threads "$THREADS")
}

# Each command joined with spaces (the paths and flags here have none).
VERIFY_CMDS=()
DRAFT_CMDS=()
VERIFY_ADDRS=()
DRAFT_ADDRS=()
METRICS_ARGS=()
for ((g = 0; g < GROUPS_N; g++)); do
  addr=127.0.0.1:$(free_port)
  port=$(free_port)
  cmd=("$BIN/specd-verify" --address "$addr" --metrics_port "$port" --model "$TARGET")
  if [ -n "$VERIFY_DEVICES" ]; then
    ranks=$(awk -F, '{print NF}' <<<"$VERIFY_DEVICES")
    cmd+=(--devices "$VERIFY_DEVICES" --tensor_parallel "$ranks")
  else
    cmd+=(--device "$DEVICE")
  fi
  pin "${cmd[@]}"
  # shellcheck disable=SC2206  # the extra flags are meant to split on spaces
  PINNED+=($VERIFY_FLAGS)
  VERIFY_CMDS+=("${PINNED[*]}")
  VERIFY_ADDRS+=("$addr")
  # serve_bench.py's step breakdown reads "verify" (group 0); the others are scraped beside.
  METRICS_ARGS+=(--metrics "verify$([ "$g" = 0 ] || echo "$g")=http://127.0.0.1:$port/metrics")
done
for ((g = 0; g < DRAFTS_N; g++)); do
  addr=127.0.0.1:$(free_port)
  port=$(free_port)
  cmd=("$BIN/specd-draft" --address "$addr" --metrics_port "$port" --model "$DRAFT"
       --device "${DRAFT_DEVICE:-$DEVICE}")
  if [ -n "$EAGLE_HEAD" ]; then
    cmd+=(--eagle_head "$EAGLE_HEAD" --eagle_target "$TARGET")
  fi
  pin "${cmd[@]}"
  # shellcheck disable=SC2206
  PINNED+=($DRAFT_FLAGS)
  DRAFT_CMDS+=("${PINNED[*]}")
  DRAFT_ADDRS+=("$addr")
  METRICS_ARGS+=(--metrics "draft$([ "$g" = 0 ] || echo "$g")=http://127.0.0.1:$port/metrics")
done
if [ "$PIN" = 1 ]; then
  PINNING="each model service on $THREADS core(s) of its own (taskset, $THREADS engine"
  PINNING+=" thread(s) each; wrapping around $(nproc) cores); router and client unpinned"
fi
VERIFY_LIST=$(IFS=,; echo "${VERIFY_ADDRS[*]}")
DRAFT_LIST=$(IFS=,; echo "${DRAFT_ADDRS[*]}")
ROUTER_CMD=("$BIN/specd-router" --address "$ROUTER_ADDR" --metrics_port "$ROUTER_METRICS"
            --model "$TARGET" --verify_address "$VERIFY_LIST" --draft_address "$DRAFT_LIST")
# shellcheck disable=SC2206
ROUTER_CMD+=($ROUTER_FLAGS)

echo "== serve_cluster: target $TARGET, draft $DRAFT" >&2
echo "   pinning: $PINNING" >&2
for i in "${!VERIFY_CMDS[@]}"; do
  # shellcheck disable=SC2086  # joined with spaces above
  ${VERIFY_CMDS[$i]} >"$LOGDIR/verify$i.log" 2>&1 &
  PIDS+=($!)
done
for i in "${!DRAFT_CMDS[@]}"; do
  # shellcheck disable=SC2086
  ${DRAFT_CMDS[$i]} >"$LOGDIR/draft$i.log" 2>&1 &
  PIDS+=($!)
done
"${ROUTER_CMD[@]}" >"$LOGDIR/router.log" 2>&1 &
PIDS+=($!)
echo "   router $ROUTER_ADDR, verify $VERIFY_LIST, draft $DRAFT_LIST; logs in $LOGDIR" >&2
wait_for_cluster "$BIN" "$ROUTER_ADDR" "$LOGDIR" "${SERVE_CLUSTER_TIMEOUT_S:-600}" "${PIDS[@]}" ||
  exit 1
# The router serves once one group is up: wait for every group, so that none starts late.
if [ "$GROUPS_N" -gt 1 ]; then
  "$PYTHON" - "$ROUTER_METRICS" "$GROUPS_N" "${SERVE_CLUSTER_TIMEOUT_S:-600}" <<'EOF' || exit 1
import re, sys, time, urllib.request
port, groups, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
end = time.time() + timeout
while time.time() < end:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    up = re.findall(r'^specd_verify_available\{[^}]*verify_group="\d+"[^}]*\} 1', text, re.M)
    if len(up) >= groups:
        sys.exit(0)
    time.sleep(0.2)
sys.exit("serve_cluster.sh: not every verify group came up")
EOF
fi

BUILD_TYPE=
if [ -f "$BIN/../CMakeCache.txt" ]; then
  BUILD_TYPE=$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$BIN/../CMakeCache.txt")
fi
META=$("$PYTHON" - "$TARGET" "$DRAFT" "$PINNING" "$BIN" "$BUILD_TYPE" \
  "$(IFS=';'; echo "${VERIFY_CMDS[*]}")" "$(IFS=';'; echo "${DRAFT_CMDS[*]}")" \
  "${ROUTER_CMD[*]}" "$COMMAND" "$GROUPS_N" "$DRAFTS_N" <<'EOF'
import json, sys
print(json.dumps({"target_dir": sys.argv[1], "draft_dir": sys.argv[2], "pinning": sys.argv[3],
                  "bin": sys.argv[4], "build_type": sys.argv[5], "verify_cmd": sys.argv[6],
                  "draft_cmd": sys.argv[7], "router_cmd": sys.argv[8],
                  "launcher": "bench/serve_cluster.sh", "launcher_command": sys.argv[9],
                  "verify_groups": int(sys.argv[10]), "draft_services": int(sys.argv[11])}))
EOF
)
set +e
SPECD_BENCH_META=$META "$PYTHON" "$ROOT/bench/serve_bench.py" --target "$ROUTER_ADDR" \
  --metrics "router=http://127.0.0.1:$ROUTER_METRICS/metrics" "${METRICS_ARGS[@]}" \
  "${BENCH_ARGS[@]}"
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
