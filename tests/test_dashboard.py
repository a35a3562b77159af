"""The Grafana dashboard and the autoscaling queries name only metrics the services export.

The exported set comes from the real code, not from a list kept here: the four
metric sets (``LoopMetrics``, ``NamespaceMetrics``, ``FrontendMetrics``,
``ExecutorMetrics``) are instantiated on a fresh ``CollectorRegistry``, one child
of every labelled metric is created, and the registry's exposition text (what
``/metrics`` serves) is parsed back: sample names with their ``_total``,
``_bucket``, ``_sum``, ``_count`` and ``_created`` suffixes, and the labels of each.

Then, for every PromQL expression in k8s/extras/grafana-dashboard.json (panels
and template variables), the Prometheus adapter rules, and the KEDA ScaledObjects
(the mixed executor's, and the prefill and decode pools' in k8s/extras/disagg/):
every metric is exported, every label matcher and grouping label exists on the
metrics of that expression (or is a scrape label), counters and histogram series
are only read through rate/increase (counters restart when a loop's lease moves),
and every metric is documented in docs/metrics.md, whose table must also list
every exported metric with its type and labels. With promtool on PATH, every
expression must also parse.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ROOT / "k8s" / "extras"
DASHBOARD = EXTRAS / "grafana-dashboard.json"
ADAPTER = EXTRAS / "prometheus-adapter-rules.yaml"
KEDA = EXTRAS / "keda-scaledobject.yaml"
KEDA_DISAGG = EXTRAS / "disagg" / "keda-scaledobjects.yaml"  # the prefill and decode pools' ScaledObjects
METRICS_DOC = ROOT / "docs" / "metrics.md"

# Labels Prometheus attaches at scrape time (the kubernetes-pods relabeling adds
# namespace and pod), which every series may carry.
SCRAPE_LABELS = {"namespace", "pod", "instance", "job"}
# Series that only make sense through rate()/increase().
MONOTONIC_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
RATE_FUNCTIONS = {"rate", "irate", "increase"}
PROMQL_FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "avg",
    "avg_over_time",
    "bottomk",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "count",
    "count_over_time",
    "count_values",
    "day_of_month",
    "day_of_week",
    "delta",
    "deriv",
    "exp",
    "floor",
    "group",
    "histogram_quantile",
    "holt_winters",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "log10",
    "log2",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "predict_linear",
    "present_over_time",
    "quantile",
    "quantile_over_time",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev",
    "stddev_over_time",
    "stdvar",
    "sum",
    "sum_over_time",
    "time",
    "timestamp",
    "topk",
    "vector",
    "label_values",  # Grafana's template-variable query
}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
GROUPING = r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


# ---------------------------------------------------------------- what the services export
@dataclass(frozen=True)
class Series:
    family: str  # the name docs/metrics.md lists: counters with _total, histograms bare
    kind: str
    labels: frozenset[str]


def populated_registry() -> CollectorRegistry:
    from executor_svc.metrics import ExecutorMetrics
    from scheduler_svc.metrics import FrontendMetrics, LoopMetrics, NamespaceMetrics

    registry = CollectorRegistry()
    sets = [
        LoopMetrics(registry),
        NamespaceMetrics(registry),
        FrontendMetrics(registry),
        ExecutorMetrics(registry, "tiny"),
    ]
    for metric_set in sets:
        for metric in vars(metric_set).values():
            # A labelled metric shows no sample until one child exists.
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:
                metric.labels(*["x"] * len(metric._labelnames))
    return registry


def exposition() -> str:
    return generate_latest(populated_registry()).decode()


def exported() -> dict[str, Series]:
    """Sample name -> its family, type and labels, as /metrics shows them."""
    out: dict[str, Series] = {}
    parsed = list(text_string_to_metric_families(exposition()))
    kinds = {fam.name: fam.type for fam in parsed}
    for fam in parsed:
        kind, doc_name = fam.type, fam.name
        # The text format carries a counter's or histogram's _created samples as a gauge family of their own.
        base = fam.name.removesuffix("_created")
        if base != fam.name and kinds.get(base) in ("counter", "histogram"):
            kind, doc_name = kinds[base], base
        if kind == "counter":
            doc_name += "_total"
        for s in fam.samples:
            labels = set(s.labels) | (out[s.name].labels if s.name in out else set())
            out[s.name] = Series(doc_name, kind, frozenset(labels))
    return out


EXPORTED = exported()


def families() -> dict[str, Series]:
    """Family name (as docs/metrics.md lists it) -> its type and labels (without le)."""
    fams: dict[str, Series] = {}
    for s in EXPORTED.values():
        labels = s.labels - {"le"}
        if s.family in fams:
            labels |= fams[s.family].labels
        fams[s.family] = Series(s.family, s.kind, frozenset(labels))
    return fams


# ---------------------------------------------------------------- PromQL
def strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)


@dataclass
class Parsed:
    metrics: set[str]
    functions: set[str]
    matcher_labels: set[str]
    grouping_labels: set[str]
    unrated: set[str]  # monotonic series read without rate/increase


def parse(expr: str) -> Parsed:
    s = strip_strings(expr)
    s = re.sub(r"\$\{?\w+\}?", "x", s)  # Grafana variables ($__rate_interval, ${datasource})
    s = re.sub(r"<<\.\w+>>", "", s)  # prometheus-adapter templates
    s = re.sub(r"label_values\(([^,]*),\s*\w+\s*\)", r"label_values(\1)", s)
    grouping = {label.strip() for _, labels in re.findall(GROUPING, s) for label in labels.split(",") if label.strip()}
    s = re.sub(GROUPING, " ", s)
    matchers = set()
    for body in re.findall(r"\{([^}]*)\}", s):
        matchers |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body))
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges and subqueries
    out = Parsed(set(), set(), matchers, grouping, set())
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call:
            out.functions.add(word)
        elif word.lower() not in KEYWORDS:
            out.metrics.add(word)
            before = re.search(r"(\w+)\s*\(\s*$", s[: m.start()])
            if word.endswith(MONOTONIC_SUFFIXES) and not (before and before.group(1) in RATE_FUNCTIONS):
                out.unrated.add(word)
    return out


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    found = []
    for p in panels(dash):
        for t in p.get("targets", []):
            found.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for var in dash.get("templating", {}).get("list", []):
        if var["type"] == "query":
            q = var["query"]
            found.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    return found


def adapter_exprs() -> list[tuple[str, str]]:
    cm = yaml.safe_load(ADAPTER.read_text())
    rules = yaml.safe_load(cm["data"]["config.yaml"])["externalRules"]
    found = []
    for r in rules:
        found.append((f"adapter {r['name']['as']} seriesQuery", r["seriesQuery"]))
        found.append((f"adapter {r['name']['as']} metricsQuery", r["metricsQuery"]))
    return found


def keda_exprs() -> list[tuple[str, str]]:
    found = []
    for path in (KEDA, KEDA_DISAGG):
        for so in (d for d in yaml.safe_load_all(path.read_text()) if d):
            name = so["metadata"]["name"]
            found += [
                (f"keda {name} trigger {t.get('name', i)}", t["metadata"]["query"])
                for i, t in enumerate(so["spec"]["triggers"])
            ]
    return found


def series_query_metrics(expr: str) -> set[str]:
    """The adapter's seriesQuery may name its metric as {__name__="..."}."""
    return set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))


