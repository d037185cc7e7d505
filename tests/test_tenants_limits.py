"""A key's limits, answered as OpenAI answers them: 403 `model_not_allowed` naming the allowed
models; a `restricted` floor that no request can lower (the frontier upstream never sees it);
429 `rate_limit_exceeded` with Retry-After and the x-ratelimit headers, served again after the
window; 429 `insufficient_quota` once the day's budget is spent, served again the next day;
one tenant over its limits never holds up another. The clock is the test's."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest

from nowait.gateway.errors import APIError
from nowait.gateway.limits import TenantLimits
from nowait.gateway.spend_restore import spent_since, start_of_utc_day
from nowait.gateway.tenants import Caller
from nowait.router import DataClass
from tests.gateway_support import API_KEY, FakeUpstream, free_port
from tests.tenant_support import ManualClock, bearer, chat, create_key, tenant_config, tenant_server

HIGH_VALUE_PUBLIC = {"token_value_usd_per_mtok": 50.0, "data_class": "public"}  # the frontier API's work


@pytest.fixture(scope="module")
def setup(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("tenant-limits")
    config, _ = tenant_config(root, codec)
    upstream, clock = FakeUpstream(), ManualClock()
    with tenant_server(config, clock, upstream) as live:
        yield live, upstream, clock


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


# --- models ---

def test_a_key_limited_to_ar_may_not_ask_for_another_model(setup):
    server, _, _ = setup
    key = create_key(server, "teamModels", models=["ar"])["key"]
    assert chat(server, key, model="ar").status_code == 200
    listed = httpx.get(f"{server.base_url}/v1/models", headers=bearer(key), timeout=30).json()["data"]
    assert [m["id"] for m in listed] == ["ar"]  # the models it may use, no others
    hidden = httpx.get(f"{server.base_url}/v1/models/diffusion", headers=bearer(key), timeout=30)
    assert hidden.status_code == 404 and error_code(hidden) == "model_not_found"
    for model in ("diffusion", "nowait"):
        refused = chat(server, key, model=model)
        assert refused.status_code == 403 and error_code(refused) == "model_not_allowed"
        assert refused.json()["error"]["type"] == "permission_error"
        message = refused.json()["error"]["message"]
        assert f"`{model}`" in message and message.endswith("it may use: ar")
    completion = httpx.post(f"{server.base_url}/v1/completions", headers=bearer(key), timeout=60,
                            json={"model": "spec", "prompt": "Name:", "max_tokens": 2})
    assert completion.status_code == 403 and error_code(completion) == "model_not_allowed"
    # Every route that reaches the dispatcher is scoped, the Responses API and streams included.
    response = httpx.post(f"{server.base_url}/v1/responses", headers=bearer(key), timeout=60,
                          json={"model": "diffusion", "input": "Name: Ada", "max_output_tokens": 4})
    assert response.status_code == 403 and error_code(response) == "model_not_allowed"
    stream = httpx.post(f"{server.base_url}/v1/chat/completions", headers=bearer(key), timeout=60,
                        json={"model": "diffusion", "stream": True, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]})
    assert stream.status_code == 403 and error_code(stream) == "model_not_allowed"


# --- the data-class floor ---

def test_a_restricted_floor_never_reaches_the_remote_frontier_engine(setup):
    server, upstream, _ = setup
    open_key = create_key(server, "teamOpen")["key"]
    floor_key = create_key(server, "teamVault", data_class_floor="restricted")["key"]

    upstream.received.clear()
    control = chat(server, open_key, model="nowait", **HIGH_VALUE_PUBLIC)
    assert control.status_code == 200 and len(upstream.received) == 1  # this request does go out...

    upstream.received.clear()
    kept = chat(server, floor_key, model="nowait", **HIGH_VALUE_PUBLIC)
    assert kept.status_code == 200 and kept.headers["x-nowait-route"] == "ar"  # ...but not under the floor
    pinned = chat(server, floor_key, model="frontier-api", data_class="public")
    assert pinned.status_code == 403 and error_code(pinned) == "data_class_forbidden"
    header = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                        headers={**bearer(floor_key), "x-nowait-data-class": "public"},
                        json={"model": "nowait", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                              "nowait": {"token_value_usd_per_mtok": 50.0}})
    assert header.status_code == 200
    assert upstream.received == []


# --- requests per minute ---

def test_over_rpm_is_429_with_retry_after_until_the_window_passes_while_another_tenant_is_served(setup):
    server, _, clock = setup
    limited = create_key(server, "teamBusy", requests_per_minute=2)["key"]
    other = create_key(server, "teamQuiet", requests_per_minute=2)["key"]
    first = chat(server, limited)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert chat(server, limited).status_code == 200
    clock.advance(20)
    refused = chat(server, limited)
    assert refused.status_code == 429 and error_code(refused) == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.headers["Retry-After"] == "40"
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert chat(server, other).status_code == 200  # another tenant, throughout
    clock.advance(39)
    assert chat(server, limited).status_code == 429
    assert chat(server, other).status_code == 200
    clock.advance(2)  # the first two requests are now over a minute old
    assert chat(server, limited).status_code == 200
    # Listing files is no model request: it does not count.
    assert httpx.get(f"{server.base_url}/v1/files", headers=bearer(limited), timeout=30).status_code == 200


def test_tokens_per_minute_count_the_answered_requests_tokens(setup):
    server, _, clock = setup
    key = create_key(server, "teamTokens", tokens_per_minute=1)["key"]
    answered = chat(server, key)
    assert answered.status_code == 200  # the window was empty: admitted
    assert answered.headers["x-ratelimit-remaining-tokens"] == "1"  # as of its admission, as OpenAI's
    used = answered.json()["usage"]["total_tokens"]
    assert used > 1
    refused = chat(server, key)
    assert refused.status_code == 429 and error_code(refused) == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-limit-tokens"] == "1"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(refused.headers["Retry-After"]) == 60
    clock.advance(61)
    # A streamed answer counts too, once its last token is out.
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers=bearer(key), timeout=60,
                      json={"model": "ar", "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]}) as streamed:
        assert streamed.status_code == 200
        assert "[DONE]" in "".join(streamed.iter_text())
    assert chat(server, key).status_code == 429
    clock.advance(61)
    assert chat(server, key).status_code == 200


# --- the budget ---

def test_a_spent_budget_is_insufficient_quota_until_the_next_utc_day(setup):
    server, _, clock = setup
    budget_key = create_key(server, "teamFrugal", budget_usd_per_day=1e-9)["key"]
    other = create_key(server, "teamRich", budget_usd_per_day=1000.0)["key"]
    crossing = chat(server, budget_key)
    assert crossing.status_code == 200  # the request that crosses the line completes
    assert crossing.json()["nowait"]["cost_usd"] > 1e-9
    assert server.gateway.limits.spent_today("teamFrugal") == pytest.approx(crossing.json()["nowait"]["cost_usd"])
    refused = chat(server, budget_key)
    assert refused.status_code == 429 and error_code(refused) == "insufficient_quota"
    assert refused.json()["error"]["type"] == "insufficient_quota"
    assert chat(server, other).status_code == 200

    # A batch of the spent tenant completes, its lines answered insufficient_quota (not retried).
    client = server.client(api_key=budget_key)
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "ar", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.05)
    [error] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["response"]["status_code"] == 429
    assert error["response"]["body"]["error"]["code"] == "insufficient_quota"

    clock.advance(86_400)
    assert chat(server, budget_key).status_code == 200


def test_a_tenants_batch_waiting_out_its_rate_limit_never_holds_up_another_tenants_batch(setup):
    server, _, _ = setup
    slow = server.client(api_key=create_key(server, "teamSlowBatch", requests_per_minute=1)["key"])
    other = server.client(api_key=create_key(server, "teamNextBatch")["key"])

    def batch_of(client, n: int):
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "ar", "max_tokens": 2, "messages": [{"role": "user", "content": f"n {i}"}]}}
                 for i in range(n)]
        content = "".join(json.dumps(x) + "\n" for x in lines).encode()
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")

    held = batch_of(slow, 3)  # one line a minute, and the test's clock does not move
    deadline = time.monotonic() + 60
    while slow.batches.retrieve(held.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    later = batch_of(other, 2)  # created after: it runs beside the held one, not behind it
    while (done := other.batches.retrieve(later.id)).status != "completed":
        assert time.monotonic() < deadline, done.status
        time.sleep(0.05)
    assert done.request_counts.completed == 2
    still = slow.batches.retrieve(held.id)
    assert still.status == "in_progress" and still.request_counts.completed == 1


# --- the limiter itself ---

def test_the_request_window_slides_and_keys_are_counted_apart():
    clock = ManualClock(1_000_000.0)
    limits = TenantLimits(clock)
    a = Caller(tenant="a", key_id="key_a", requests_per_minute=3)
    b = Caller(tenant="b", key_id="key_b", requests_per_minute=1)
    for _ in range(3):
        limits.admit(a)
        clock.advance(10)
    limits.admit(b)
    with pytest.raises(APIError) as refused:
        limits.admit(a)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "30"
    clock.advance(30)  # the first request leaves the window
    limits.admit(a)
    with pytest.raises(APIError):
        limits.admit(a)
    with pytest.raises(APIError):
        limits.admit(b)
    limits.admit(Caller(tenant="c"))  # no limits: never refused, never counted


def test_budget_days_are_utc_days_and_tenants_are_charged_apart():
    clock = ManualClock(86_400 * 20_000 + 86_000.0)  # 400 s before midnight UTC
    limits = TenantLimits(clock)
    spender = Caller(tenant="spender", key_id="key_s", budget_usd_per_day=1.0)
    limits.charge(spender, 10, 0.6)
    limits.admit(spender)
    limits.charge(spender, 10, 0.6)  # crosses the line
    limits.charge(Caller(tenant="other"), 10, 5.0)
    with pytest.raises(APIError) as refused:
        limits.admit(spender)
    assert refused.value.code == "insufficient_quota"
    assert limits.spent_today("spender") == pytest.approx(1.2) and limits.spent_today("other") == 5.0
    limits.admit(Caller(tenant="other", budget_usd_per_day=6.0))
    clock.advance(400)  # midnight UTC
    assert limits.spent_today("spender") == 0.0
    limits.admit(spender)


def test_a_key_floor_holds_over_any_declared_class():
    floor = Caller(data_class_floor=DataClass.internal)
    assert floor.floored(DataClass.public) == DataClass.internal
    assert floor.floored(DataClass.restricted) == DataClass.restricted
    assert Caller().floored(DataClass.public) == DataClass.public


# --- the day's spend across a restart ---

def test_the_days_spend_is_read_back_from_the_audit_log(tmp_path):
    day = 86_400 * 20_000.0
    log = tmp_path / "audit.jsonl"
    entries = [{"time": day - 10, "tenant": "a", "status": 200, "cost_usd": 100.0},  # yesterday
               {"time": day + 5, "tenant": "a", "status": 200, "cost_usd": 0.25},
               {"time": day + 6, "tenant": "b", "status": 200, "cost_usd": 1.0},
               {"time": day + 7, "tenant": "a", "status": 429, "cost_usd": 9.0},  # not answered
               {"time": day + 8, "status": 200, "cost_usd": 0.5}]  # written before tenants
    log.write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"torn')
    assert spent_since(log, start_of_utc_day(day + 100)) == {"a": 0.25, "b": 1.0, "default": 0.5}
    assert spent_since(tmp_path / "none.jsonl", day) == {}


def test_a_restart_does_not_renew_a_spent_budget(tmp_path, codec):
    config, _ = tenant_config(tmp_path, codec)
    with tenant_server(config) as server:
        key = create_key(server, "teamSpent", budget_usd_per_day=1e-9)["key"]
        assert chat(server, key).status_code == 200  # crosses the line
        assert error_code(chat(server, key)) == "insufficient_quota"
    config["server"]["port"] = free_port()
    with tenant_server(config) as server:  # the same data directory: the same keys and audit log
        refused = chat(server, key)
        assert refused.status_code == 429 and error_code(refused) == "insufficient_quota"
        assert chat(server, API_KEY).status_code == 200  # the tenant default has no budget
