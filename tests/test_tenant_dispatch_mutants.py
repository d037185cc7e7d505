"""The dispatcher as tenants meet it (gateway/tenant_dispatch.py), on stand-in engines: a key's
model scope, the audit entry of a request refused before routing, and every answered request,
streamed or not, charged once to its caller. Written against mutmut's survivors (docs/testing.md)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from nowait.gateway.errors import APIError
from nowait.gateway.limits import TenantLimits
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.tenant_dispatch import ChargedStream, TenantDispatcher
from nowait.gateway.tenants import Caller
from tests.dispatch_support import FakeBackend, FakeStream, RecordingAudit, answer, make_call, policy, run, sample
from tests.tenant_support import ManualClock

CALLER = Caller(tenant="team-a", key_id="key-1", tokens_per_minute=1000)


def tenant_dispatcher(*backends: FakeBackend):
    metrics, audit, limits = GatewayMetrics(), RecordingAudit(), TenantLimits(ManualClock(86_400.0 * 20_000))
    dispatcher = TenantDispatcher({b.name: b for b in backends}, policy(), "nowait", metrics, audit,  # type: ignore[arg-type]
                                  timeout_s=5.0, limits=limits)
    return dispatcher, metrics, audit, limits


def scoped(model: str, allowed: frozenset[str] | None):
    call = make_call(model)
    call.caller = replace(CALLER, allowed_models=allowed)
    return call


def tokens_left(limits: TenantLimits, caller: Caller = CALLER) -> int:
    return int(limits.headers(caller)["x-ratelimit-remaining-tokens"])


def test_a_model_outside_the_keys_scope_is_refused_and_logged():
    ar = FakeBackend("ar", answer=answer("ar"))
    dispatcher, _, audit, _ = tenant_dispatcher(ar, FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.complete(scoped("diffusion", frozenset({"ar", "nowait"}))))
    assert (caught.value.status, caught.value.code) == (403, "model_not_allowed")
    assert caught.value.message == "This API key may not use the model `diffusion`; it may use: ar, nowait"
    assert audit.entries[0]["status"] == 403 and audit.entries[0]["rule"] == "none"
    assert run(dispatcher.complete(scoped("ar", frozenset({"ar"})))).final.engine == "ar"
    assert run(dispatcher.complete(scoped("ar", None))).final.engine == "ar"


def test_an_answer_is_charged_to_its_caller():
    ar = FakeBackend("ar", answer=answer("ar", prompt=30, completion=12, cost=0.25))
    dispatcher, _, _, limits = tenant_dispatcher(ar, FakeBackend("diffusion"))
    call = make_call("ar")
    call.caller = CALLER
    run(dispatcher.complete(call))
    assert limits.spent_today("team-a") == 0.25 and tokens_left(limits) == 1000 - 42


def test_a_held_stream_is_charged_when_it_is_answered():
    fast = FakeBackend("diffusion", answer=answer("diffusion", text="held", confidence=0.99, prompt=4,
                                                  completion=6, cost=0.5))
    dispatcher, _, _, limits = tenant_dispatcher(fast, FakeBackend("ar"))
    call = make_call()
    call.caller = CALLER
    plan = run(dispatcher.open_stream(call))
    assert not isinstance(plan, ChargedStream) and plan.replay == "held"
    assert limits.spent_today("team-a") == 0.5 and tokens_left(limits) == 990


async def collect(plan) -> list[str]:
    return [piece async for piece in plan.deltas()]


def test_a_relayed_stream_is_charged_once_its_last_delta_is_out():
    stream = FakeStream(["a", "b"], answer("ar", text="ab", prompt=3, completion=2, cost=0.125))
    ar = FakeBackend("ar", stream=stream)
    dispatcher, _, audit, limits = tenant_dispatcher(ar, FakeBackend("diffusion"))
    call = make_call("ar")
    call.caller = CALLER
    plan = run(dispatcher.open_stream(call))
    assert isinstance(plan, ChargedStream) and plan.route == "ar" and plan.replay is None  # the plan's own
    assert limits.spent_today("team-a") == 0.0
    assert run(collect(plan)) == ["a", "b"]
    assert limits.spent_today("team-a") == 0.125 and tokens_left(limits) == 995 and len(audit.entries) == 1
    run(plan.aclose())
    assert stream.closed


def test_a_relayed_stream_without_an_answer_is_not_charged():
    ar = FakeBackend("ar", stream=FakeStream(["a"], None))
    dispatcher, _, _, limits = tenant_dispatcher(ar, FakeBackend("diffusion"))
    call = make_call("ar")
    call.caller = replace(CALLER, budget_usd_per_day=1.0)
    plan = run(dispatcher.open_stream(call))
    assert run(collect(plan)) == ["a"]
    assert limits._spend == {} and tokens_left(limits) == 1000


@pytest.mark.parametrize(("endpoint", "named"), [("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
                                                 ("/v1/batches", "/v1/batches")])
def test_a_request_refused_before_routing_is_logged_for_its_tenant(endpoint, named):
    dispatcher, metrics, audit, _ = tenant_dispatcher(FakeBackend("ar"))
    error = APIError(429, "over the limit", code="rate_limit_exceeded")
    dispatcher.refused(CALLER, endpoint, error, request_id="req-9")
    assert error.accounted
    assert audit.entries == [{
        "request_id": "req-9", "endpoint": named, "model": None, "tenant": "team-a", "key_id": "key-1",
        "status": 429, "code": "rate_limit_exceeded", "error": "over the limit", "route": None, "decision": "",
        "rule": "none", "reason": "refused before routing: rate_limit_exceeded", "fallback": False,
        "fallback_cause": None, "engines_tried": [], "prompt_tokens": 0, "completion_tokens": 0, "seconds": 0.0,
        "cost_usd": 0.0}]
    assert sample(metrics, "nowait:request_errors_total", status="429", code="rate_limit_exceeded") == 1
    assert sample(metrics, "nowait:tenant_requests_total", tenant="team-a", code="429") == 1
    assert sample(metrics, "nowait:tenant_tokens_total", tenant="team-a", kind="prompt") == 0
    assert sample(metrics, "nowait:tenant_tokens_total", tenant="team-a", kind="completion") == 0
    assert sample(metrics, "nowait:tenant_cost_usd_total", tenant="team-a") == 0
    assert metrics.registry.get_sample_value("nowait:tenant_cost_usd_total", {"tenant": "team-a"}) is not None


def test_a_refusal_without_a_request_id_gets_one_of_its_own():
    dispatcher, _, audit, _ = tenant_dispatcher(FakeBackend("ar"))
    for _ in range(2):
        dispatcher.refused(CALLER, "/v1/chat/completions", APIError(429, "no", code="insufficient_quota"))
    ids = [e["request_id"] for e in audit.entries]
    assert all(re.fullmatch(r"refused-[0-9a-f]{24}", i) for i in ids) and ids[0] != ids[1]