def all_exprs() -> list[tuple[str, str]]:
    return dashboard_exprs(dashboard()) + adapter_exprs() + keda_exprs()


def check_expr(where: str, expr: str) -> list[str]:
    """What is wrong with one expression (empty: nothing)."""
    problems = []
    p = parse(expr)
    metrics = p.metrics | series_query_metrics(expr)
    if not metrics:
        problems.append(f"{where}: names no metric: {expr}")
    for name in sorted(metrics - set(EXPORTED)):
        problems.append(f"{where}: {name} is not exported by pagedserve")
    for fn in sorted(p.functions - PROMQL_FUNCTIONS):
        problems.append(f"{where}: unknown function {fn}()")
    known_labels = set(SCRAPE_LABELS) | {"__name__"}
    for name in metrics & set(EXPORTED):
        known_labels |= EXPORTED[name].labels
    for label in sorted((p.matcher_labels | p.grouping_labels) - known_labels):
        problems.append(f"{where}: label {label!r} is on none of {sorted(metrics)}")
    for name in sorted(p.unrated & set(EXPORTED)):
        if EXPORTED[name].kind in ("counter", "histogram"):
            problems.append(f"{where}: {name} is cumulative: read it through rate() or increase()")
    return problems


# What Prometheus sends (content negotiation): 3.x by default, 2.x (2.33 and later).
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


