#!/usr/bin/env python3
"""Installs the Python SDK the way a user does, for the SDK tests (ctest fixture
python_sdk_venv): builds a wheel from a copy of clients/python alone (what a
`git+...#subdirectory=clients/python` install sees), installs it into a fresh venv, and checks
that `import specd` works there with no other step. When the source tree is a git checkout, it
also installs `git+file://<checkout>@HEAD#subdirectory=clients/python` into a second venv and
imports it (this installs the committed tree, so it checks HEAD, not uncommitted edits).

  python_sdk_venv.py SOURCE_DIR VENV_DIR

No package index is used (this machine and CI reach none): the venvs are made with
--system-site-packages, so grpcio and protobuf, compiled extensions, come from Debian
(python3-grpcio, python3-protobuf) and pip checks the wheel's requirements against them; the
build runs without isolation on Debian's setuptools and wheel, since an isolated build would
download them. With an index, `pip install ./clients/python` does the same with isolation.
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

PIP_OFFLINE = ["--no-index", "--no-cache-dir", "--disable-pip-version-check", "--no-input"]


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def make_venv(path):
    shutil.rmtree(path, ignore_errors=True)
    # Debian's pip is visible through the system site packages: seeding a pip copy into every
    # venv (ensurepip) would only cost time.
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", path])
    return os.path.join(path, "bin", "python")


def check_import(python, cwd):
    """Imports specd from outside any source folder and checks it is the installed copy."""
    code = ("import os, sys, specd, specd.v1.generation_pb2 as pb; "
            "d = os.path.dirname(specd.__file__); "
            "assert d.startswith(sys.prefix), d; "
            "assert os.path.exists(os.path.join(d, 'py.typed')), 'no py.typed'; "
            "assert os.path.exists(os.path.join(d, 'v1', 'generation_pb2.pyi')), 'no .pyi'; "
            "assert pb.GenerateRequest(prompt='x').prompt == 'x'; "
            "print('import specd OK:', d)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run([python, "-c", code], cwd=cwd, env=env)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, venv = (os.path.abspath(a) for a in sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="specd-sdk-") as tmp:
        # Only the subdirectory: the build must not reach ../../proto or anything else.
        pkg = os.path.join(tmp, "python")
        shutil.copytree(os.path.join(source, "clients", "python"), pkg,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                      "tests"))
        dist = os.path.join(tmp, "dist")
        run([sys.executable, "-m", "pip", "wheel", *PIP_OFFLINE, "--no-deps",
             "--no-build-isolation", "-w", dist, pkg])
        wheels = glob.glob(os.path.join(dist, "specd-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"expected one specd wheel, got {wheels}")
        python = make_venv(venv)
        run([python, "-m", "pip", "install", *PIP_OFFLINE, wheels[0]])
        check_import(python, tmp)

        if os.path.exists(os.path.join(source, ".git")):
            head = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], check=True,
                                  capture_output=True, text=True).stdout.strip()
            git_venv = os.path.join(tmp, "git-venv")
            git_python = make_venv(git_venv)
            run([git_python, "-m", "pip", "install", *PIP_OFFLINE, "--no-build-isolation",
                 f"git+file://{source}@{head}#subdirectory=clients/python"])
            check_import(git_python, tmp)
        else:
            print("not a git checkout: the git+ install is not tried")
    return 0


if __name__ == "__main__":
    sys.exit(main())
