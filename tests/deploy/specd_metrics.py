"""The metrics contract (docs/metrics.md) and the checks made against it.

Used by check_metric_names.py (dashboard and rules against the contract) and by the
integration tests (the contract against the real /metrics of running services).
"""

import re
import urllib.request

# Which Prometheus job exports the metrics of each docs/metrics.md section. The scrape config
# (deploy/prometheus/prometheus.yml) and the chart's ServiceMonitor use these job names.
SECTION_JOBS = {
    "router": ("specd-router",),
    "draft": ("specd-draft", "specd-verify"),
    "http": ("specd-http",),
}
ALL_JOBS = ("specd-router", "specd-draft", "specd-verify", "specd-http")

# Labels that Prometheus (job, instance) or Kubernetes service discovery through the
# prometheus-operator (namespace, pod, service, endpoint, container) add to every series.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}

# Labels every service puts on all of its specd_ samples (docs/metrics.md): the served model.
SERVICE_LABELS = {"model"}

# Series every Prometheus has whatever it scrapes.
BUILTIN_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                  "scrape_series_added", "scrape_samples_post_metric_relabeling",
                  "ALERTS", "ALERTS_FOR_STATE"}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class Metric:
    def __init__(self, name, kind, labels, jobs):
        self.name = name
        self.kind = kind        # counter | gauge | histogram
        self.labels = labels    # label names the service sets (le not included)
        self.jobs = jobs        # jobs that export it

    def __repr__(self):
        return f"Metric({self.name}, {self.kind}, {sorted(self.labels)}, {self.jobs})"


def load_contract(path):
    """Parses the tables of docs/metrics.md into {name: Metric}."""
    metrics = {}
    jobs = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            heading = re.match(r"^#+\s+(.*)", line)
            if heading:
                title = heading.group(1).lower()
                jobs = None
                for section, section_jobs in SECTION_JOBS.items():
                    if f"({'`'}specd-{section}`)" in title.replace(" ", ""):
                        jobs = section_jobs
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 4 or not cells[0].startswith("specd_"):
                continue
            if jobs is None:
                raise ValueError(f"{path}: metric {cells[0]} outside a service section")
            name, kind, label_cell = cells[0], cells[1], cells[2]
            if kind not in ("counter", "gauge", "histogram"):
                raise ValueError(f"{path}: {name} has unknown type {kind!r}")
            labels = set(re.findall(r"([a-z_][a-z0-9_]*)\s*=", label_cell))
            if name in metrics:
                raise ValueError(f"{path}: {name} listed twice")
            metrics[name] = Metric(name, kind, labels, jobs)
    if not metrics:
        raise ValueError(f"{path}: no metrics found")
    return metrics


def series_index(contract):
    """{series name: Metric}: histograms expand to _bucket, _sum and _count only."""
    index = {}
    for m in contract.values():
        if m.kind == "histogram":
            for suffix in HISTOGRAM_SUFFIXES:
                index[m.name + suffix] = m
        else:
            index[m.name] = m
    return index


# ---------------------------------------------------------------------------------------------
# PromQL: a lexer good enough to find every series selector and grouping label of an expression.

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                "bottomk", "topk", "quantile"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_count", "histogram_sum", "histogram_fraction", "histogram_quantile",
    "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln",
    "log2", "log10", "minute", "month", "predict_linear", "rate", "resets", "round",
    "scalar", "sgn", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time",
    "present_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin",
    "sinh", "tan", "tanh", "deg", "rad", "pi",
}
GROUPING_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OTHER_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end"}

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>0x[0-9a-fA-F]+|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?
               (?:ms|s|m|h|d|w|y)?(?:[0-9]+(?:ms|s|m|h|d|w|y))*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]@])
