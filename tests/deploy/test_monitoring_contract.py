"""Alerts, autoscaling rules and the dashboard query what the server exports: every series name,
label and label value in their PromQL is one dietserve/server/metrics.py produces."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from .inventory import find, inference_service, rendered
from .promql import (
    METRIC,
    TARGET_LABELS,
    adapter_rules,
    alert_rules,
    dashboard,
    dashboard_targets,
    dashboard_variable_queries,
    every_expression,
    exported_series,
    label_names,
    label_values,
)

EXPRESSIONS = every_expression()
NAMED_QUERIES = EXPRESSIONS + dashboard_variable_queries()
IDS = [where for where, _ in NAMED_QUERIES]


def test_every_place_that_holds_promql_is_searched() -> None:
    places = {where.split()[0] for where, _ in NAMED_QUERIES}
    assert places == {"alert", "adapter", "dashboard"}
    assert len(EXPRESSIONS) >= 20


@pytest.mark.parametrize(("where", "expression"), NAMED_QUERIES, ids=IDS)
def test_every_metric_in_promql_is_one_the_server_exports(where: str, expression: str) -> None:
    names = set(METRIC.findall(expression))
    assert names, f"{where} queries no dietserve metric"
    unknown = names - set(exported_series())
    assert not unknown, f"{where}: {sorted(unknown)} are not exported (have: {sorted(exported_series())})"


@pytest.mark.parametrize(("where", "expression"), NAMED_QUERIES, ids=IDS)
def test_every_label_in_promql_is_one_the_series_carry(where: str, expression: str) -> None:
    carried = set(TARGET_LABELS)
    for name in METRIC.findall(expression):
        carried |= exported_series().get(name, frozenset())
    unknown = label_names(expression) - carried
    assert not unknown, f"{where}: labels {sorted(unknown)} are on none of its series"


@pytest.mark.parametrize(("where", "expression"), NAMED_QUERIES, ids=IDS)
def test_label_values_are_ones_the_server_writes(where: str, expression: str) -> None:
    _, methods = inference_service()
    codes = {code.name for code in grpc.StatusCode}
    for metric, label, operator, value in label_values(expression):
        if operator in {"=", "!="} and label == "code":
            assert value in codes, f"{where}: {metric}{{code{operator}{value!r}}}: not a gRPC status name"
        if operator in {"=", "!="} and label == "method":
            assert value in methods, f"{where}: {metric}{{method{operator}{value!r}}}: not an RPC of the service"


@pytest.mark.parametrize(("where", "expression"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_promql_brackets_and_quotes_balance(where: str, expression: str) -> None:
    pairs, stack, quoted = {")": "(", "]": "[", "}": "{"}, [], False
    for character in expression:
        if character == '"':
            quoted = not quoted
        elif not quoted and character in "([{":
            stack.append(character)
        elif not quoted and character in pairs:
            assert stack and stack.pop() == pairs[character], f"{where}: unbalanced {character!r}"
    assert not stack and not quoted, f"{where}: unclosed {stack or 'quote'}"


def _promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


@pytest.mark.skipif(_promtool() is None, reason="promtool not found (PATH or $PROMTOOL; Debian package `prometheus` "
                                                "or Prometheus' release tarball): PromQL syntax is checked only "
                                                "for balance")
def test_promql_parses_with_promtool(tmp_path: Path) -> None:
    # Alerts as they are, every other query as a recording rule: `promtool check rules` parses them all.
    rules = [{k: v for k, v in rule.items()} for rule in alert_rules()]
    rules += [{"record": f"dietserve:check:{i}", "expr": expression}
              for i, (where, expression) in enumerate(EXPRESSIONS) if not where.startswith("alert")]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "deploy", "rules": rules}]}))
    result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_latency_errors_queue_and_readiness() -> None:
    alerts = {rule["alert"]: rule for rule in alert_rules()}
    assert set(alerts) == {"DietserveLatencyP99OverSLO", "DietserveErrorRatioHigh", "DietserveHttpServerErrorsHigh",
                           "DietserveQueueGrowing", "DietserveQueueNearlyFull", "DietserveNotReady"}
    latency = alerts["DietserveLatencyP99OverSLO"]["expr"]
    assert "histogram_quantile(0.99" in latency and "dietserve_request_duration_seconds_bucket" in latency
    errors = alerts["DietserveErrorRatioHigh"]["expr"]
    assert 'code!="OK"' in errors and errors.count("dietserve_requests_total") == 2
    http_errors = alerts["DietserveHttpServerErrorsHigh"]["expr"]
    assert 'code=~"5.."' in http_errors and http_errors.count("dietserve_http_requests_total") == 2
    assert "dietserve_queued_rows" in alerts["DietserveQueueGrowing"]["expr"]
    assert alerts["DietserveNotReady"]["expr"].strip() == "dietserve_ready == 0"
    for rule in alerts.values():
        assert rule["for"] and rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_queue_alert_threshold_is_below_the_servers_queue_bound() -> None:
    from dietserve.server.config import ServerConfig

    expression = {rule["alert"]: rule for rule in alert_rules()}["DietserveQueueNearlyFull"]["expr"]
    threshold = float(expression.rsplit(">", 1)[1])
    assert threshold < ServerConfig(artifact=None).max_queue_rows


def test_hpa_metrics_are_served_by_the_adapter_rules() -> None:
    hpa = find(rendered("base"), "HorizontalPodAutoscaler", "dietserve-server")
    wanted = {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"] if metric["type"] == "Pods"}
    served = {rule["name"]["as"]: rule for rule in adapter_rules()}
    assert wanted == set(served), f"HPA asks for {sorted(wanted)}, the adapter serves {sorted(served)}"
    for rule in served.values():
        # Pods metrics must map the scrape's namespace and pod labels onto Kubernetes objects.
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.GroupBy>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_adapter_rules_yaml_is_lint_clean() -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    from .inventory import DEPLOY

    config_map = find(rendered("monitoring"), "ConfigMap", "dietserve-prometheus-adapter-rules")
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    problems = list(linter.run(config_map["data"]["config.yaml"], config))
    assert not problems, [str(p) for p in problems]


def test_dashboard_shows_latency_throughput_errors_batching_lengths_and_kernel_variants() -> None:
    expressions = [target["expr"] for _, target in dashboard_targets()]

    def some(*parts: str) -> bool:
        return any(all(part in expression for part in parts) for expression in expressions)

    for quantile in ("0.5", "0.95", "0.99"):
        assert some(f"histogram_quantile({quantile}", "dietserve_request_duration_seconds_bucket"), quantile
    assert some("rate(dietserve_requests_total", 'method="ModelInfer"'), "throughput"
    assert some("dietserve_requests_total", 'code!="OK"', "by (method, code)"), "errors"
    assert some("rate(dietserve_http_requests_total"), "HTTP throughput"
    assert some("dietserve_http_requests_total", 'code=~"[45].."', "by (route, code)"), "HTTP errors"
    assert some("dietserve_batch_size_"), "batch size"
    assert some("dietserve_request_sequence_length_bucket"), "sequence-length mix"
    assert some("dietserve_kernel_dispatch_total", "by (operator, variant)"), "kernel variants"


def test_dashboard_is_well_formed_for_grafana() -> None:
    board = dashboard()
    panels = board["panels"]
    assert board["uid"] and board["title"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        columns, rows = range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        area = {(x, y) for x in columns for y in rows}
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "namespace", "pod"}
    for title, target in dashboard_targets():
        assert target["datasource"]["uid"] == "${datasource}", title
        assert '$namespace"' in target["expr"] and '$pod"' in target["expr"], f"{title}: not filtered by the variables"
