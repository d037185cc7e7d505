"""Confidence fallback: a diffusion answer below the threshold is re-run on AR, both runs paid for.

A random tiny diffusion model is never sure of anything (its minimum token probability is far
below 0.99), so with this server's threshold of 0.99 every diffusion answer falls back."""

from __future__ import annotations

import httpx
import pytest

from nowait.gateway.ledger import read_audit_log
from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models

MESSAGES = [{"role": "user", "content": "Name: Ann Lee\nBorn: 1985"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("gateway-fallback")
    models = save_tiny_models(root / "models", codec)
    config = base_config(models, root / "data", free_port(), routing={"confidence_threshold": 0.99})
    with live_server(config) as live:
        yield live


def test_low_confidence_diffusion_reruns_on_ar_and_both_costs_count(server):
    raw = server.client().chat.completions.with_raw_response.create(
        model="nowait", messages=MESSAGES, max_tokens=12, extra_body={"nowait": {"latency_budget_ms": 500}})
    completion = raw.parse()
    info = completion.model_extra["nowait"]
    assert raw.headers["x-nowait-route"] == "ar" and info["route"] == "ar"
    assert info["fallback"] is True and "below 0.99" in info["reason"]
    tried = info["engines_tried"]
    assert [a["engine"] for a in tried] == ["diffusion", "ar"]
    assert tried[0]["confidence"] < 0.99 and all(a["cost_usd"] > 0 for a in tried)
    assert info["cost_usd"] == pytest.approx(sum(a["cost_usd"] for a in tried))
    entry = next(e for e in read_audit_log(server.config.audit_log_path) if e["request_id"] == completion.id)
    assert entry["fallback_cause"] == "confidence" and len(entry["engines_tried"]) == 2


def test_a_pinned_diffusion_request_keeps_its_fallback(server):
    completion = server.client().chat.completions.create(model="diffusion", messages=MESSAGES, max_tokens=12)
    assert completion.model_extra["nowait"]["route"] == "ar"


def test_a_streamed_fallback_sends_only_the_final_answer(server):
    chunks = list(server.client().chat.completions.create(model="nowait", messages=MESSAGES, max_tokens=12,
                                                          stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = chunks[-1].model_extra["nowait"]
    assert final["route"] == "ar" and final["fallback"] is True
    direct = server.client().chat.completions.create(model="ar", messages=MESSAGES, max_tokens=12)
    assert text == direct.choices[0].message.content  # AR's answer, not diffusion's followed by AR's


def test_fallback_rate_and_cost_with_fallback_are_metrics(server):
    server.client().chat.completions.create(model="nowait", messages=MESSAGES, max_tokens=6)
    text = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    rate = [line for line in text.splitlines() if line.startswith('nowait:fallback_rate{engine="diffusion"}')]
    assert rate and float(rate[0].split()[-1]) == 1.0
    assert 'nowait:fallbacks_total{cause="confidence",engine="diffusion",to="ar"}' in text
    assert 'nowait:effective_cost_with_fallback_usd_per_mtok{engine="diffusion"}' in text
