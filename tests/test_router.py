"""The routing rule: one test per quadrant, and data-class enforcement."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nowait.router import (
    DataClass,
    DataClassViolation,
    RemoteEngine,
    RouteRequest,
    RoutingPolicy,
    check_destination,
    failover,
    pin,
    restrict_to_available,
    route,
    should_fall_back,
)

FRONTIER_API = RemoteEngine(name="frontier-api", data_classes=(DataClass.public, DataClass.internal))
POLICY = RoutingPolicy(high_value_usd_per_mtok=5.0, confidence_threshold=0.9, owned_frontier_engine="spec",
                       remote_frontier_engines=(FRONTIER_API,))


def request(batchable=False, budget_ms=800.0, value=0.5, data_class=DataClass.internal) -> RouteRequest:
    return RouteRequest(batchable=batchable, latency_budget_ms=budget_ms, token_value_usd_per_mtok=value,
                        data_class=data_class)


def test_batchable_goes_to_ar_whatever_its_value():
    for value in (0.1, 50.0):
        decision = route(request(batchable=True, value=value, budget_ms=None), POLICY)
        assert (decision.engine, decision.rule, decision.fallback_engine) == ("ar", "batch", None)
        assert "continuous batching" in decision.reason


def test_latency_bound_low_value_goes_to_diffusion_with_ar_fallback():
    decision = route(request(value=0.5, budget_ms=800), POLICY)
    assert (decision.engine, decision.fallback_engine, decision.rule) == ("diffusion", "ar", "fast")
    assert "800 ms" in decision.reason and "0.9" in decision.reason


def test_high_value_goes_to_the_remote_frontier_when_the_data_may_leave():
    decision = route(request(value=20.0, data_class=DataClass.internal), POLICY)
    assert (decision.engine, decision.rule) == ("frontier-api", "frontier")


def test_high_value_restricted_stays_on_the_owned_frontier():
    decision = route(request(value=20.0, data_class=DataClass.restricted), POLICY)
    assert decision.engine == "spec"
    assert "restricted data never leaves" in decision.reason


def test_high_value_without_an_allowed_remote_uses_the_owned_frontier():
    public_only = POLICY.model_copy(update={"remote_frontier_engines": (RemoteEngine(name="api"),)})
    decision = route(request(value=20.0, data_class=DataClass.internal), public_only)
    assert decision.engine == "spec"
    assert "no remote frontier engine may receive internal data" in decision.reason


def test_threshold_is_inclusive_and_long_budgets_can_opt_into_batching():
    assert route(request(value=5.0), POLICY).rule == "frontier"
    assert route(request(value=4.99), POLICY).rule == "fast"
    patient = POLICY.model_copy(update={"batchable_budget_ms": 60_000})
    assert route(request(budget_ms=120_000), patient).engine == "ar"
    assert route(request(budget_ms=120_000), POLICY).engine == "diffusion"  # off by default: only the flag


def test_confidence_fallback():
    assert should_fall_back(0.5, POLICY) and not should_fall_back(0.9, POLICY)
    assert should_fall_back(float("nan"), POLICY)  # a half-precision overflow is not a sure answer


def test_a_remote_engine_cannot_be_configured_to_receive_restricted_data():
    with pytest.raises(ValidationError, match="restricted data never leaves"):
        RemoteEngine(name="api", data_classes=(DataClass.public, DataClass.restricted))


def test_check_destination_refuses_what_the_data_class_forbids():
    check_destination("frontier-api", DataClass.internal, POLICY)
    check_destination("diffusion", DataClass.restricted, POLICY)
    for data_class in (DataClass.restricted,):
        with pytest.raises(DataClassViolation):
            check_destination("frontier-api", data_class, POLICY)
    with pytest.raises(DataClassViolation, match="unknown engine"):
        check_destination("elsewhere", DataClass.public, POLICY)


def test_no_restricted_request_is_ever_routed_to_a_remote_engine():
    remote_names = {r.name for r in POLICY.remote_frontier_engines}
    for batchable in (False, True):
        for value in (0.0, 1.0, 5.0, 100.0):
            for budget in (None, 100.0, 10_000.0):
                decision = route(request(batchable, budget, value, DataClass.restricted), POLICY)
                assert decision.engine not in remote_names


def test_policy_rejects_engines_it_does_not_own():
    with pytest.raises(ValidationError, match="fast_engine"):
        RoutingPolicy(fast_engine="mercury")


# The reason is the sentence the audit log keeps for every request: an auditor reads it to see why
# a document went where it went, so its wording is part of the contract, not decoration.
@pytest.mark.parametrize(("routed", "engine", "rule", "fallback", "reason"), [
    (request(batchable=True, value=0.1, budget_ms=None), "ar", "batch", None,
     "marked batchable: AR with continuous batching is already efficient there, whatever the token value "
     "($0.1/Mtok)"),
    (request(value=0.5, budget_ms=800), "diffusion", "fast", "ar",
     "latency-bound (a 800 ms budget) and low value ($0.5/Mtok): diffusion clears a request in a few parallel "
     "passes; answers below confidence 0.9 re-run on ar"),
    (request(value=0.5, budget_ms=None), "diffusion", "fast", "ar",
     "latency-bound (no stated budget) and low value ($0.5/Mtok): diffusion clears a request in a few parallel "
     "passes; answers below confidence 0.9 re-run on ar"),
    (request(value=20.0), "frontier-api", "frontier", None,
     "high value ($20/Mtok >= $5/Mtok) and internal data may go to frontier-api: the frontier model"),
    (request(value=20.0, data_class=DataClass.restricted), "spec", "frontier", None,
     "high value ($20/Mtok >= $5/Mtok) and restricted data never leaves the building: the owned frontier engine"),
])
def test_each_branch_states_its_reason_for_the_audit_log(routed, engine, rule, fallback, reason):
    decision = route(routed, POLICY)
    assert (decision.engine, decision.rule, decision.fallback_engine, decision.reason) == (
        engine, rule, fallback, reason)


def test_a_long_budget_states_it_can_wait_and_the_boundary_is_inclusive():
    patient = POLICY.model_copy(update={"batchable_budget_ms": 60_000})
    decision = route(request(budget_ms=60_000), patient)
    assert (decision.engine, decision.rule) == ("ar", "batch")
    assert decision.reason.startswith("a 60000 ms budget can wait for a batch (>= 60000 ms): ")
    assert route(request(budget_ms=59_999), patient).rule == "fast"


def test_high_value_with_no_remote_configured_says_so():
    owned_only = POLICY.model_copy(update={"remote_frontier_engines": ()})
    decision = route(request(value=20.0, data_class=DataClass.public), owned_only)
    assert (decision.engine, decision.rule) == ("spec", "frontier")
    assert decision.reason == ("high value ($20/Mtok >= $5/Mtok) and no remote frontier engine is configured: "
                               "the owned frontier engine")


def test_latency_bound_work_goes_to_the_batch_engine_when_no_fast_engine_is_available():
    without_fast = POLICY.model_copy(update={"fast_engine": None})
    decision = route(request(value=0.5), without_fast)
    assert (decision.engine, decision.rule, decision.fallback_engine) == ("ar", "fast", None)
    assert decision.reason == "latency-bound but no fast (diffusion) engine is available: AR"


def test_a_pinned_fast_engine_keeps_its_confidence_fallback():
    decision = pin("diffusion", POLICY)
    assert (decision.engine, decision.rule, decision.fallback_engine) == ("diffusion", "pinned", "ar")
    assert decision.reason == "the caller asked for diffusion; answers below confidence 0.9 re-run on ar"
    other = pin("spec", POLICY)
    assert (other.engine, other.rule, other.fallback_engine, other.reason) == (
        "spec", "pinned", None, "the caller asked for spec")


def test_a_fast_engine_that_is_its_own_fallback_is_not_re_run():
    alone = POLICY.model_copy(update={"fast_engine": "ar", "fallback_engine": "ar"})
    for decision in (pin("ar", alone), route(request(value=0.5), alone)):
        assert (decision.engine, decision.fallback_engine) == ("ar", None)
        assert decision.reason.endswith("ar is its own fallback: no re-run")


def test_check_destination_names_the_refused_class_and_engine():
    with pytest.raises(DataClassViolation) as refused:
        check_destination("frontier-api", DataClass.restricted, POLICY)
    assert str(refused.value) == "restricted data may not be sent to remote engine 'frontier-api'"


def test_failover_sends_a_failed_remote_to_the_owned_frontier_and_owned_failures_nowhere():
    assert failover("frontier-api", POLICY) == "spec"
    assert failover("diffusion", POLICY) is None
    assert failover("ar", POLICY) is None


def test_restrict_to_available_drops_only_what_cannot_serve():
    second = RemoteEngine(name="second-api")
    policy = POLICY.model_copy(update={"remote_frontier_engines": (FRONTIER_API, second)})
    everything = restrict_to_available(policy, {"ar", "spec", "diffusion", "frontier-api", "second-api"})
    assert everything.fast_engine == "diffusion"
    assert everything.remote_frontier_engines == (FRONTIER_API, second)
    degraded = restrict_to_available(policy, {"ar", "spec", "second-api"})
    assert degraded.fast_engine is None
    assert degraded.remote_frontier_engines == (second,)
    # the owned batch, fallback and frontier engines stay named even when down
    assert (degraded.batch_engine, degraded.fallback_engine, degraded.owned_frontier_engine) == ("ar", "ar", "spec")
    assert policy.fast_engine == "diffusion"  # the original policy is left as it was
