#!/usr/bin/env bash
# gpt-fast's own speculative decoding and specd's, side by side on one synthetic pair, batch 1 /
# one stream (the peer row of issue 31's 8B matrix). On the GPU host, from the repository root,
# with a packed build and gpt-fast's sources carried in the ignored .carry-gptfast (made on the
# development machine by bench/tools/fetch_gpt_fast.sh MIRROR; never committed):
#
#   bench/tools/gpt_fast_vs_specd.sh --epsilon 0.015 --bin .device/bin/bin [--out DIR]
#   bench/tools/gpt_fast_vs_specd.sh --target /tmp/m/t --draft /tmp/m/d --bin .device/bin/bin
#
# 1. The pair: with --epsilon, specd-make-synthetic-pair --shape $SHAPE (llama-3.1-8b) with a
#    one-layer draft into $PAIR_DIR/{t,d} (kept and reused when its config has that epsilon);
#    with --target/--draft, that pair.
# 2. gpt-fast (bench/tools/gpt_fast_spec_bench.py): one process per case, plain decode and each
#    k of $KS, side by side: they compile together ($(nproc)/cases inductor threads each) and
#    time one at a time (--gate-dir), each killed after $GF_TIMEOUT_S. GPU memory: one target
#    per case (16 GB at 8B) plus the draft for the k cases.
# 3. specd right after, on the same prompts: bench/serve_cluster.sh at concurrency 1,
#    $SPECD_MODES (--check-lossless), $NUM_PROMPTS requests per mode, $NEW_TOKENS new tokens,
#    greedy, --ignore-eos, draft and verify on $DEVICE unless $SPECD_ARGS says otherwise (e.g.
#    SPECD_ARGS='--draft-device cuda:1 --router-flags --overlap=on' on two GPUs).
# 4. Both side by side: tokens/s (all tokens / all time, as serve_bench counts it at one
#    stream; gpt-fast's median over prompts beside it), tau, each one's ratio to its own plain
#    decode, and specd's auto against gpt-fast's best k.
#
# Settings (environment): SHAPE llama-3.1-8b, PAIR_DIR /tmp/gfspec-pair, KS 3,5,
# NEW_TOKENS 128, NUM_PROMPTS 8, DEVICE cuda:0, SPECD_MODES off,auto (serve_bench modes, e.g.
# off,auto,chain5=draft_model:depth=5,top_k=1,nodes=5 for specd's own chain at gpt-fast's k),
# GF_TIMEOUT_S 240, GF_ARGS (more flags for gpt_fast_spec_bench.py, e.g.
# --no-coordinate-descent for shorter compiles), SPECD_ARGS, GPT_FAST_DIR
# .carry-gptfast/gpt-fast, PYTHON python3 (one with torch). Writes, in OUT
# (default /tmp/gfspec), gf-CASE.{log,json}, specd.{log,json} and side_by_side.txt. Exit
# status 1 if a part failed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 2
eps='' target='' draft='' bin=build/bin out=${OUT:-/tmp/gfspec}
shape=${SHAPE:-llama-3.1-8b}
pair=${PAIR_DIR:-/tmp/gfspec-pair}
ks=${KS:-3,5}
new=${NEW_TOKENS:-128}
nprompts=${NUM_PROMPTS:-8}
device=${DEVICE:-cuda:0}
gf_dir=${GPT_FAST_DIR:-.carry-gptfast/gpt-fast}
py=${PYTHON:-python3}
need() { [ $# -ge 2 ] || { echo "gpt_fast_vs_specd.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --epsilon) need "$@"; eps=$2; shift 2 ;;
    --target) need "$@"; target=$2; shift 2 ;;
    --draft) need "$@"; draft=$2; shift 2 ;;
    --bin) need "$@"; bin=$2; shift 2 ;;
    --out) need "$@"; out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpt_fast_vs_specd.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$eps" ] && { [ -z "$target" ] || [ -z "$draft" ]; }; then
  echo "gpt_fast_vs_specd.sh: --epsilon E, or --target DIR and --draft DIR" >&2
  exit 2
fi
if [ ! -f "$gf_dir/generate_spec.py" ]; then
  echo "no $gf_dir/generate_spec.py: run bench/tools/fetch_gpt_fast.sh and carry it" >&2
  exit 2
