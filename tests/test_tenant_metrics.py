"""The per-tenant counters: nowait:tenant_requests_total{tenant,code}, tenant_tokens_total{tenant,kind}
and tenant_cost_usd_total{tenant}, equal to what the audit log says each tenant used."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nowait.gateway.audit import read_audit_log
from nowait.gateway.metrics import GatewayMetrics
from tests.audit_support import two_tenant_run
from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models


def samples(text: str, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of one counter in the Prometheus text format."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_tenant_counters_match_each_tenants_requests_tokens_and_cost(tmp_path):
    metrics = GatewayMetrics()
    costs = two_tenant_run(tmp_path / "audit.jsonl", metrics)
    text = metrics.render().decode()
    assert samples(text, "nowait:tenant_requests_total") == {
        (("code", "200"), ("tenant", "team-a")): 2.0, (("code", "200"), ("tenant", "team-b")): 2.0,
        (("code", "504"), ("tenant", "team-b")): 1.0}
    cost = samples(text, "nowait:tenant_cost_usd_total")
    tokens = samples(text, "nowait:tenant_tokens_total")
    entries = read_audit_log(tmp_path / "audit.jsonl")
    for tenant in ("team-a", "team-b"):
        assert cost[(("tenant", tenant),)] == pytest.approx(sum(costs[tenant]))
        runs = [run for entry in entries if entry["tenant"] == tenant for run in entry["engines_tried"]]
        for kind in ("prompt", "completion"):
            assert tokens[(("kind", kind), ("tenant", tenant))] == sum(run[f"{kind}_tokens"] for run in runs)
    # The fallback's second run counts: team-a's "x" ran on diffusion and again on ar.
    assert tokens[(("kind", "completion"), ("tenant", "team-a"))] == 3 * 3


def test_tenant_counters_appear_in_the_live_metrics(tmp_path, codec):
    """A live server (configured keys: the default tenant): three answers and an unknown model,
    counted by status, with the tokens and dollars of the responses."""
    models = save_tiny_models(tmp_path / "models", codec)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with live_server(base_config(models, tmp_path / "data", free_port())) as server:
        answers = []
        for text in ("Name: Ann Lee", "Amount: 12", "City: Oslo"):
            reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=60, json={
                "model": "ar", "max_tokens": 3, "messages": [{"role": "user", "content": text}]})
            assert reply.status_code == 200
            answers.append(reply.json())
        missing = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "gpt-imaginary", "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404
        text = httpx.get(f"{server.base_url}/metrics", timeout=60).text
    assert samples(text, "nowait:tenant_requests_total") == {(("code", "200"), ("tenant", "default")): 3.0,
                                                             (("code", "404"), ("tenant", "default")): 1.0}
    tokens = samples(text, "nowait:tenant_tokens_total")
    assert tokens[(("kind", "prompt"), ("tenant", "default"))] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert tokens[(("kind", "completion"), ("tenant", "default"))] == sum(
        a["usage"]["completion_tokens"] for a in answers)
    assert samples(text, "nowait:tenant_cost_usd_total")[(("tenant", "default"),)] == pytest.approx(
        sum(a["nowait"]["cost_usd"] for a in answers))
