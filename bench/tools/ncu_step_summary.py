#!/usr/bin/env python3
"""Summarises `ncu --csv --metrics gpu__time_duration.sum` output of one profiled step.

The input is what `ncu --profile-from-start off --csv ... cuda_step_bench --profile 1` prints:
one row per kernel (graph nodes one by one). Kernels are grouped by a short family name, and per
device the table gives launches, total and median microseconds, and the share of the step's
kernel time; the caller compares the total with the step's wall time to see the gaps.

  python3 bench/tools/ncu_step_summary.py ncu.csv
"""
import csv
import re
import statistics
import sys
from collections import defaultdict


def family(name: str) -> str:
    n = re.sub(r"^void ", "", name)
    n = re.sub(r"\(anonymous namespace\)::|<unnamed>::", "", n)
    n = n.split("(")[0]
    if n.startswith(("nvjet", "sm90_", "sm80_", "cutlass")) or "gemm" in n.lower():
        return "gemm (cuBLASLt): " + n[:40]
    return n.split("::")[-1]


def main(path: str) -> None:
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print("no ncu CSV rows in", path)
        return
    rows = list(csv.DictReader(lines[start:]))
    # cuda_step_bench --profile brackets exactly one step, so every row belongs to it.
    per = defaultdict(list)
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        us = v / 1e3 if unit in ("ns", "nsecond") else v * 1e6 if unit in ("s", "second") else v
        per[(r.get("Device", "?"), family(r["Kernel Name"]))].append(us)
    devices = sorted({d for d, _ in per})
    for d in devices:
        total = sum(sum(v) for (dd, _), v in per.items() if dd == d)
        count = sum(len(v) for (dd, _), v in per.items() if dd == d)
        print(f"device {d}: {count} kernels, {total:.1f} us of kernel time")
        print("| kernel | launches | total us | median us | share |")
        print("|---|---:|---:|---:|---:|")
        items = sorted(((f, v) for (dd, f), v in per.items() if dd == d), key=lambda x: -sum(x[1]))
        for f, v in items:
            print(f"| {f[:60]} | {len(v)} | {sum(v):.1f} | {statistics.median(v):.2f} | "
                  f"{100 * sum(v) / total:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
