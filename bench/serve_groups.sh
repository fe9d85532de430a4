#!/usr/bin/env bash
# Throughput of one router over 1 against 2 verify groups (or any list of group counts), CPU:
# runs bench/serve_cluster.sh once per count with the same requests, writes one JSON per count
# and prints their tables (bench/serve_report.py). Each model service gets cores of its own.
#
#   bench/serve_groups.sh                       # a 16-core host: 3 cores per service
#   bench/serve_groups.sh --threads-per-service 1 --drafts 1 --concurrency 8,32 \
#       --num-requests 32 --rounds 2            # a 2-core host (see bench/CURRENT.md)
#
# Options (the rest go to serve_cluster.sh and serve_bench.py, after the defaults below):
#   --groups L                 verify group counts to compare (default 1,2)
#   --drafts N                 draft services, the same in every run (default 2)
#   --threads-per-service T    cores and engine threads per model service (default 3: with
#                              2 groups and 2 draft services, 12 cores pinned, 4 left for the
#                              router and the client)
#   --out PREFIX               JSON paths PREFIX<count>.json (default bench/results/cpu_groups_)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GROUPS_LIST=1,2
DRAFTS=2
THREADS=3
OUT=bench/results/cpu_groups_
REST=()
need() { [ $# -ge 2 ] || { echo "serve_groups.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --groups) need "$@"; GROUPS_LIST=$2; shift 2 ;;
    --drafts) need "$@"; DRAFTS=$2; shift 2 ;;
    --threads-per-service) need "$@"; THREADS=$2; shift 2 ;;
    --out) need "$@"; OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) REST+=("$1"); shift ;;
  esac
done
PY=${PYTHON:-python3}
[ -x /usr/bin/python3 ] && [ -z "${PYTHON:-}" ] && PY=/usr/bin/python3
FILES=()
IFS=, read -ra COUNTS <<<"$GROUPS_LIST"
for n in "${COUNTS[@]}"; do
  echo "== $n verify group(s), $DRAFTS draft service(s), $THREADS core(s) each" >&2
  "$ROOT/bench/serve_cluster.sh" --cpu --threads-per-service "$THREADS" --verify-groups "$n" \
    --drafts "$DRAFTS" --router-flags --max_batch=64 --concurrency 16,64 \
    --speculation off,draft_model --max-new-tokens 64 --num-requests 64 --rounds 3 --warmup 1 \
    --check-lossless --quiet --meta "title=$n verify group(s), $DRAFTS draft service(s), CPU" \
    --json "$OUT$n.json" "${REST[@]}"
  FILES+=("$OUT$n.json")
done
"$PY" "$ROOT/bench/serve_report.py" "${FILES[@]}"
