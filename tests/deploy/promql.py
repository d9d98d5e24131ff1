"""PromQL as it appears in deploy/ (alerts, prometheus-adapter rules, the Grafana dashboard), and
the series the server really exports, for checking one against the other."""

from __future__ import annotations

import functools
import json
import re

import yaml

from .inventory import K8S, find, rendered

# Labels Prometheus attaches to every target scraped through a ServiceMonitor.
TARGET_LABELS = {"namespace", "pod", "service", "endpoint", "container", "job", "instance"}
METRIC = re.compile(r"\bdietserve_[A-Za-z0-9_]+\b")
SELECTOR = re.compile(r"\b(dietserve_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Stand-ins for what prometheus-adapter and Grafana substitute before Prometheus sees a query.
ADAPTER_TEMPLATE = {"<<.LabelMatchers>>": 'namespace="dietserve",pod=~"dietserve-server-.*"', "<<.GroupBy>>": "pod"}
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": "dietserve", "$pod": ".*"}


@functools.cache
def exported_series() -> dict[str, frozenset[str]]:
    """Every series name the server's /metrics can carry -> its label names. Built from a real
    ServerMetrics registry: counters gain _total, histograms _bucket (with le), _sum and _count."""
    from prometheus_client.metrics import MetricWrapperBase

    from dietserve.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    families = {family.name: family.type for family in metrics.registry.collect()}
    series: dict[str, frozenset[str]] = {}
    for wrapper in vars(metrics).values():
        if not isinstance(wrapper, MetricWrapperBase):
            continue
        # prometheus_client keeps label names only here until a labelled child exists.
        name, labels = wrapper._name, frozenset(wrapper._labelnames)
        kind = families[name]
        if kind == "counter":
            series[f"{name}_total"] = labels
        elif kind == "gauge":
            series[name] = labels
        elif kind == "histogram":
            series[f"{name}_bucket"] = labels | {"le"}
            series[f"{name}_sum"] = labels
            series[f"{name}_count"] = labels
        else:
            raise AssertionError(f"{name}: metric type {kind} not modelled")
    return series


def label_names(expression: str) -> set[str]:
    """Label names in selectors and in by/without clauses (templates left out)."""
    names = {m.group(1) for _, body in SELECTOR.findall(expression) for m in MATCHER.finditer(body)}
    for group in GROUPING.findall(expression):
        names |= {label.strip() for label in group.split(",") if label.strip() and "<<" not in label}
    return names


def label_values(expression: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) for every literal matcher."""
    return [(metric, m.group(1), m.group(2), m.group(3))
            for metric, body in SELECTOR.findall(expression) for m in MATCHER.finditer(body)]


def substitute(expression: str, replacements: dict[str, str]) -> str:
    for placeholder, value in replacements.items():
        expression = expression.replace(placeholder, value)
    return expression


# --- where PromQL lives in deploy/ ------------------------------------------------------------------

def alert_rules() -> list[dict]:
    rule = find(rendered("base"), "PrometheusRule", "dietserve-server")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def adapter_rules() -> list[dict]:
    config_map = find(rendered("monitoring"), "ConfigMap", "dietserve-prometheus-adapter-rules")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def dashboard() -> dict:
    return json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())


def dashboard_targets() -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def every_expression() -> list[tuple[str, str]]:
    """(where, PromQL as Prometheus receives it) for every query in deploy/."""
    found = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    for rule in adapter_rules():
        series = METRIC.search(rule["seriesQuery"]).group(0)
        name = rule["name"]["as"]
        found.append((f"adapter {name} seriesQuery", rule["seriesQuery"]))
        found.append((f"adapter {name} metricsQuery",
                      substitute(rule["metricsQuery"], {"<<.Series>>": series, **ADAPTER_TEMPLATE})))
    found += [(f"dashboard {title} {target['refId']}", substitute(target["expr"], GRAFANA_VARIABLES))
              for title, target in dashboard_targets()]
    return found


def dashboard_variable_queries() -> list[tuple[str, str]]:
    """Grafana's label_values(...) queries: not PromQL, but they name series and labels."""
    return [(f"dashboard variable {v['name']}", v["definition"]) for v in dashboard()["templating"]["list"]
            if v["type"] == "query"]