""", re.VERBOSE)


class Selector:
    def __init__(self, name, matchers):
        self.name = name
        self.matchers = matchers  # [(label, op, value)]

    def __repr__(self):
        return f"Selector({self.name}, {self.matchers})"


def tokenize(expr):
    pos, out = 0, []
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot parse PromQL at {expr[pos:pos + 30]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup, m.group()))
    return out


def _unquote(s):
    return s[1:-1].encode().decode("unicode_escape") if s[0] in "\"'" else s[1:-1]


def parse_promql(expr):
    """Returns (selectors, grouping labels) of one PromQL expression."""
    toks = tokenize(expr)
    selectors, grouping = [], set()
    i, depth_brackets = 0, 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else (None, None)
        if text == "[":
            depth_brackets += 1
        elif text == "]":
            depth_brackets -= 1
        elif depth_brackets:
            pass  # durations, subquery steps, Grafana interval variables
        elif kind == "ident" and text in GROUPING_KEYWORDS:
            if nxt[1] == "(":
                j = i + 2
                while toks[j][1] != ")":
                    if toks[j][0] == "ident":
                        grouping.add(toks[j][1])
                    elif toks[j][1] != ",":
                        raise ValueError(f"bad label list after {text} in {expr!r}")
                    j += 1
                i = j
        elif kind == "ident" and (text in AGGREGATIONS or text in FUNCTIONS) and nxt[1] == "(":
            pass
        elif kind == "ident" and (text in AGGREGATIONS or text.lower() in OTHER_KEYWORDS):
            pass
        elif kind == "ident" or text == "{":
            name = text if kind == "ident" else None
            matchers = []
            j = i + 1 if kind == "ident" else i
            if j < len(toks) and toks[j][1] == "{":
                j += 1
                while toks[j][1] != "}":
                    label, op, value = toks[j], toks[j + 1], toks[j + 2]
                    if label[0] != "ident" or op[1] not in ("=", "!=", "=~", "!~") or \
                            value[0] != "string":
                        raise ValueError(f"bad label matcher in {expr!r}")
                    matchers.append((label[1], op[1], _unquote(value[1])))
                    j += 3
                    if toks[j][1] == ",":
                        j += 1
                i = j
            if name is None:
                names = [v for (l, o, v) in matchers if l == "__name__" and o == "="]
                if not names:
                    raise ValueError(f"selector without a metric name in {expr!r}")
                name = names[0]
            selectors.append(Selector(name, matchers))
        i += 1
    return selectors, grouping


def literal_alternatives(value):
    """The literal values a regex matcher such as "specd-draft|specd-verify" accepts, or None
    when it is not a plain alternation of literals (then nothing can be concluded)."""
    parts = value.split("|")
    if all(re.fullmatch(r"[A-Za-z0-9_\-]+", p) for p in parts):
        return parts
    return None


def check_expression(expr, index, recorded, where):
    """Problems of one PromQL expression, as a list of strings."""
    problems = []
    try:
        selectors, grouping = parse_promql(expr)
    except (ValueError, IndexError) as e:
        return [f"{where}: {e}"]
    if not selectors:
        problems.append(f"{where}: no metric in {expr!r}")
    known_labels = set(TARGET_LABELS) | SERVICE_LABELS
    for sel in selectors:
        if sel.name in recorded:
            known_labels |= recorded[sel.name]
            continue
        if sel.name in BUILTIN_SERIES:
            if sel.name == "up":
                for label, op, value in sel.matchers:
                    if label == "job" and op in ("=", "=~"):
                        for job in literal_alternatives(value) or []:
                            if job not in ALL_JOBS:
                                problems.append(f"{where}: up{{job={value!r}}}: no such job")
            continue
        metric = index.get(sel.name)
        if metric is None:
            hint = ""
            for base in (sel.name, re.sub(r"_(bucket|sum|count)$", "", sel.name)):
                if base in index or any(k.startswith(base + "_") for k in index):
                    hint = " (a histogram is read through _bucket, _sum or _count)"
            problems.append(f"{where}: {sel.name} is not exported by any specd service{hint}")
            continue
        allowed = metric.labels | TARGET_LABELS | SERVICE_LABELS
        if sel.name.endswith("_bucket") and metric.kind == "histogram":
            allowed = allowed | {"le"}
        known_labels |= allowed
        for label, op, value in sel.matchers:
            if label not in allowed:
                problems.append(f"{where}: {sel.name} has no label {label!r}")
            if label == "job" and op in ("=", "=~"):
                jobs = [value] if op == "=" else literal_alternatives(value)
                for job in jobs or []:
                    if job not in metric.jobs:
                        problems.append(f"{where}: {sel.name} is not exported by job {job!r} "
                                        f"(only {', '.join(metric.jobs)})")
    for label in sorted(grouping - known_labels):
        problems.append(f"{where}: grouping label {label!r} is on none of the series used")
    return problems


# ---------------------------------------------------------------------------------------------
# Sources of expressions.

def dashboard_expressions(dashboard):
    """[(where, expr)] of every target of every panel (rows' nested panels too) and every
    templating query of a Grafana dashboard."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)\s*", q or "")
            if m:
                out.append((f"variable {var['name']!r}",
                            f"group by ({m.group(2)}) ({m.group(1)})"))
            elif q:
                out.append((f"variable {var['name']!r}", q))
    return out


