#!/usr/bin/env bash
# Packs a CUDA build made here for a GPU host (x86-64, glibc at least this machine's, its own
# CUDA 13 runtime and driver) into one archive that travels with the working tree:
#
#   tools/gpu/pack.sh [--build DIR] [--keep REGEX] [--all] [--out DIR] [--dry-run]
#
# 1. Copies the ELF executables under the build folder (CMakeFiles excluded) whose path relative
#    to it matches KEEP -- by default the tests/gpu binaries, the CUDA benchmarks, the EAGLE taps'
#    wire benchmark (taps_transfer_bench: the GPU host's idle cores), a previous build's
#    benchmarks under bench-prev/ and the services and CLI -- into STAGING/bin, keeping
#    those relative paths (build/bin/specd-router lands in bin/bin/specd-router), and strips them.
#    --all keeps every executable.
# 2. Copies the shared libraries they load that the GPU host lacks (gRPC, protobuf, Abseil,
#    prometheus-cpp, re2, c-ares, OpenSSL, zlib, ...) into STAGING/lib, as ldd resolves them here.
#    The C and C++ runtime, the dynamic loader and the CUDA libraries (driver, cudart, cuBLAS,
#    cuBLASLt, NCCL, NVRTC) stay out: the GPU host has its own, matching its driver.
# 3. Writes STAGING/env.sh, which puts bin/ on PATH and lib/ first on LD_LIBRARY_PATH, keeps
#    NVLink multicast off and lists any library still missing on the host.
# 4. Tars STAGING into OUT/pack.tgz (OUT defaults to .device-x; both folders are git-ignored).
#
# On the GPU host, from the repository root, with OUT carried along:
#   mkdir -p .device && tar -xzf .device-x/pack.tgz -C .device && . .device/env.sh
# after which tools/gpu/run.sh finds everything under .device. What travels must stay under
# 64 MiB; the default KEEP gives about 40 MiB.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=build
keep='tests/(.*_cuda_test|cuda_.*_test|gemm_invariance_test)$|bench/cuda_|bench/taps_transfer_bench$|bench-prev/|bin/specd-'
out=$here/.device-x
staging=$here/.device-p
dry=0
usage() { sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=${2:?--build needs a folder}; shift ;;
    --keep) keep=${2:?--keep needs a regex}; shift ;;
    --all) keep='.' ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "pack.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ -d "$build" ] || { echo "pack.sh: no build folder $build" >&2; exit 2; }
build=$(cd "$build" && pwd)

# Libraries the GPU host provides itself, matched against ldd's resolved paths.
skip='/(libc|libm|libmvec|libpthread|libdl|librt|libutil|libresolv|libstdc\+\+|libgcc_s|'
skip+='ld-linux[^/]*|linux-vdso[^/]*|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvrtc|'
skip+='libnvrtc-builtins|libnvJitLink|libcudnn[^/]*|libnvidia-[^/]*)\.so'

mapfile -t exes < <(find "$build" -path '*/CMakeFiles' -prune -o -type f -perm -u+x -print |
  sort | while read -r f; do
    rel=${f#"$build"/}
    [[ $rel =~ $keep ]] || continue
    head -c4 "$f" 2>/dev/null | grep -q ELF && echo "$f"
  done)
[ ${#exes[@]} -gt 0 ] || { echo "pack.sh: no executable under $build matches $keep" >&2; exit 2; }

mapfile -t libs < <(for f in "${exes[@]}"; do
    ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
  done | { grep -v -E "$skip" || true; } | sort -u)
if ldd "${exes[@]}" 2>/dev/null | grep -q 'not found'; then
  echo "pack.sh: some executables miss libraries here:" >&2
  ldd "${exes[@]}" 2>/dev/null | grep 'not found' | sort -u >&2
  exit 1
fi

if [ $dry -eq 1 ]; then
  printf 'executable %s\n' "${exes[@]#"$build"/}"
  [ ${#libs[@]} -eq 0 ] || printf 'library %s\n' "${libs[@]}"
  echo "would pack ${#exes[@]} executables and ${#libs[@]} libraries into $out/pack.tgz"
  exit 0
fi

rm -rf "$staging"
mkdir -p "$staging/bin" "$staging/lib" "$out"
for f in "${exes[@]}"; do
  rel=${f#"$build"/}
  mkdir -p "$staging/bin/$(dirname "$rel")"
  cp "$f" "$staging/bin/$rel"
  strip --strip-unneeded "$staging/bin/$rel" 2>/dev/null || true
done
for lib in "${libs[@]}"; do
  # -L: the soname link's target under the soname, the name the executables ask for.
  cp -L "$lib" "$staging/lib/$(basename "$lib")"
  strip --strip-unneeded "$staging/lib/$(basename "$lib")" 2>/dev/null || true
done

cat > "$staging/env.sh" <<'ENV'
# Source on the GPU host from the repository root: . .device/env.sh
pack_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SPECD_PACK_DIR=$pack_dir
export PATH="$pack_dir/bin/bin:$pack_dir/bin:$PATH"
cuda_libs=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib
cuda_libs+=:/usr/local/cuda-13.0/targets/x86_64-linux/lib
export LD_LIBRARY_PATH="$pack_dir/lib:$cuda_libs:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset cuda_libs
# NVLink multicast stays off: on shared hosts it can take GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pack_missing=$(find "$pack_dir/bin" -type f -exec ldd {} + 2>/dev/null | grep 'not found' | sort -u)
[ -z "$pack_missing" ] || { echo "env.sh: libraries not found:"; echo "$pack_missing"; }
unset pack_missing
ENV

tar -czf "$out/pack.tgz" -C "$staging" .
size=$(du -m "$out/pack.tgz" | cut -f1)
echo "packed ${#exes[@]} executables and ${#libs[@]} libraries into $out/pack.tgz (${size} MiB)"
[ "$size" -lt 60 ] ||
  echo "pack.sh: warning: ${size} MiB; what travels to the GPU host must stay under 64 MiB" >&2
