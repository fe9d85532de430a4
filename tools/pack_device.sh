#!/usr/bin/env bash
# Packs a CUDA build for the GPU host the way the sessions run it, in one step:
# ../shared/device/pack.sh (its library filter made to tolerate a binary whose libraries are
# all skipped, which otherwise stops it under `set -e`), then keeps only what a GPU call runs --
# tests/gpu binaries, CUDA benchmarks and the services, matched by KEEP (an extended regex over
# paths under bin/) -- and tars the result into .device-x/pack.tgz (39-42 MiB with the default
# KEEP, of the 64 MiB that may travel).
#   tools/pack_device.sh [BUILD_DIR] [KEEP]
# Then run with carry [".device-x"] and a command that starts
#   mkdir -p .device && tar -xzf .device-x/pack.tgz -C .device && . .device/env.sh
set -euo pipefail
build=${1:-build}
keep=${2:-'tests/(.*_cuda_test|cuda_.*_test|gemm_invariance_test)$|bench/cuda_|bench-prev/|bin/specd-'}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pack=$(mktemp)
trap 'rm -f "$pack"' EXIT
sed 's/grep -v -E "\$skip" | while/{ grep -v -E "$skip" || true; } | while/' \
  "$here/../shared/device/pack.sh" > "$pack"
staging=$here/.device-p
# pack.sh's size warning is about the staging folder, which the pruning below shrinks.
if ! out=$(bash "$pack" "$build" "$staging" 2>&1); then
  echo "$out" >&2
  exit 1
fi
(cd "$staging" && find bin -type f | { grep -v -E "$keep" || true; } | xargs -r rm -f)
mkdir -p "$here/.device-x"
tar -czf "$here/.device-x/pack.tgz" -C "$staging" .
echo "packed $(find "$staging/bin" -type f | wc -l) executables into .device-x/pack.tgz" \
  "($(du -m "$here/.device-x/pack.tgz" | cut -f1) MiB)"
