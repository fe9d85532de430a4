#!/usr/bin/env python3
"""Runs pytest on test files for ctest. With --cluster, first checks that the specd
executables are built (specd_cluster.missing_binaries) and exits 77, which ctest reports as
skipped, with the list of what is missing when they are not. With --venv DIR, runs under that
venv's python (the one the SDK was installed into: python_sdk_venv.py).

  run_pytest.py [--venv DIR] [--cluster] FILE...
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specd_cluster  # noqa: E402


def main(argv):
    if argv[:1] == ["--venv"]:
        python = os.path.join(argv[1], "bin", "python")
        os.execv(python, [python, os.path.abspath(__file__)] + argv[2:])
    files = [a for a in argv if a != "--cluster"]
    if "--cluster" in argv:
        missing = specd_cluster.missing_binaries()
        if missing:
            print("SKIPPED: specd executables not built: " + ", ".join(missing) +
                  " (build specd-router, specd-draft, specd-verify, specd-cli, "
                  "specd-http and specd_write_random_model)")
            return specd_cluster.SKIP
    return int(pytest.main(["-q", "-p", "no:cacheprovider"] + files))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