# ---------------------------------------------------------------- tests
def test_the_exported_set_comes_from_the_code():
    fams = families()
    assert len(fams) >= 20, sorted(fams)
    assert {
        "pagedserve:kv_cache_usage_perc",
        "pagedserve:num_requests_waiting",
        "pagedserve:num_preemptions_total",
        "pagedserve:time_to_first_token_seconds",
        "pagedserve:executor_forward_seconds",
    } <= set(fams)
    assert {
        "pagedserve:num_preemptions_total",
        "pagedserve:time_to_first_token_seconds_bucket",
        "pagedserve:time_to_first_token_seconds_sum",
        "pagedserve:time_to_first_token_seconds_count",
    } <= set(EXPORTED)
    assert "pagedserve:num_preemptions" not in EXPORTED
    assert EXPORTED["pagedserve:kv_cache_usage_perc"].labels == {"model_name", "executor"}
    assert "le" in EXPORTED["pagedserve:time_to_first_token_seconds_bucket"].labels


def test_the_checker_catches_mistakes():
    """The checks below must be able to fail."""
    assert check_expr("ok", 'sum by (executor) (rate(pagedserve:generation_tokens_total{model_name="m"}[5m]))') == []
    assert check_expr("typo", "max(pagedserve:kv_cache_usage_prec)")
    assert check_expr("vllm", "sum(vllm:num_requests_running)")
    assert check_expr("unsuffixed counter", "rate(pagedserve:num_preemptions[5m])")
    assert check_expr("label", 'max(pagedserve:num_requests_waiting{executor="x"})')
    assert check_expr("grouping", "max by (mode) (pagedserve:kv_cache_usage_perc)")
    assert check_expr("counter without rate", "sum(pagedserve:generation_tokens_total)")
    assert check_expr("function", "sum(rates(pagedserve:generation_tokens_total[5m]))")
    assert check_expr("no metric", "vector(1)")
    assert check_expr("series query", '{__name__="pagedserve:num_request_waiting",namespace!=""}')


def test_dashboard_is_a_grafana_dashboard():
    dash = dashboard()
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels(dash):
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            # Every panel follows the dashboard's filters.
            for var in ("namespace", "model_name"):
                assert f'=~"${var}"' in t["expr"], f"panel {p['title']!r} ignores ${var}"


def test_dashboard_queries_name_only_exported_metrics():
    problems = [msg for where, expr in dashboard_exprs(dashboard()) for msg in check_expr(where, expr)]
    assert not problems, "\n".join(problems)


def test_autoscaling_queries_name_only_exported_metrics():
    found = adapter_exprs() + keda_exprs()
    assert len(found) >= 14, found  # 5 adapter rules (series and metrics queries), 2 + 4 KEDA triggers
    problems = [msg for where, expr in found for msg in check_expr(where, expr)]
    assert not problems, "\n".join(problems)


