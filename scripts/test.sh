#!/usr/bin/env bash
# Installs what specd needs (Debian 12), builds everything and runs every test.
#   ./scripts/test.sh            # build into build/ and run ctest
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD=${BUILD:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)" --timeout 900
