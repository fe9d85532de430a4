#!/usr/bin/env python3
"""Generates specd's Python gRPC stubs (specd/v1/generation_pb2.py, generation_pb2_grpc.py)
from proto/specd/v1.

  python3 clients/python/gen_protos.py              # into clients/python (git-ignored)
  python3 clients/python/gen_protos.py OUT_DIR      # into OUT_DIR/specd/v1 (the CMake build)

Uses protoc and grpc_python_plugin when both are on PATH (Debian: protobuf-compiler and
protobuf-compiler-grpc, which specd's C++ build needs anyway); otherwise the grpc_tools module
(pip's grpcio-tools). Debian 12's python3-grpc-tools bundles protoc 3.5, which predates proto3
`optional` fields, so it is not used.
"""

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTOS = ["specd/v1/generation.proto"]


def main():
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else HERE)
    os.makedirs(os.path.join(out, "specd", "v1"), exist_ok=True)
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        cmd = [protoc, f"-I{PROTO_ROOT}", f"--python_out={out}", f"--grpc_out={out}",
               f"--plugin=protoc-gen-grpc={plugin}"] + PROTOS
        rc = subprocess.call(cmd)
    else:
        try:
            from grpc_tools import protoc as grpc_protoc
        except ImportError:
            sys.exit("gen_protos: need protoc + grpc_python_plugin (Debian: protobuf-compiler, "
                     "protobuf-compiler-grpc) or grpcio-tools")
        include = os.path.join(os.path.dirname(grpc_protoc.__file__), "_proto")
        rc = grpc_protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                               f"--python_out={out}", f"--grpc_python_out={out}"] + PROTOS)
    if rc != 0:
        sys.exit(f"gen_protos: protoc failed ({rc})")
    init = os.path.join(out, "specd", "v1", "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""Generated from proto/specd/v1 by clients/python/gen_protos.py."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
