#!/usr/bin/env bash
# specd in one command: installs the Debian packages, builds (Release, into build/), starts
# specd-verify, specd-draft and specd-router on free loopback ports on the CPU, streams one
# completion with specd-cli, then runs the same prompts with speculation off, with the draft
# model and with n-gram lookup and prints acceptance rate, mean accepted length and tokens/s for
# each. Everything it starts is stopped when it exits, however it exits.
#
# Models: models/pycoder-target and models/pycoder-draft when they exist (the project's
# reference models), else a small random pair made by specd-make-test-model (its output is
# gibberish; the numbers only show the machinery).
#
#   ./scripts/demo.sh                 # BUILD=dir to build elsewhere, MAX_NEW_TOKENS=n
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/lib/cluster.sh

./scripts/install-deps.sh
BUILD=${BUILD:-build}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}
echo "== building into $BUILD/ (the first build takes a few minutes; log: $BUILD/demo-build.log)"
mkdir -p "$BUILD"
: >"$BUILD/demo-build.log"
# Ninja's [done/total] counter as progress: one updating line on a terminal, a line every 10%
# otherwise; the whole output still goes to the log.
show_build_progress() {
  local line n total pct shown=-10 start=$SECONDS
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$BUILD/demo-build.log"
    [[ $line =~ ^\[([0-9]+)/([0-9]+)\]\ (.*) ]] || continue
    n=${BASH_REMATCH[1]} total=${BASH_REMATCH[2]}
    pct=$((n * 100 / total))
    if [ -t 1 ]; then
      printf '\r   %3d%%  %d/%d steps, %ds  %-60.60s' "$pct" "$n" "$total" \
        $((SECONDS - start)) "${BASH_REMATCH[3]}"
    elif ((pct >= shown + 10 || n == total)); then
      shown=$pct
      printf '   %3d%%  %d/%d steps, %ds\n' "$pct" "$n" "$total" $((SECONDS - start))
    fi
  done
  if [ -t 1 ]; then printf '\n'; fi
}
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release &&
       cmake --build "$BUILD" -j"$(nproc)" --target specd-verify specd-draft specd-router \
         specd-cli specd-make-test-model; } 2>&1 | show_build_progress; then
  tail -n 40 "$BUILD/demo-build.log" >&2
  echo "build failed; the whole log is $BUILD/demo-build.log" >&2
  exit 1
fi
BIN="$ROOT/$BUILD/bin"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd-demo.XXXXXX")
PIDS=()
trap 'stop_services "$WORK" "${PIDS[@]}"' EXIT
trap 'exit 130' INT TERM

if [ -f models/pycoder-target/config.json ] && [ -f models/pycoder-draft/config.json ]; then
  TARGET="$ROOT/models/pycoder-target"
  DRAFT="$ROOT/models/pycoder-draft"
  echo "== models: $TARGET (target), $DRAFT (draft)"
else
  TARGET="$WORK/target"
  DRAFT="$WORK/draft"
  echo "== models: models/pycoder-* not found; generating a small random pair"
  "$BIN/specd-make-test-model" --target_dir "$TARGET" --draft_dir "$DRAFT"
fi

VERIFY=127.0.0.1:$(free_port)
DRAFT_ADDR=127.0.0.1:$(free_port)
ROUTER=127.0.0.1:$(free_port)
VERIFY_METRICS=$(free_port)
DRAFT_METRICS=$(free_port)
ROUTER_METRICS=$(free_port)

# The cores are shared by two model services here; one thread each keeps them from fighting.
THREADS=$(( $(nproc) > 2 ? $(nproc) / 2 : 1 ))
"$BIN/specd-verify" --address "$VERIFY" --metrics_port "$VERIFY_METRICS" --model "$TARGET" \
  --num_threads "$THREADS" >"$WORK/verify.log" 2>&1 &
PIDS+=($!)
"$BIN/specd-draft" --address "$DRAFT_ADDR" --metrics_port "$DRAFT_METRICS" --model "$DRAFT" \
  --num_threads "$THREADS" >"$WORK/draft.log" 2>&1 &
PIDS+=($!)
"$BIN/specd-router" --address "$ROUTER" --metrics_port "$ROUTER_METRICS" --model "$TARGET" \
  --verify_address "$VERIFY" --draft_address "$DRAFT_ADDR" >"$WORK/router.log" 2>&1 &
PIDS+=($!)

echo "== waiting for the services (router $ROUTER, verify $VERIFY, draft $DRAFT_ADDR)"
wait_for_cluster "$BIN" "$ROUTER" "$WORK" 120 "${PIDS[@]}" || exit 1
echo "   metrics: http://127.0.0.1:$ROUTER_METRICS/metrics (router)," \
  "http://127.0.0.1:$VERIFY_METRICS/metrics (verify), http://127.0.0.1:$DRAFT_METRICS/metrics (draft)"

PROMPTS=(
  $'class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n'
  $'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
  $'import os\nimport sys\n\n\ndef main():\n'
  $'def read_lines(path):\n    with open(path) as f:\n'
)

echo
echo "== specd-cli generate --prompt <first prompt> --max-new-tokens $MAX_NEW_TOKENS"
echo "----------------------------------------------------------------------"
printf '%s' "${PROMPTS[0]}"
"$BIN/specd-cli" generate --server "$ROUTER" --prompt "${PROMPTS[0]}" \
  --max-new-tokens "$MAX_NEW_TOKENS"
echo "----------------------------------------------------------------------"

echo
echo "== the same ${#PROMPTS[@]} prompts, greedy, $MAX_NEW_TOKENS new tokens each, one at a time"
for mode in off draft_model ngram; do
  for p in "${PROMPTS[@]}"; do
    "$BIN/specd-cli" generate --server "$ROUTER" --prompt "$p" --max-new-tokens "$MAX_NEW_TOKENS" \
      --speculation "$mode" --json | tail -n 1 | sed "s/^/$mode /"
  done
done >"$WORK/stats.txt"
python3 - "$WORK/stats.txt" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    mode, _, doc = line.partition(" ")
    s = json.loads(doc)
    r = rows.setdefault(mode, dict(tokens=0, seconds=0.0, steps=0, draft=0, accepted=0))
    r["tokens"] += s["usage"]["completion_tokens"]
    r["seconds"] += s["elapsed_seconds"]
    r["steps"] += s["speculation"]["steps"]
    r["draft"] += s["speculation"]["draft_tokens"]
    r["accepted"] += s["speculation"]["accepted_tokens"]
print(f"{'speculation':<12} {'tokens':>7} {'tokens/s':>9} {'acceptance':>11} {'mean accepted length':>21}")
base = rows.get("off", {}).get("tokens", 0) / max(rows.get("off", {}).get("seconds", 1), 1e-9)
for mode, r in rows.items():
    tps = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
    acc = f"{r['accepted'] / r['draft']:.2f}" if r["draft"] else "-"
    mal = f"{1 + r['accepted'] / r['steps']:.2f}" if r["steps"] else "-"
    speedup = f"  ({tps / base:.2f}x)" if base else ""
    print(f"{mode:<12} {r['tokens']:>7} {tps:>9.1f} {acc:>11} {mal:>21}{speedup}")
EOF
echo
echo "acceptance = accepted draft tokens / draft tokens proposed; mean accepted length ="
echo "tokens emitted per speculative step, bonus token included. Timings are wall-clock on this"
echo "machine with all three services sharing its cores; they are not benchmarks (bench/ has those)."
echo "== stopping the services"