def test_dashboard_covers_every_exported_metric():
    used = {
        EXPORTED[m].family for _, expr in dashboard_exprs(dashboard()) for m in parse(expr).metrics if m in EXPORTED
    }
    missing = sorted(set(families()) - used)
    assert not missing, f"no panel shows {missing}"
    # Latency histograms appear as quantiles over their buckets, by le.
    exprs = [expr for _, expr in dashboard_exprs(dashboard())]
    for fam, series in families().items():
        if series.kind != "histogram":
            continue
        pattern = rf"histogram_quantile\(\s*0?\.\d+\s*,\s*sum by \(le[^)]*\)\s*\(rate\({re.escape(fam)}_bucket\b"
        assert any(re.search(pattern, e) for e in exprs), f"no quantile panel for {fam}"
    # Per-executor views of the KV cache, and the breakdowns the labels exist for.
    for metric, label in (
        ("pagedserve:kv_cache_usage_perc", "executor"),
        ("pagedserve:num_preemptions_total", "mode"),
        ("pagedserve:num_executors", "state"),
        ("pagedserve:request_success_total", "finished_reason"),
    ):
        assert any(metric in e and re.search(rf"by \([^)]*\b{label}\b", e) for e in exprs), (metric, label)


def doc_table() -> dict[str, str]:
    """docs/metrics.md's metric table: name as exposed -> its row."""
    rows = {}
    for line in METRICS_DOC.read_text().splitlines():
        m = re.match(r"\|\s*`(pagedserve:[\w:]+)`\s*\|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_every_exported_metric_is_documented_with_type_and_labels():
    rows = doc_table()
    for fam, series in families().items():
        assert fam in rows, f"docs/metrics.md has no table row for {fam}"
        cells = [c.strip() for c in rows[fam].split("|")]
        assert series.kind in cells, f"{fam}: type {series.kind} not in its row"
        for label in series.labels:
            assert f"`{label}`" in rows[fam], f"{fam}: label {label} not in its row"
    stale = sorted(set(rows) - set(families()))
    assert not stale, f"docs/metrics.md documents metrics nothing exports: {stale}"


def test_every_metric_in_the_dashboard_and_autoscaling_is_documented():
    rows = doc_table()
    for where, expr in all_exprs():
        for m in parse(expr).metrics | series_query_metrics(expr):
            assert m in EXPORTED and EXPORTED[m].family in rows, f"{where}: {m} is not documented in docs/metrics.md"


def test_every_expression_parses(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed")
    rules = []
    for i, (where, expr) in enumerate(all_exprs()):
        if expr.startswith("label_values("):
            expr = expr[len("label_values(") :].rsplit(",", 1)[0]
        expr = expr.replace("<<.LabelMatchers>>", 'namespace="x"')
        expr = re.sub(r"\$__\w+", "5m", expr)
        expr = re.sub(r"\$\{?\w+\}?", "x", expr)
        rules.append({"record": f"check:expr_{i}", "expr": expr, "labels": {"where": where[:100]}})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "pagedserve", "rules": rules}]}))
    res = subprocess.run(
        [promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    "accept",
    [
        "",
        PROMETHEUS_3_ACCEPT,
        PROMETHEUS_2_ACCEPT,
    ],
    ids=["curl", "prometheus-3", "prometheus-2"],
)
def test_the_endpoint_serves_the_documented_names(accept):
    """What a scraper negotiating like Prometheus gets from the services' endpoint."""
    import urllib.request

    from pagedserve import metrics
    from pagedserve.dev.procs import free_port

    port = free_port()
    metrics.serve(port, populated_registry(), "127.0.0.1")
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        text = resp.read().decode()
    names = {re.match(r"[^{\s]+", line).group(0) for line in text.splitlines() if line and not line.startswith("#")}
    assert names, text
    assert names <= set(EXPORTED), sorted(names - set(EXPORTED))[:5]
