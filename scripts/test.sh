#!/usr/bin/env bash
# Installs what specd needs (Debian 12), builds everything and runs every test.
#   ./scripts/test.sh            # build into build/ and run ctest
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD=${BUILD:-build}
# ccache, where installed, makes a rebuild of an unchanged tree take seconds instead of minutes
# (the CUDA sources dominate a cold build).
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}"
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)" --timeout 900
