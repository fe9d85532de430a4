#!/usr/bin/env bash
# The C++ SDK as an outside project gets it (ctest label "sdk"):
#   cpp_sdk_install_test.sh install BUILD SOURCE
#     installs specd's "sdk" component from BUILD to a temporary prefix, checks that it holds
#     the SDK and nothing else, builds clients/cpp/example against it with
#     find_package(specd CONFIG REQUIRED), and runs the example against a real CPU cluster
#     (specd-verify + specd-router from BUILD/bin on free loopback ports).
#   cpp_sdk_install_test.sh standalone BUILD SOURCE
#     configures, builds and installs clients/cpp on its own (without the rest of specd), then
#     builds the example against that install.
set -euo pipefail
MODE=$1
BUILD=$(cd "$2" && pwd)
SOURCE=$(cd "$3" && pwd)
BIN="$BUILD/bin"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd-sdk-test.XXXXXX")
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
# ccache, where installed, spares the standalone build most of its compile time.
if command -v ccache >/dev/null; then GENERATOR+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
fail() { echo "FAIL: $*" >&2; exit 1; }

build_example() {  # PREFIX
  cmake -S "$SOURCE/clients/cpp/example" -B "$WORK/example" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$1" >"$WORK/example-configure.log" 2>&1 ||
    { cat "$WORK/example-configure.log" >&2; fail "configuring the example against $1"; }
  cmake --build "$WORK/example" >"$WORK/example-build.log" 2>&1 ||
    { cat "$WORK/example-build.log" >&2; fail "building the example against $1"; }
  # Its headers come from the prefix, not from the source tree.
  if grep -rq -- "$SOURCE/clients/cpp/include" "$WORK/example/build.ninja" \
      "$WORK/example/CMakeFiles" 2>/dev/null; then
    fail "the example was compiled with the source tree's headers"
  fi
}

if [ "$MODE" = standalone ]; then
  cmake -S "$SOURCE/clients/cpp" -B "$WORK/sdk" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    >"$WORK/sdk-configure.log" 2>&1 || { cat "$WORK/sdk-configure.log" >&2; fail "configure"; }
  cmake --build "$WORK/sdk" >"$WORK/sdk-build.log" 2>&1 ||
    { cat "$WORK/sdk-build.log" >&2; fail "building clients/cpp on its own"; }
  cmake --install "$WORK/sdk" --prefix "$WORK/prefix" >/dev/null
  build_example "$WORK/prefix"
  "$WORK/example/specd-example" 2>/dev/null && fail "the example ran without arguments"
  echo "PASS: clients/cpp builds and installs on its own; the example builds against it"
  exit 0
fi
[ "$MODE" = install ] || fail "unknown mode $MODE"

# 1. Install the component and check what it holds.
PREFIX="$WORK/prefix"
cmake --install "$BUILD" --prefix "$PREFIX" --component sdk >/dev/null
(cd "$PREFIX" && find . -type f | sed 's|^\./||' | sort) >"$WORK/installed"
for f in include/specd/client.h include/specd/types.h include/specd/v1/generation.pb.h \
         include/specd/v1/generation.grpc.pb.h lib/libspecd_client.a \
         lib/libspecd_client_proto.a lib/cmake/specd/specdConfig.cmake \
         lib/cmake/specd/specdConfigVersion.cmake lib/cmake/specd/specdTargets.cmake \
         share/specd/proto/specd/v1/generation.proto; do
  grep -qx "$f" "$WORK/installed" || { cat "$WORK/installed" >&2; fail "$f is not installed"; }
done
if grep -Ev '^(include/specd/|lib/libspecd_client(_proto)?\.a$|lib/cmake/specd/|share/specd/proto/)' \
    "$WORK/installed"; then
  fail "the sdk component installs more than the SDK (above)"
fi

# 2. The example, built as an outside project.
build_example "$PREFIX"

# 3. Run against a real CPU cluster.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
"$BIN/specd-make-test-model" --target_dir "$WORK/target" --draft_dir "$WORK/draft" \
  --hidden_size=64 --intermediate_size=128 --num_layers=2 --draft_layers=1 >/dev/null
VERIFY=127.0.0.1:$(free_port)
ROUTER=127.0.0.1:$(free_port)
"$BIN/specd-verify" --address "$VERIFY" --metrics_port "$(free_port)" --model "$WORK/target" \
  --num_threads 1 >"$WORK/verify.log" 2>&1 &
PIDS+=($!)
"$BIN/specd-router" --address "$ROUTER" --metrics_port "$(free_port)" --model "$WORK/target" \
  --verify_address "$VERIFY" >"$WORK/router.log" 2>&1 &
PIDS+=($!)
ready=0
for _ in $(seq 1 300); do
  if "$BIN/specd-cli" generate --server "$ROUTER" --prompt x --max-new-tokens 1 \
      >/dev/null 2>&1; then
    ready=1
    break
  fi
  sleep 0.2
done
[ $ready = 1 ] || { tail -n 20 "$WORK"/*.log >&2; fail "the cluster did not come up"; }

"$WORK/example/specd-example" "$ROUTER" "def add(a, b):" 16 >"$WORK/out" 2>&1 ||
  { cat "$WORK/out" >&2; fail "the example failed against the cluster"; }
cat "$WORK/out"
grep -q '^model: target (draft: none, context ' "$WORK/out" || fail "no model line"
# No draft service: auto speculates with the router's own n-gram lookup, or not at all.
grep -Eq '^\[finish: (length|eos), [0-9]+ prompt \+ [0-9]+ completion tokens; speculation (off: 0 steps|ngram: [0-9]+ steps, acceptance [0-9.]+, mean accepted length [0-9.]+)\]$' \
  "$WORK/out" || fail "no summary line"

# A router that is not there: a clear error and exit status 1.
set +e
"$WORK/example/specd-example" "127.0.0.1:$(free_port)" x 4 >"$WORK/down" 2>&1
code=$?
set -e
[ $code = 1 ] || { cat "$WORK/down" >&2; fail "exit status $code against no router, want 1"; }
grep -q '^error: UNAVAILABLE: ' "$WORK/down" || { cat "$WORK/down" >&2; fail "no UNAVAILABLE"; }
echo "PASS: the installed SDK builds the example as an outside project, and it runs"
