#!/usr/bin/env bash
# One GPU-host run that makes every artefact of issue 4: trains the reference models, makes the
# oracle fixtures and measures the transformers baseline. Each step has its own time limit so a
# failure of one leaves the others' results. Fits in 10 minutes on one H200.
#
#   bash tools/reference_models/run_on_host.sh [SRC] [WORK] [OUT]
#
# SRC: the folder holding tools/ and bench/ (default: .); WORK: scratch (default /tmp/refwork);
# OUT: where archives and logs go (default: $OUT, else WORK/out). Results:
#   OUT/target.tgz, OUT/draft.tgz   models/pycoder-target, models/pycoder-draft
#   OUT/results.tgz                 tests/fixtures/, bench/prompts/, bench/hf_baseline.json,
#                                   train_summary.json
#   OUT/*.log                       the logs
set -u
SRC=${1:-.}
WORK=${2:-/tmp/refwork}
OUT=${3:-${OUT:-$WORK/out}}
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
SRC=$(cd "$SRC" && pwd)
cd "$WORK"
start=$(date +%s)
stamp() { echo "[run_on_host $(( $(date +%s) - start ))s] $*"; }

# The model-independent fixtures run on 4 CPU cores beside the training.
stamp "fixtures (families, tokenizers) in the background"
( OMP_NUM_THREADS=4 RAYON_NUM_THREADS=4 timeout 300 nice -n 5 \
    python3 "$SRC/tools/oracle/make_fixtures.py" --out tests/fixtures \
    --parts families,tokenizers >"$OUT/fixtures_bg.log" 2>&1; echo "exit $?" >>"$OUT/fixtures_bg.log" ) &
bg=$!

stamp "train"
timeout 410 python3 "$SRC/tools/reference_models/train.py" --out . --total-seconds 370 \
  >"$OUT/train.log" 2>&1
stamp "train exit $?"
[ -d models/pycoder-target ] && tar czf "$OUT/target.tgz" models/pycoder-target
[ -d models/pycoder-draft ] && tar czf "$OUT/draft.tgz" models/pycoder-draft

wait $bg
stamp "fixtures (reference)"
timeout 60 python3 "$SRC/tools/oracle/make_fixtures.py" --out tests/fixtures --models models \
  --parts reference >"$OUT/fixtures_ref.log" 2>&1
stamp "fixtures exit $?"
tar czf "$OUT/results.tgz" tests bench train_summary.json 2>/dev/null

stamp "baseline"
timeout 125 python3 "$SRC/bench/hf_baseline.py" --models models \
  --prompts bench/prompts/code_prompts.json --out bench/hf_baseline.json --budget-s 110 \
  >"$OUT/baseline.log" 2>&1
stamp "baseline exit $?"
tar czf "$OUT/results.tgz" tests bench train_summary.json 2>/dev/null

for f in train fixtures_bg fixtures_ref baseline; do
  echo "===== $f.log (tail)"; grep -v -E "SUMMARY_JSON|BASELINE_JSON" "$OUT/$f.log" | tail -n 8 | cut -c1-300
done
ls -la "$OUT"
stamp "done"
