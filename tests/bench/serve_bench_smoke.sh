#!/usr/bin/env bash
# serve_bench_smoke BUILD_DIR: writes a tiny synthetic pair, benchmarks it through
# bench/serve_cluster.sh --cpu and checks the JSON (check_serve_bench_json.py).
set -euo pipefail
BUILD=$1
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd-bench-smoke.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"$BUILD/bin/specd-make-synthetic-pair" --shape reference --layers 2 --draft_layers 1 \
  --epsilon 0.5 --target_dir "$WORK/target" --draft_dir "$WORK/draft" --num_threads 2
PLOT=()
if "$PYTHON" -c 'import matplotlib' 2>/dev/null; then PLOT=(--plot "$WORK/out.png"); fi
bench/serve_cluster.sh --cpu --bin "$BUILD/bin" --target-model "$WORK/target" \
  --draft-model "$WORK/draft" --concurrency 1,2 --num-requests 4 --warmup 1 \
  --max-new-tokens 12 --speculation off,chain4=draft_model:depth=4,top_k=1,nodes=4,ngram \
  --check-lossless --quiet \
  --json "$WORK/out.json" "${PLOT[@]}" --meta title=smoke
"$PYTHON" tests/bench/check_serve_bench_json.py "$WORK/out.json" ${PLOT[@]:+"$WORK/out.png"}
