"""Unit tests of the metric-name checker (specd_metrics.py) against the real contract in
docs/metrics.md: it must pass the repository's dashboard and rules and catch each kind of
mistake a dashboard or rule can make."""

import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import specd_metrics  # noqa: E402

CONTRACT = specd_metrics.load_contract(os.path.join(ROOT, "docs", "metrics.md"))
INDEX = specd_metrics.series_index(CONTRACT)


def problems(expr, recorded=None):
    return specd_metrics.check_expression(expr, INDEX, recorded or {}, "t")


def test_contract_parsed():
    assert CONTRACT["specd_requests_total"].labels == {"outcome"}
    assert CONTRACT["specd_requests_total"].jobs == ("specd-router",)
    assert CONTRACT["specd_verify_latency_seconds"].kind == "histogram"
    assert CONTRACT["specd_kv_cache_usage_ratio"].jobs == ("specd-draft", "specd-verify")
    assert CONTRACT["specd_spec_decode_accepted_tokens_per_pos_total"].labels == {"position"}
    assert "specd_verify_latency_seconds_bucket" in INDEX
    assert "specd_verify_latency_seconds" not in INDEX


@pytest.mark.parametrize("expr", [
    'sum(rate(specd_spec_decode_accepted_tokens_total{job="specd-router"}[$__rate_interval]))',
    'histogram_quantile(0.99, sum by (le) (rate(specd_verify_latency_seconds_bucket[5m])))',
    'rate(specd_verify_latency_seconds_sum[5m]) / rate(specd_verify_latency_seconds_count[5m])',
    'sum by (position) (rate(specd_spec_decode_accepted_tokens_per_pos_total[1m]))'
    ' / ignoring (position) group_left sum(rate(specd_spec_decode_steps_total[1m]))',
    'max by (job) (specd_kv_cache_usage_ratio{job=~"specd-draft|specd-verify"})',
    'up{job="specd-draft"} == 0',
    'sum(rate(specd_requests_total{outcome!="ok", namespace=~"$namespace"}[5m])) offset 1h',
])
def test_valid_expressions(expr):
    assert problems(expr) == []


@pytest.mark.parametrize("expr,needle", [
    ("rate(specd_generation_token_total[5m])", "specd_generation_token_total is not exported"),
    ("histogram_quantile(0.9, rate(specd_verify_latency_seconds[5m]))", "through _bucket"),
    ("sum by (postion) (rate(specd_spec_decode_accepted_tokens_per_pos_total[1m]))",
     "grouping label 'postion'"),
    ('specd_kv_cache_usage_ratio{job="specd-router"}', "not exported by job 'specd-router'"),
    ('specd_requests_total{result="ok"}', "no label 'result'"),
    ('specd_requests_running{le="1"}', "no label 'le'"),
    ('up{job="specd-drft"}', "no such job"),
    ("specd_acceptance_rate_5m", "not exported"),
    ('{job="specd-router"}', "without a metric name"),
])
def test_invalid_expressions(expr, needle):
    found = problems(expr)
    assert any(needle in p for p in found), found


def test_recording_rules_are_names_only_where_defined():
    assert problems("specd_acceptance_rate_5m < 0.2",
                    {"specd_acceptance_rate_5m": {"job", "namespace"}}) == []


def test_exposition_checked_both_ways():
    router = [m for m in CONTRACT.values() if "specd-router" in m.jobs]
    lines = []
    for m in router:
        lines.append(f"# TYPE {m.name} {m.kind}")
        # Every specd_ sample carries the service's model label.
        label = ",".join([f'{l}="x"' for l in sorted(m.labels)] + ['model="m"'])
        if m.kind == "histogram":
            lines += [f'{m.name}_bucket{{le="+Inf",model="m"}} 1',
                      f'{m.name}_sum{{model="m"}} 0.5', f'{m.name}_count{{model="m"}} 1']
        else:
            lines.append(f"{m.name}{{{label}}} 1")
    text = "\n".join(lines) + "\n"
    assert specd_metrics.check_exposition(CONTRACT, "specd-router", text) == []
    # Missing, mistyped, extra-labelled and unlisted metrics are all reported.
    broken = (text.replace("# TYPE specd_queue_time_seconds histogram",
                           "# TYPE specd_queue_time_seconds summary")
              .replace('specd_requests_total{outcome="x",model="m"}',
                       'specd_requests_total{outcome="x",model="m",result="m"}')
              .replace('specd_requests_running{model="m"}', "specd_requests_running")
              .replace('# TYPE specd_draft_available gauge\nspecd_draft_available{model="m"} 1\n', "")
              + "# TYPE specd_surprise_total counter\nspecd_surprise_total 1\n")
    found = specd_metrics.check_exposition(CONTRACT, "specd-router", broken)
    for needle in ["specd_queue_time_seconds is a summary", "labels ['result']",
                   "specd_draft_available (gauge) missing", "exports specd_surprise_total",
                   "specd_requests_running lacks the service labels ['model']"]:
        assert any(needle in p for p in found), (needle, found)
    # The draft service must not export router metrics.
    found = specd_metrics.check_exposition(CONTRACT, "specd-draft", text)
    assert any("exports specd_requests_total" in p for p in found)


def test_repository_dashboard_and_rules_pass():
    r = subprocess.run([sys.executable, os.path.join(HERE, "check_metric_names.py")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_has_required_panels():
    with open(os.path.join(ROOT, "deploy", "grafana", "dashboards", "specd.json")) as f:
        dash = json.load(f)
    titles = {p["title"] for p in dash["panels"]}
    for t in ["Acceptance rate", "Mean accepted length", "Accepted tokens per position",
              "Draft latency", "Verify latency", "Time to first token", "Inter-token latency",
              "Tokens/s", "Running and waiting requests", "KV cache usage", "Draft available",
              "Requests by outcome"]:
        assert t in titles, t
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [e for _, e in specd_metrics.dashboard_expressions(dash)]
    for q in ("0.5", "0.99"):
        assert any(f"histogram_quantile({q}, sum by (le) (rate(specd_verify_latency_seconds_bucket"
                   in e for e in exprs), q


def test_dashboards_filter_every_specd_selector_by_model():
    # Both copies (deploy/ for plain Grafana, the chart's for its ConfigMap): a "model" variable
    # over the label every service sets, and every specd_ selector of every panel filtered by it.
    for path in (os.path.join(ROOT, "deploy", "grafana", "dashboards", "specd.json"),
                 os.path.join(ROOT, "helm", "specd", "dashboards", "specd.json")):
        with open(path) as f:
            dash = json.load(f)
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert "model" in variables, path
        assert variables["model"]["includeAll"] and variables["model"]["multi"], path
        exprs = [(w, e) for w, e in specd_metrics.dashboard_expressions(dash)
                 if w.startswith("panel ")]
        assert exprs, path
        for where, expr in exprs:
            selectors = re.findall(r"(specd_[A-Za-z0-9_:]*)(\{[^}]*\})?", expr)
            assert selectors, (path, where)
            for name, labels in selectors:
                assert 'model=~"$model"' in labels, (path, where, name)


def test_broken_dashboard_fails(tmp_path):
    with open(os.path.join(ROOT, "deploy", "grafana", "dashboards", "specd.json")) as f:
        dash = json.load(f)
    dash["panels"][1]["targets"][0]["expr"] = "sum(rate(specd_spec_decode_accepted_total[1m]))"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dash))
    r = subprocess.run([sys.executable, os.path.join(HERE, "check_metric_names.py"),
                        "--dashboards", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "specd_spec_decode_accepted_total is not exported" in r.stderr
