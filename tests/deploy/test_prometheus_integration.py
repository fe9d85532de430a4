"""A real Prometheus (Debian's `prometheus` server) scrapes the three real specd services on
loopback every second; requests go through the router with specd-cli; the acceptance rate read
through Prometheus's HTTP API must equal the one computed from the CLI's --json stats. The
/metrics of each service is also compared with docs/metrics.md, and every dashboard and rule
expression is run by that Prometheus.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import specd_cluster  # noqa: E402
import specd_metrics  # noqa: E402

if shutil.which("prometheus") is None:
    pytest.exit("prometheus not found: install Debian's prometheus package "
                "(scripts/install-deps.sh)", returncode=1)

ROUTER = 'job="specd-router"'


class Prometheus:
    def __init__(self, workdir, targets):
        self.port = specd_cluster.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms",
                       "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                               for job, t in targets.items()],
        }
        path = os.path.join(workdir, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(workdir, "prometheus.log"), "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={path}",
             f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not become ready: " + self.tail())
            time.sleep(0.2)

    def tail(self):
        with open(self.log.name, "rb") as f:
            return f.read()[-3000:].decode("utf-8", "replace")

    def query(self, expr):
        """The result vector of an instant query; raises on a PromQL error."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, expr):
        result = self.query(expr)
        if len(result) != 1:
            return None
        return float(result[0]["value"][1])

    def wait_for(self, expr, want, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            got = self.scalar(expr)
            if got == want:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr} = {got}, want {want} after {timeout} s")
            time.sleep(0.5)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def stack():
    workdir = tempfile.mkdtemp(prefix="specd-prom-")
    cluster = specd_cluster.Cluster(os.path.join(workdir, "cluster"))
    os.makedirs(cluster.dir)
    prom = None
    try:
        cluster.start()
        prom = Prometheus(workdir, cluster.job_targets())
        # Every target scraped at least once before any request: the counters' first samples
        # are their zero starting values.
        prom.wait_for("sum(up)", 3.0)
        prom.wait_for(f"count(specd_spec_decode_draft_tokens_total{{{ROUTER}}} == 0)", 1.0)
        yield cluster, prom
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# Greedy requests (a copy of the target as draft: everything accepted), sampled ones (drafts
# partly rejected) and n-gram lookup, so the acceptance rate is neither 0 nor 1.
REQUESTS = [
    ["--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--speculation", "draft_model"],
    ["--prompt", "import os\nimport sys\n", "--max-new-tokens", "24", "--temperature", "1.0",
     "--seed", "11", "--speculation", "draft_model"],
    ["--prompt", "for i in range(10):", "--max-new-tokens", "24", "--temperature", "0.8",
     "--seed", "5", "--speculation", "draft_model"],
    ["--prompt", "abc abc abc abc abc", "--max-new-tokens", "24", "--speculation", "ngram"],
    ["--prompt", "class Tree:", "--max-new-tokens", "16", "--speculation", "off"],
]


def cli_stats(cluster):
    totals = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "completion_tokens": 0}
    for args in REQUESTS:
        out = cluster.cli("generate", *args, "--ignore-eos", "--json").stdout
        last = json.loads(out.strip().splitlines()[-1])
        spec = last["speculation"]
        for k in ("steps", "draft_tokens", "accepted_tokens"):
            totals[k] += int(spec[k])
        totals["completion_tokens"] += int(last["usage"]["completion_tokens"])
    return totals


@pytest.fixture(scope="module")
def stats(stack):
    return cli_stats(stack[0])


def test_acceptance_rate_through_prometheus_equals_cli_stats(stack, stats):
    cluster, prom = stack
    assert stats["draft_tokens"] > 0, stats
    want = stats["accepted_tokens"] / stats["draft_tokens"]
    assert 0 < want < 1, f"the request mix should accept some drafts and reject others: {stats}"

    # Wait until Prometheus has scraped the final counter values.
    prom.wait_for(f"sum(specd_spec_decode_draft_tokens_total{{{ROUTER}}})",
                  float(stats["draft_tokens"]))
    prom.wait_for(f"sum(specd_spec_decode_accepted_tokens_total{{{ROUTER}}})",
                  float(stats["accepted_tokens"]))
    prom.wait_for(f"sum(specd_spec_decode_steps_total{{{ROUTER}}})", float(stats["steps"]))
    prom.wait_for(f"sum(specd_generation_tokens_total{{{ROUTER}}})",
                  float(stats["completion_tokens"]))

    got = prom.scalar(f"sum(specd_spec_decode_accepted_tokens_total{{{ROUTER}}})"
                      f" / sum(specd_spec_decode_draft_tokens_total{{{ROUTER}}})")
    assert got == pytest.approx(want, rel=1e-12)

    # The recording rules' own expressions, evaluated by this Prometheus over the run: every
    # increment lies inside the 5m window and both counters share scrape timestamps, so the
    # rate ratio is the same ratio.
    with open(os.path.join(ROOT, "deploy", "prometheus", "rules", "recording.yml")) as f:
        rules = {r["record"]: r["expr"] for g in yaml.safe_load(f)["groups"]
                 for r in g["rules"] if "record" in r}
    assert prom.scalar(rules["specd_acceptance_rate_5m"]) == pytest.approx(want, rel=1e-9)
    assert prom.scalar(rules["specd_mean_accepted_length_5m"]) == pytest.approx(
        1 + stats["accepted_tokens"] / stats["steps"], rel=1e-9)


def test_services_export_exactly_the_documented_metrics(stack, stats):
    cluster, _ = stack
    contract = specd_metrics.load_contract(os.path.join(ROOT, "docs", "metrics.md"))
    problems = []
    for job in specd_cluster.SERVICES:
        problems += specd_metrics.check_exposition(contract, job, cluster.scrape(job))
    assert problems == []


def test_dashboard_and_rule_expressions_run_in_prometheus(stack, stats):
    cluster, prom = stack
    prom.wait_for(f"sum(specd_generation_tokens_total{{{ROUTER}}})",
                  float(stats["completion_tokens"]))
    time.sleep(2)  # a few more scrapes, so rate() over the run has two samples after it
    with open(os.path.join(ROOT, "deploy", "grafana", "dashboards", "specd.json")) as f:
        dashboard = json.load(f)
    exprs = specd_metrics.dashboard_expressions(dashboard)
    rule_docs = []
    for name in ("recording.yml", "alerts.yml"):
        with open(os.path.join(ROOT, "deploy", "prometheus", "rules", name)) as f:
            rule_docs.append((name, yaml.safe_load(f)))
    rule_exprs, _ = specd_metrics.rule_expressions(rule_docs)
    exprs += rule_exprs
    empty = []
    for where, expr in exprs:
        if any(rec in expr for rec in ("specd_acceptance_rate_5m", "specd_verify_latency_p99_5m",
                                       "specd_draft_latency_p99_5m")):
            continue  # alerts over recording rules: no rule evaluation in this Prometheus
        q = (expr.replace("$__rate_interval", "5m").replace("$namespace", ".*")
             .replace("$model", ".*"))
        if not prom.query(q):
            empty.append(where)
    # Panels over the router's requests and the services' steps have data after the requests
    # above; alert expressions (thresholds not crossed) and per-reason panels may be empty.
    for title in ("Acceptance rate", "Mean accepted length", "Accepted tokens per position",
                  "Verify latency", "Draft latency", "Time to first token", "Tokens/s",
                  "KV cache usage", "Requests by outcome"):
        assert not any(w.startswith(f"panel {title!r}") for w in empty), (title, empty)