fi
mkdir -p "$out"
t0=$(date +%s)
stamp() { echo "--- $(($(date +%s) - t0)) s: $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null

if [ -n "$eps" ]; then
  target=$pair/t draft=$pair/d
  have=$("$py" -c 'import json, sys
try:
    print(json.load(open(sys.argv[1]))["specd_synthetic"]["epsilon"])
except Exception:
    print("")' "$target/config.json")
  if [ -n "$have" ] && "$py" -c "import sys; sys.exit(abs($have - $eps) > 1e-12)" &&
     [ -f "$draft/config.json" ]; then
    stamp "reusing the pair in $pair (epsilon $have)"
  else
    stamp "writing the $shape pair, epsilon $eps, into $pair"
    "$bin/specd-make-synthetic-pair" --shape "$shape" --draft_layers 1 --epsilon "$eps" \
      --target_dir "$target" --draft_dir "$draft" || exit 1
  fi
fi

# gpt-fast: one process per case, compiled side by side, timed one at a time.
cases=(plain)
IFS=, read -r -a klist <<< "$ks"
for k in "${klist[@]}"; do cases+=("k$k"); done
threads=$(( $(nproc) / ${#cases[@]} ))
[ "$threads" -ge 1 ] || threads=1
gate=$out/gate
rm -rf "$gate"
stamp "gpt-fast: ${#cases[@]} cases (${cases[*]}) side by side, $threads compile threads each"
pids=()
for c in "${cases[@]}"; do
  if [ "$c" = plain ]; then cargs=(--ks "")
  else cargs=(--draft "$draft" --ks "${c#k}" --no-plain); fi
  # shellcheck disable=SC2086  # GF_ARGS is a list of flags
  TORCHINDUCTOR_COMPILE_THREADS=$threads timeout "${GF_TIMEOUT_S:-240}" "$py" \
    bench/tools/gpt_fast_spec_bench.py --target "$target" "${cargs[@]}" \
    --gpt-fast-dir "$gf_dir" --device "$device" --num-prompts "$nprompts" \
    --max-new-tokens "$new" --json "$out/gf-$c.json" --gate-dir "$gate" \
    --gate-count "${#cases[@]}" ${GF_ARGS:-} > "$out/gf-$c.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { rc=1; echo "gpt-fast ${cases[$i]} failed; end of its log:";
                          tail -n 5 "$out/gf-${cases[$i]}.log"; }
done
stamp "gpt-fast done"
for c in "${cases[@]}"; do
  grep -h '^\[gpt-fast-spec' "$out/gf-$c.log" | grep -v note | tail -n 3
done

# specd right after, same prompts, one stream.
stamp "specd: bench/serve_cluster.sh, concurrency 1, ${SPECD_MODES:-off,auto}"
# shellcheck disable=SC2086  # SPECD_ARGS is a list of flags
bench/serve_cluster.sh --bin "$bin" --device "$device" --target-model "$target" \
  --draft-model "$draft" --concurrency 1 --speculation "${SPECD_MODES:-off,auto}" \
  --ignore-eos --rounds 2 --warmup 1 --check-lossless --quiet --max-new-tokens "$new" \
  --num-prompts "$nprompts" --num-requests "$nprompts" --json "$out/specd.json" \
  ${SPECD_ARGS:-} > "$out/specd.log" 2>&1 ||
  { rc=1; echo "specd failed; end of its log:"; tail -n 20 "$out/specd.log"; }
stamp "specd done"

"$py" - "$out" "${cases[@]}" <<'EOF' | tee "$out/side_by_side.txt"
import json, os, sys
out, cases = sys.argv[1], sys.argv[2:]
def fmt(v, d=1):
    return "-" if v is None else f"{v:.{d}f}"
gf = {}
for c in cases:
    try:
        doc = json.load(open(os.path.join(out, f"gf-{c}.json")))
        gf[c] = doc["rows"][0]
        meta = doc["meta"]
    except Exception:
        gf[c] = None
rows = []
plain = gf.get("plain") or {}
base = plain.get("tok_s_aggregate")
for c in cases:
    r = gf[c]
    if not r or not r.get("tok_s_aggregate"):
        rows.append((f"gpt-fast {c}", "-", "-", "-", "-", (r or {}).get("mode", "no result")))
        continue
    rows.append((f"gpt-fast {c}", fmt(r["tok_s_aggregate"]), fmt(r["tok_s_median"]),
                 fmt(r["tok_s_aggregate"] / base, 2) if base else "-", fmt(r.get("tau"), 2),
                 r["mode"]))
best = max((gf[c] for c in cases if c != "plain" and gf[c] and gf[c].get("tok_s_aggregate")),
           key=lambda r: r["tok_s_aggregate"], default=None)
sp = {}
try:
    sdoc = json.load(open(os.path.join(out, "specd.json")))
    sp = sdoc["phases"][0]["modes"]
    lossless = sdoc["lossless"]
except Exception:
    lossless = None
off = (sp.get("off") or {}).get("output_tokens_per_s")
for m in sp or ("off", "auto"):
    s = sp.get(m)
    if not s:
        rows.append((f"specd {m}", "-", "-", "-", "-", "no result"))
        continue
    rows.append((f"specd {m}", fmt(s["output_tokens_per_s"]), "-",
                 fmt(s["output_tokens_per_s"] / off, 2) if off else "-", fmt(s.get("tau"), 2),
                 "serve_bench, c=1"))
print("| run | tok/s | tok/s median | x own plain | tau | mode |")
print("| --- | ---: | ---: | ---: | ---: | --- |")
for r in rows:
    print("| " + " | ".join(r) + " |")
auto = (sp.get("auto") or {}).get("output_tokens_per_s")
if best and auto:
    print(f"specd auto / gpt-fast best k (k={best['speculate_k']}): "
          f"{auto / best['tok_s_aggregate']:.2f}x; specd off / gpt-fast plain: "
          + (f"{off / base:.2f}x" if off and base else "-"))
if lossless is not None:
    print(f"specd lossless: {lossless['compared']} completions compared, "
          f"{len(lossless['mismatches'])} mismatches")
EOF
stamp "done ($out)"
exit $rc
