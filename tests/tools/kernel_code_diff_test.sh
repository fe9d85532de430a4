#!/bin/bash
# tools/gpu/kernel_code_diff.py on this build's CUDA kernel library: against itself every
# function is identical (exit 0); against the library without one object, that object's kernels
# are reported on one side only (exit 1).
set -u
lib=$1
tool=tools/gpu/kernel_code_diff.py
[ -f "$lib" ] || { echo "FAIL: no library $lib"; exit 1; }
fail() { echo "FAIL: $*"; exit 1; }

out=$(python3 "$tool" "$lib" "$lib") || fail "the library against itself: $out"
grep -qE '^[1-9][0-9]* functions identical .* 0 differ, 0 on one side only$' <<<"$out" ||
  fail "no identical functions reported: $out"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$lib" "$tmp/less.a"
victim=$(ar t "$tmp/less.a" | grep -m1 'tree_accept')
[ -n "$victim" ] || fail "no tree_accept object in $lib"
ar d "$tmp/less.a" "$victim"
if out=$(python3 "$tool" "$lib" "$tmp/less.a"); then
  fail "a library without $victim compared equal: $out"
fi
grep -q '^only in OLD: .*TreeAcceptKernel' <<<"$out" || fail "TreeAcceptKernel not reported: $out"
echo "kernel_code_diff: identical to itself; a missing object's kernels reported"
