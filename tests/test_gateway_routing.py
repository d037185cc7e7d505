"""The routing rule through the gateway: each quadrant, request metadata from the body and the
headers, data-class enforcement against a recording fake upstream, and failover when it fails."""

from __future__ import annotations

import openai
import pytest

from nowait.gateway.ledger import read_audit_log
from tests.gateway_support import API_KEY, FakeUpstream, base_config, free_port, live_server, save_tiny_models

MESSAGES = [{"role": "user", "content": "Credit decision for file 17"}]


@pytest.fixture(scope="module")
def upstream():
    return FakeUpstream()


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec, upstream):
    root = tmp_path_factory.mktemp("gateway-routing")
    models = save_tiny_models(root / "models", codec)
    with live_server(base_config(models, root / "data", free_port()), upstream) as live:
        yield live


@pytest.fixture(autouse=True)
def healthy_upstream(upstream):
    upstream.fail_with = None
    yield


def ask(server, headers=None, nowait=None, stream=False, model="nowait"):
    client = server.client()
    extra_body = {"nowait": nowait} if nowait is not None else None
    if stream:
        return list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, stream=True,
                                                   extra_headers=headers, extra_body=extra_body))
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=6,
                                                           extra_headers=headers, extra_body=extra_body)
    return raw.headers["x-nowait-route"], raw.parse().model_extra["nowait"]


def test_batchable_goes_to_ar(server):
    route, info = ask(server, headers={"x-nowait-batchable": "true", "x-nowait-token-value": "50"})
    assert route == "ar" and info["rule"] == "batch" and "continuous batching" in info["reason"]


def test_latency_bound_low_value_goes_to_diffusion(server):
    route, info = ask(server, nowait={"latency_budget_ms": 300, "token_value_usd_per_mtok": 0.5})
    assert route == "diffusion" and info["rule"] == "fast" and "300 ms" in info["reason"]
    assert info["fallback"] is False  # this server's threshold is 0: never re-run


def test_high_value_internal_goes_to_the_remote_frontier(server, upstream):
    before = len(upstream.received)
    route, info = ask(server, nowait={"token_value_usd_per_mtok": 20, "data_class": "internal"})
    assert route == "frontier-api" and info["rule"] == "frontier"
    assert info["cost_usd"] == pytest.approx((11 * 2.0 + 3 * 10.0) / 1e6)  # the fake upstream's usage x prices
    sent = upstream.received[before]
    assert sent["body"]["model"] == "frontier-large" and sent["body"]["messages"] == MESSAGES
    assert "nowait" not in sent["body"]  # metadata stays in the gateway
    assert API_KEY not in sent["headers"].get("authorization", "")  # so does the client's key


def test_a_remote_upstreams_cached_prompt_tokens_reach_the_client(server, upstream):
    completion = server.client().chat.completions.create(
        model="frontier-api", messages=MESSAGES, max_tokens=6, extra_body={"nowait": {"data_class": "internal"}})
    assert completion.usage.prompt_tokens == 11
    assert completion.usage.prompt_tokens_details.cached_tokens == 8  # as the upstream reported


def test_high_value_restricted_stays_on_the_owned_frontier(server, upstream):
    before = len(upstream.received)
    route, info = ask(server, headers={"x-nowait-token-value": "20", "x-nowait-data-class": "restricted"})
    assert route == "ar" and "restricted data never leaves" in info["reason"]
    assert len(upstream.received) == before


def test_body_metadata_wins_over_headers(server):
    route, _ = ask(server, headers={"x-nowait-batchable": "false"}, nowait={"batchable": True})
    assert route == "ar"


def test_restricted_data_never_reaches_the_upstream(server, upstream):
    """Every way of asking, with every data class: the recording upstream sees no restricted request."""
    marker = "RESTRICTED-DOCUMENT"
    client = server.client()
    for model in ("nowait", "frontier-api"):
        for via in ("header", "body"):
            for value in (0.1, 50.0):
                for stream in (False, True):
                    headers = {"x-nowait-data-class": "restricted", "x-nowait-token-value": str(value)} \
                        if via == "header" else None
                    body = {"nowait": {"data_class": "restricted", "token_value_usd_per_mtok": value}} \
                        if via == "body" else None
                    kwargs = dict(model=model, max_tokens=4, stream=stream, extra_headers=headers, extra_body=body,
                                  messages=[{"role": "user", "content": marker}])
                    if model == "frontier-api":
                        with pytest.raises(openai.PermissionDeniedError) as error:
                            client.chat.completions.create(**kwargs)
                        assert error.value.body["code"] == "data_class_forbidden"
                    else:
                        result = client.chat.completions.create(**kwargs)
                        if stream:
                            list(result)
    # No data class stated: the default (internal in this config) may go to the API; public may too.
    assert all(marker not in str(r["body"]) for r in upstream.received)


def test_a_remote_without_the_class_is_refused_when_pinned(server, upstream):
    before = len(upstream.received)
    with pytest.raises(openai.PermissionDeniedError):
        server.client().chat.completions.create(model="frontier-api", messages=MESSAGES, max_tokens=4,
                                                extra_headers={"x-nowait-data-class": "restricted"})
    route, _ = ask(server, model="frontier-api", headers={"x-nowait-data-class": "public"})
    assert route == "frontier-api" and len(upstream.received) == before + 1


def test_streaming_from_the_remote_frontier(server):
    chunks = ask(server, stream=True, nowait={"token_value_usd_per_mtok": 20, "data_class": "public"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "from the frontier"
    assert chunks[-1].model_extra["nowait"]["route"] == "frontier-api"


def test_a_failing_upstream_fails_over_to_the_owned_frontier(server, upstream):
    upstream.fail_with = 503
    route, info = ask(server, nowait={"token_value_usd_per_mtok": 20, "data_class": "internal"})
    assert route == "ar" and info["fallback"] is True and "frontier-api" in info["reason"]
    assert [a["engine"] for a in info["engines_tried"]] == ["frontier-api", "ar"]
    chunks = ask(server, stream=True, nowait={"token_value_usd_per_mtok": 20, "data_class": "internal"})
    assert chunks[-1].model_extra["nowait"]["route"] == "ar"
    entries = read_audit_log(server.config.audit_log_path)
    assert entries[-1]["fallback_cause"] == "upstream_failure"


def test_a_pinned_upstream_failure_is_reported_not_hidden(server, upstream):
    upstream.fail_with = 500
    with pytest.raises(openai.APIStatusError) as error:
        ask(server, model="frontier-api", nowait={"data_class": "public"})
    assert error.value.status_code == 502 and error.value.body["code"] == "upstream_error"
