#!/usr/bin/env bash
# Installs the Debian 12 packages specd builds and tests with. The Python SDK's tests build its
# wheel offline and install it into a fresh venv (python3-venv, -pip, -setuptools, -wheel; grpcio
# and protobuf from Debian); git and curl run in them too. openssl makes the certificates of the
# C++ SDK's TLS tests.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config libgrpc++-dev protobuf-compiler-grpc
      libprotobuf-dev protobuf-compiler libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev
      libbenchmark-dev libre2-dev nlohmann-json3-dev libopenblas-dev libcpp-httplib-dev python3-grpcio
      python3-grpc-tools python3-pytest prometheus yamllint python3-protobuf python3-yaml
      python3-venv python3-pip python3-setuptools python3-wheel git curl unzip openssl
      # scripts/fuzz.sh: clang with its sanitizer and libFuzzer runtimes.
      clang libclang-rt-14-dev
      # tools/check_format.sh (the ctest test "format").
      clang-format
      # The EAGLE oracle and head tools' tests (tests/tools/test_eagle_oracle.py).
      python3-torch python3-regex
      # The serving benchmark's plots (bench/serve_bench.py --plot).
      python3-matplotlib)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
