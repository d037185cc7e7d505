"""The live page and the Grafana dashboard, against a live server with traffic: the page is
self-contained, a real browser (headless chromium) shows the same counts as /metrics, and every
query of examples/grafana/nowait.json names a metric the running gateway exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest

from nowait.gateway.dashboard import histogram_quantile
from tests.gateway_support import base_config, free_port, live_server, save_tiny_models

GRAFANA = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "nowait.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("gateway-dashboard")
    models = save_tiny_models(root / "models", codec)
    # A random diffusion model is never this sure: routed requests fall back to AR.
    config = base_config(models, root / "data", free_port(), routing={"confidence_threshold": 0.99})
    with live_server(config) as live:
        drive_traffic(live)
        yield live


def drive_traffic(server) -> None:
    client = server.client()
    for name in ("Ann", "Bo", "Cy"):
        client.chat.completions.create(model="ar", max_tokens=4,
                                       messages=[{"role": "user", "content": f"Name: {name}"}])
    client.completions.create(model="spec", prompt="Name:", max_tokens=4)
    client.responses.create(model="diffusion", input="Name: Di", max_output_tokens=8)
    for _ in range(2):  # routed to the fast engine, re-run on AR
        client.chat.completions.create(model="nowait", max_tokens=8, messages=[{"role": "user", "content": "Name: E"}],
                                       extra_body={"nowait": {"latency_budget_ms": 50, "batchable": False}})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


def scrape(server) -> dict[str, dict[tuple, float]]:
    """The samples of /metrics: name -> sorted label pairs -> value."""
    out: dict[str, dict[tuple, float]] = {}
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        pairs = tuple(sorted(re.findall(r'([a-zA-Z_]+)="([^"]*)"', labels)))
        out.setdefault(name, {})[pairs] = float(value)
    return out


def exported_names(server) -> set[str]:
    """Every metric name /metrics exposes: its samples, and each declared family (a histogram's
    with its _bucket, _sum and _count series)."""
    text = httpx.get(f"{server.base_url}/metrics").text
    names = set(scrape(server))
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (strings, label matchers, ranges, grouping
    clauses, function names and keywords taken out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word = match.group(0)
        if word in PROMQL_WORDS or expr[match.end():].lstrip().startswith("("):
            continue
        if match.start() > 0 and (expr[match.start() - 1].isdigit() or expr[match.start() - 1] in ".$"):
            continue  # part of a number (1e3) or a Grafana variable
        names.add(word)
    return names


def grafana_queries() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            text = query["query"] if isinstance(query, dict) else query
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", text))
    return exprs


def test_every_grafana_query_names_an_exported_metric(server):
    exported = exported_names(server)
    queries = grafana_queries()
    assert len(queries) >= 20
    panels_read = set()
    for expr in queries:
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{expr!r} reads {sorted(missing)}, which /metrics does not export"
        panels_read |= names
    # The panels the dashboard promises: requests and latency per route and engine, fallback,
    # utilization, $/Mtok, queue depth, errors by code.
    for needed in ("nowait:gateway_request_latency_seconds_bucket", "nowait:e2e_request_latency_seconds_bucket",
                   "nowait:request_success_total", "nowait:fallback_rate", "nowait:engine_utilization",
                   "nowait:effective_cost_usd_per_mtok", "nowait:num_requests_waiting",
                   "nowait:request_errors_total", "nowait:tenant_requests_total"):
        assert needed in panels_read


def test_promql_name_parser_sees_through_the_syntax():
    expr = ('histogram_quantile(0.99, sum by (route, le) (rate(nowait:x_bucket{engine=~"$engine"}[$__rate_interval])))'
            ' / on (engine) nowait:y * 1e3')
    assert promql_metric_names(expr) == {"nowait:x_bucket", "nowait:y"}


def test_histogram_quantile_interpolates_inside_a_bucket():
    # 10 observations: 4 up to 1 s, 6 more up to 2 s. The median (rank 5) lies 1/6 of the way into (1, 2].
    assert histogram_quantile(0.5, [(1.0, 4), (2.0, 10), (float("inf"), 10)]) == pytest.approx(1 + 1 / 6)
    assert histogram_quantile(0.99, [(1.0, 0), (float("inf"), 3)]) == 1.0  # past the last bound: that bound
    assert histogram_quantile(0.5, [(1.0, 0), (float("inf"), 0)]) is None


def test_dashboard_data_is_the_metrics(server):
    data = httpx.get(f"{server.base_url}/dashboard/data").json()
    found = scrape(server)
    routes = {dict(k)["route"]: v for k, v in found["nowait:gateway_request_latency_seconds_count"].items()}
    assert {r: v["requests"] for r, v in data["routes"].items()} == routes
    assert routes["ar"] >= 5  # 3 chats and 2 fallbacks
    runs: dict[str, float] = {}
    for labels, value in found["nowait:request_success_total"].items():
        runs[dict(labels)["engine"]] = runs.get(dict(labels)["engine"], 0) + value
    assert {e: v["runs"] for e, v in data["engines"].items() if v["runs"]} == runs
    errors = {(dict(k)["status"], dict(k)["code"]): v for k, v in found["nowait:request_errors_total"].items()}
    assert {(e["status"], e["code"]): e["count"] for e in data["errors"]} == errors
    assert errors[("404", "model_not_found")] == 1 and errors[("401", "invalid_api_key")] == 1
    assert data["engines"]["diffusion"]["fallback_rate"] == 1.0  # both routed answers re-ran on AR
    requests = {(dict(k)["tenant"], dict(k)["code"]): v for k, v in found["nowait:tenant_requests_total"].items()}
    assert {t: v["requests"] for t, v in data["tenants"].items()} == {"default": sum(requests.values())}
    assert data["tenants"]["default"]["answered"] == requests[("default", "200")]
    cost = {dict(k)["tenant"]: v for k, v in found["nowait:tenant_cost_usd_total"].items()}
    assert data["tenants"]["default"]["cost_usd"] == cost["default"] > 0


def test_dashboard_page_is_self_contained(server):
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    # Nothing loaded from elsewhere; the icon is an empty data URL, so a browser asks for no favicon.
    assert not re.search(r"<(?:script|img|iframe)[^>]*\ssrc=", html)
    assert re.findall(r"<link\b[^>]*>", html) == ['<link rel="icon" href="data:,">']


class Cells(HTMLParser):
    """The dumped page's rows: (row kind, row key) -> field -> text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str], dict[str, str]] = {}
        self.ids: dict[str, str] = {}
        self._row: tuple[str, str] | None = None
        self._field: str | None = None
        self._id: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr":
            for kind in ("route", "engine", "error", "tenant"):
                if f"data-{kind}" in a:
                    self._row = (kind, a[f"data-{kind}"])
                    self.rows[self._row] = {}
        if tag == "td" and self._row is not None:
            self._field = a.get("data-field")
        if "id" in a:
            self._id = a["id"]

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        if tag == "td":
            self._field = None

    def handle_data(self, data):
        if self._row is not None and self._field is not None:
            self.rows[self._row][self._field] = self.rows[self._row].get(self._field, "") + data
        if self._id is not None:
            self.ids[self._id] = self.ids.get(self._id, "") + data
            self._id = None


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (.ci/run installs it)")
def test_browser_shows_the_metrics_counts(server, tmp_path):
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path}",
         "--virtual-time-budget=5000", "--dump-dom", f"{server.base_url}/dashboard?refresh=1"],
        capture_output=True, text=True, timeout=120).stdout
    cells = Cells()
    cells.feed(dom)
    found = scrape(server)
    routes = {dict(k)["route"]: v for k, v in found["nowait:gateway_request_latency_seconds_count"].items()}
    shown = {key: float(fields["requests"]) for (kind, key), fields in cells.rows.items() if kind == "route"}
    assert shown == routes
    runs: dict[str, float] = {}
    for labels, value in found["nowait:request_success_total"].items():
        runs[dict(labels)["engine"]] = runs.get(dict(labels)["engine"], 0) + value
    shown_runs = {key: float(f["runs"]) for (kind, key), f in cells.rows.items()
                  if kind == "engine" and f["runs"] != "0"}
    assert shown_runs == runs
    errors = {f"{dict(k)['status']} {dict(k)['code']}": v for k, v in found["nowait:request_errors_total"].items()}
    assert {key: float(f["count"]) for (kind, key), f in cells.rows.items() if kind == "error"} == errors
    assert float(cells.ids["total-requests"]) == sum(routes.values())
    tenants = {}
    for labels, value in found["nowait:tenant_requests_total"].items():
        tenants[dict(labels)["tenant"]] = tenants.get(dict(labels)["tenant"], 0) + value
    assert {key: float(f["requests"]) for (kind, key), f in cells.rows.items() if kind == "tenant"} == tenants
