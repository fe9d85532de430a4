#!/usr/bin/env python3
"""Checks that every PromQL expression of the Grafana dashboard and of the Prometheus rules
names only series the specd services export (docs/metrics.md), with labels they set and from
the job that exports them, and that each expression is valid PromQL (promtool).

  tests/deploy/check_metric_names.py                 # the repository's files
  tests/deploy/check_metric_names.py --scrape specd-router=http://127.0.0.1:9400/metrics ...
      also compares the contract with the /metrics of running services.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specd_metrics  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def promtool_syntax_check(exprs):
    """Runs every expression through `promtool check rules` as a recording rule: the parser of
    the Prometheus we deploy is the judge of syntax."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return ["promtool not found: install Debian's prometheus package "
                "(scripts/install-deps.sh)"]
    rules = {"groups": [{"name": "syntax", "rules": [
        {"record": f"specd_syntax_check_{i}", "expr": specd_metrics.grafana_to_promql(e)}
        for i, (_, e) in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(rules, f)
    try:
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        return [f"promtool rejects a dashboard or rule expression:\n{r.stdout}{r.stderr}"]
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "metrics.md"))
    ap.add_argument("--dashboards", nargs="*",
                    default=sorted(glob.glob(os.path.join(ROOT, "deploy", "grafana",
                                                          "dashboards", "*.json"))))
    ap.add_argument("--rules", nargs="*",
                    default=sorted(glob.glob(os.path.join(ROOT, "deploy", "prometheus",
                                                          "rules", "*.yml"))))
    ap.add_argument("--scrape", action="append", default=[], metavar="JOB=URL",
                    help="compare the contract with the /metrics of a running service")
    args = ap.parse_args()

    contract = specd_metrics.load_contract(args.docs)
    index = specd_metrics.series_index(contract)
    if not args.dashboards or not args.rules:
        sys.exit("check_metric_names: no dashboard or no rule files found")

    rule_docs = []
    for path in args.rules:
        with open(path, encoding="utf-8") as f:
            rule_docs.append((os.path.relpath(path, ROOT), yaml.safe_load(f)))
    exprs, recorded = specd_metrics.rule_expressions(rule_docs)
    for path in args.dashboards:
        with open(path, encoding="utf-8") as f:
            dashboard = json.load(f)
        panel_exprs = specd_metrics.dashboard_expressions(dashboard)
        if not panel_exprs:
            sys.exit(f"check_metric_names: {path} has no PromQL expression")
        rel = os.path.relpath(path, ROOT)
        exprs += [(f"{rel}: {where}", e) for where, e in panel_exprs]

    problems = []
    used = set()
    for where, expr in exprs:
        # Dashboards read raw series (so they work without the rules); recording rule names are
        # allowed in rules only, where they are defined.
        allowed_recorded = recorded if "prometheus/rules" in where else {}
        problems += specd_metrics.check_expression(expr, index, allowed_recorded, where)
        try:
            used |= {s.name for s in specd_metrics.parse_promql(expr)[0]}
        except (ValueError, IndexError):
            pass  # reported by check_expression
    problems += promtool_syntax_check(exprs)

    for spec in args.scrape:
        job, _, url = spec.partition("=")
        if job not in specd_metrics.ALL_JOBS or not url:
            sys.exit(f"check_metric_names: --scrape wants JOB=URL with JOB one of "
                     f"{specd_metrics.ALL_JOBS}, got {spec!r}")
        problems += specd_metrics.check_exposition(contract, job, specd_metrics.scrape(url))

    if problems:
        print("check_metric_names: FAILED", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 1
    print(f"check_metric_names: {len(exprs)} expressions over {len(used)} series "
          f"({len(contract)} metrics in {os.path.relpath(args.docs, ROOT)}) all OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
