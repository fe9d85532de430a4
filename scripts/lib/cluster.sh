# Shell helpers for scripts that start the three services themselves (scripts/demo.sh,
# bench/serve_cluster.sh, tools/gpu/run.sh cluster). Source it; it defines functions only.

# free_port: prints a loopback TCP port that was free a moment ago ($PYTHON, else python3).
free_port() {
  "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

# stop_services WORK PID...: stops the PIDs (SIGTERM, then waits for each) and removes WORK.
# Scripts call it from their EXIT trap, so that whatever ends them (an error, Ctrl-C, SIGTERM)
# leaves no service running.
stop_services() {
  local work=$1 pid
  shift
  for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}

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
