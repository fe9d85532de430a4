# Shell helpers for scripts that start the three services themselves (scripts/demo.sh,
# tools/gpu/run.sh cluster). Source it; it defines functions only.

# wait_for_cluster BIN ROUTER WORK TIMEOUT_S PID...
# Returns 0 once the router at ROUTER reports the draft service and a one-token generation goes
# through (BIN/specd-cli), polling every 0.2 s. Returns 1, after printing the last lines of
# WORK/*.log, when one of the PIDs exits first or TIMEOUT_S seconds pass.
wait_for_cluster() {
  local bin=$1 router=$2 work=$3 timeout=$4
  shift 4
  local start=$SECONDS pid
  while [ $((SECONDS - start)) -lt "$timeout" ]; do
    for pid in "$@"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "a service exited; its logs:" >&2
        tail -n 20 "$work"/*.log >&2
        return 1
      fi
    done
    if "$bin/specd-cli" info --server "$router" 2>/dev/null | grep -q '"draft_available":true' &&
       "$bin/specd-cli" generate --server "$router" --prompt x --max-new-tokens 1 >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.2
  done
  echo "the services did not become ready in $timeout s; logs:" >&2
  tail -n 20 "$work"/*.log >&2
  return 1
}
