#!/usr/bin/env python3
"""Writes, or checks, the Python SDK's generated gRPC code (specd/v1/generation_pb2.py, .pyi and
generation_pb2_grpc.py) from proto/specd/v1/generation.proto.

  python3 clients/python/gen_protos.py           # rewrite clients/python/specd/v1/
  python3 clients/python/gen_protos.py --check   # exit 1 if the committed files differ

The generated files are committed so that `pip install ./clients/python` and
`pip install "git+...#subdirectory=clients/python"` need nothing outside clients/python (a git+
install sees only that subdirectory, never ../../proto) and no compiler at install time. ctest
runs --check (python_sdk_stubs_current) so that they never drift from the proto.

The canonical generator is Debian 12's: protoc 3.21.12 (protobuf-compiler) and
grpc_python_plugin 1.51 (protobuf-compiler-grpc), which the C++ build needs anyway; code from
another version differs in details, so --check insists on those. Python gencode of protoc 3.21
runs on protobuf >= 3.20 and grpc stubs of 1.51 on grpcio >= 1.51 (pyproject.toml's bounds).
"""

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTOS = ["specd/v1/generation.proto"]
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]
PROTOC_VERSION = "libprotoc 3.21.12"


def generate(out):
    """Generates into out/specd/v1; returns the protoc version string."""
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if not (protoc and plugin):
        sys.exit("gen_protos: need protoc and grpc_python_plugin on PATH (Debian: "
                 "protobuf-compiler, protobuf-compiler-grpc)")
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True,
                             check=True).stdout.strip()
    os.makedirs(os.path.join(out, "specd", "v1"), exist_ok=True)
    cmd = [protoc, f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}",
           f"--grpc_out={out}", f"--plugin=protoc-gen-grpc={plugin}"] + PROTOS
    rc = subprocess.call(cmd)
    if rc != 0:
        sys.exit(f"gen_protos: protoc failed ({rc})")
    return version


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="compare with the committed files instead of writing them")
    args = ap.parse_args()
    committed = os.path.join(HERE, "specd", "v1")
    with tempfile.TemporaryDirectory() as tmp:
        version = generate(tmp)
        fresh = os.path.join(tmp, "specd", "v1")
        if not args.check:
            for name in GENERATED:
                shutil.copyfile(os.path.join(fresh, name), os.path.join(committed, name))
            if version != PROTOC_VERSION:
                print(f"gen_protos: warning: written with {version}, not {PROTOC_VERSION}; "
                      "the --check in CI will differ", file=sys.stderr)
            print(f"gen_protos: wrote {', '.join(GENERATED)} to {committed}")
            return 0
        if version != PROTOC_VERSION:
            sys.exit(f"gen_protos --check: needs {PROTOC_VERSION} (Debian 12), found {version}")
        stale = []
        for name in GENERATED:
            want = open(os.path.join(fresh, name), encoding="utf-8").read()
            path = os.path.join(committed, name)
            have = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            if want != have:
                stale.append(name)
                sys.stderr.writelines(difflib.unified_diff(
                    have.splitlines(True), want.splitlines(True), f"committed/{name}",
                    f"generated/{name}", n=1))
        if stale:
            print(f"gen_protos --check: {', '.join(stale)} differ from proto/: run "
                  "python3 clients/python/gen_protos.py and commit", file=sys.stderr)
            return 1
        print(f"gen_protos --check: {', '.join(GENERATED)} match proto/ ({version})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