def rule_expressions(rule_docs):
    """([(where, expr)], {recorded name: labels it keeps}) of Prometheus rule files."""
    out, recorded = [], {}
    for path, doc in rule_docs:
        for group in doc.get("groups", []):
            for rule in group.get("rules", []):
                name = rule.get("record") or rule.get("alert")
                out.append((f"{path}: {name}", rule["expr"]))
                if "record" in rule:
                    _, grouping = parse_promql(rule["expr"])
                    recorded[rule["record"]] = grouping | TARGET_LABELS | SERVICE_LABELS
    return out, recorded


def grafana_to_promql(expr):
    """Replaces Grafana's variables with values Prometheus accepts, for a syntax check."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}",
                  "1m", expr)
    return re.sub(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*", ".*", expr)


# ---------------------------------------------------------------------------------------------
# The real exposition of a running service.

def parse_exposition(text):
    """{family: (type, {label names seen})} of Prometheus text format (version 0.0.4)."""
    families, sample_names = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            families.setdefault(name, [kind.strip(), set()])
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s", line)
            if not m:
                raise ValueError(f"bad sample line {line!r}")
            labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(3) or ""))
            sample_names.setdefault(m.group(1), set()).update(labels)
    for name, labels in sample_names.items():
        family = name
        if name not in families:
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix) and name[: -len(suffix)] in families:
                    family = name[: -len(suffix)]
        if family not in families:
            raise ValueError(f"sample {name} has no # TYPE line")
        families[family][1].update(labels - {"le"})
    return {k: (v[0], v[1]) for k, v in families.items()}


def scrape(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def check_exposition(contract, job, text):
    """Problems of one service's /metrics output against the contract, both ways: every metric
    the contract gives this job is there with its type and labels, and the service exports no
    specd_ metric the contract does not name."""
    problems = []
    families = parse_exposition(text)
    expected = {n: m for n, m in contract.items() if job in m.jobs}
    for name, metric in sorted(expected.items()):
        if name not in families:
            problems.append(f"{job}: {name} ({metric.kind}) missing from /metrics")
            continue
        kind, labels = families[name]
        if kind != metric.kind:
            problems.append(f"{job}: {name} is a {kind}, the contract says {metric.kind}")
        extra = labels - metric.labels - SERVICE_LABELS
        if name.startswith("specd_") and not SERVICE_LABELS <= labels:
            problems.append(f"{job}: {name} lacks the service labels {sorted(SERVICE_LABELS)}")
        if extra:
            problems.append(f"{job}: {name} has labels {sorted(extra)} not in the contract")
    for name in sorted(families):
        if name.startswith("specd_") and name not in expected:
            problems.append(f"{job}: exports {name}, which docs/metrics.md does not list "
                            f"for this service")
    return problems
