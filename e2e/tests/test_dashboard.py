"""The chart's Grafana dashboard as a file: valid JSON Grafana loads, every query naming its metrics
with the resource's selector, so the dashboard's variables filter every panel. That each metric exists
on the real /metrics is checked against real engines (e2e/dataplane/test_pipeline.py)."""

from __future__ import annotations

import re

from e2e import dashboard


def test_the_dashboard_is_one_grafana_dashboard_with_unique_panels_and_a_datasource_variable() -> None:
    board = dashboard.load()
    assert board["uid"] == "dllm-pd"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_query_names_its_metrics_filtered_by_the_resources_namespace_and_name() -> None:
    queries = dashboard.queries(dashboard.load())
    assert queries
    for expr in queries:
        assert dashboard.metric_names(expr), expr
        selectors = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})", expr)
        assert len(selectors) == len(re.findall(r"\{", expr)), expr
        for selector in selectors:
            assert 'namespace="$namespace"' in selector, expr
            assert 'app_kubernetes_io_instance=~"$dllm"' in selector, expr


def test_metric_names_are_read_from_selectors_and_matched_exactly() -> None:
    expr = 'sum(rate(vllm:dllm_kv_bytes_total{kind="kv"}[5m])) / sum(rate(x_seconds_sum{a="b"}[5m]))'
    assert dashboard.metric_names(expr) == {"vllm:dllm_kv_bytes_total", "x_seconds_sum"}
    text = 'vllm:dllm_kv_bytes_total{kind="kv"} 3.0\nplain 1.0\n'
    assert dashboard.on_metrics("vllm:dllm_kv_bytes_total", [text])
    assert dashboard.on_metrics("plain", ["", text])
    assert not dashboard.on_metrics("vllm:dllm_kv_bytes", [text])  # a prefix is not the series
