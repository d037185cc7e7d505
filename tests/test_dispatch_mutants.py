"""The Dispatcher's rules stated one by one on stand-in engines: which engine runs, when an answer
is re-run and why, and what the audit log and the metrics say about every request. Written
against mutmut's survivors (docs/testing.md): each test pins a sentence, a count or a branch that
a one-token change to gateway/dispatch.py would otherwise alter unnoticed."""

from __future__ import annotations

import pytest

from nowait.gateway import dispatch
from nowait.gateway.dispatch import Outcome
from nowait.gateway.errors import APIError
from nowait.router import DataClass, Decision
from tests.dispatch_support import FakeBackend, answer, make, make_call, run, sample

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_an_outcome_costs_every_attempt_and_ends_with_the_last():
    first, last = answer("diffusion", cost=0.25), answer("ar", cost=0.5)
    outcome = Outcome(make_call(), Decision("diffusion", "why"), attempts=[first, last])
    assert outcome.cost_usd == 0.75 and outcome.final is last and not outcome.fallback
    outcome.fallback_cause = "confidence"
    assert outcome.fallback


def test_model_names_are_the_router_then_the_available_engines():
    dispatcher, _, _ = make(FakeBackend("ar"), FakeBackend("diffusion", available=False), FakeBackend("spec"))
    assert dispatcher.model_names() == ["nowait", "ar", "spec"]


def test_the_router_model_is_routed_and_an_engine_name_is_pinned():
    dispatcher, _, _ = make(FakeBackend("ar"), FakeBackend("diffusion"))
    routed = dispatcher.decide(make_call("nowait"))
    assert (routed.engine, routed.rule, routed.fallback_engine) == ("diffusion", "fast", "ar")
    assert dispatcher.decide(make_call("nowait", value=9.0)).engine == "frontier"  # the call's metadata is read
    pinned = dispatcher.decide(make_call("ar"))
    assert (pinned.engine, pinned.rule) == ("ar", "pinned")


def test_an_unknown_model_is_refused_and_logged():
    dispatcher, metrics, audit = make(FakeBackend("ar"), FakeBackend("diffusion", available=False))
    with pytest.raises(APIError) as caught:
        run(dispatcher.complete(make_call("gpt-9")))
    error = caught.value
    assert (error.status, error.code) == (404, "model_not_found")
    assert error.message == "The model `gpt-9` does not exist; available: nowait, ar"
    assert error.accounted
    [entry] = audit.entries
    assert entry["status"] == 404 and entry["error"] == error.message and entry["route"] is None
    assert (entry["decision"], entry["rule"]) == ("", "none")
    assert entry["reason"] == f"refused: {error.message}"
    assert entry["engines_tried"] == [] and entry["prompt_tokens"] == 0 and entry["completion_tokens"] == 0
    assert sample(metrics, "nowait:request_errors_total", status="404", code="model_not_found") == 1
    assert sample(metrics, "nowait:tenant_requests_total", tenant="team-a", code="404") == 1


def test_an_unavailable_engine_is_a_503_naming_why():
    down = FakeBackend("ar", available=False, unavailable_reason="no weights yet")
    dispatcher, _, audit = make(down, FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.complete(make_call("ar")))
    assert (caught.value.status, caught.value.code) == (503, "engine_unavailable")
    assert caught.value.message == "engine 'ar' is not available: no weights yet"
    assert not down.calls and audit.entries[0]["status"] == 503


def test_an_engine_that_may_not_receive_the_data_class_is_refused():
    remote = FakeBackend("frontier", receives=(DataClass.public,), owned=False)
    dispatcher, _, audit = make(remote, FakeBackend("ar"), FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.complete(make_call("frontier", data_class=DataClass.internal)))
    assert (caught.value.status, caught.value.code) == (403, "data_class_forbidden")
    assert caught.value.message == "internal data may not be sent to remote engine 'frontier'"
    assert remote.asked_classes == [DataClass.internal] and not remote.calls
    assert audit.entries[0]["status"] == 403


def test_an_answer_is_accounted_in_full(monkeypatch):
    clock = iter([100.0, 101.23456789, 101.23456789])
    monkeypatch.setattr(dispatch.time, "perf_counter", lambda: next(clock))
    ar = FakeBackend("ar", answer=answer("ar", text="done", prompt=5, completion=3, cost=0.125,
                                         seconds=0.1234567, compute_s=0.0456789, forwards=4, confidence=None))
    dispatcher, metrics, audit = make(ar, FakeBackend("diffusion"), timeout_s=7.5)
    outcome = run(dispatcher.complete(make_call("ar", value=1.5, budget_ms=250.0)))
    assert outcome.final.text == "done" and ar.timeouts == [7.5]
    [entry] = audit.entries
    assert entry == {
        "request_id": "req-7", "endpoint": "chat", "model": "ar", "tenant": "team-a", "key_id": "key-1",
        "status": 200, "error": None, "route": "ar", "decision": "ar", "rule": "pinned",
        "reason": "the caller asked for ar", "fallback": False, "fallback_cause": None, "low_confidence": [],
        "metadata": {"latency_budget_ms": 250.0, "token_value_usd_per_mtok": 1.5, "data_class": "internal",
                     "batchable": False},
        "engines_tried": [{"engine": "ar", "outcome": "stop", "seconds": 0.123457, "compute_s": 0.045679,
                           "prompt_tokens": 5, "completion_tokens": 3, "confidence": None, "cost_usd": 0.125,
                           "forwards": 4}],
        "prompt_tokens": 5, "completion_tokens": 3, "seconds": 1.234568, "cost_usd": 0.125}
    assert sample(metrics, "nowait:routed_requests_total", rule="pinned", engine="ar") == 1
    assert sample(metrics, "nowait:gateway_request_latency_seconds_count", route="ar") == 1
    assert sample(metrics, "nowait:gateway_request_latency_seconds_sum", route="ar") == pytest.approx(1.23456789)
    assert sample(metrics, "nowait:prompt_tokens_total", engine="ar") == 5  # the attempt is observed
    assert sample(metrics, "nowait:tenant_requests_total", tenant="team-a", code="200") == 1
    assert sample(metrics, "nowait:tenant_cost_usd_total", tenant="team-a") == 0.125
    assert not list(metrics.errors.collect()[0].samples)


def low_confidence_fallback(**call_options):
    fast = FakeBackend("diffusion", answer=answer("diffusion", text='{"a": 1}', confidence=0.2, prompt=5,
                                                  completion=3, cost=0.01))
    slow = FakeBackend("ar", answer=answer("ar", text='{"a": 2}', prompt=7, completion=4, cost=0.02))
    dispatcher, metrics, audit = make(fast, slow)
    outcome = run(dispatcher.complete(make_call("nowait", **call_options)))
    return outcome, fast, slow, metrics, audit


def test_a_low_confidence_answer_reruns_on_the_fallback_and_both_are_paid():
    outcome, fast, slow, metrics, audit = low_confidence_fallback()
    assert [a.engine for a in outcome.attempts] == ["diffusion", "ar"]
    assert outcome.fallback_cause == "confidence" and outcome.cost_usd == pytest.approx(0.03)
    assert outcome.reason.endswith("; diffusion confidence 0.2 is below 0.9: re-ran on ar")
    assert outcome.reason.startswith(outcome.decision.reason)
    assert slow.calls[0].draft_text == '{"a": 1}' and fast.calls[0].draft_text is None
    entry = audit.entries[0]
    assert (entry["route"], entry["decision"], entry["rule"]) == ("ar", "diffusion", "fast")
    assert entry["fallback"] is True and entry["fallback_cause"] == "confidence"
    assert (entry["prompt_tokens"], entry["completion_tokens"]) == (7, 4)  # the answer's, not the sum
    assert [e["engine"] for e in entry["engines_tried"]] == ["diffusion", "ar"]
    assert sample(metrics, "nowait:tenant_tokens_total", tenant="team-a", kind="prompt") == 12  # every run's
    assert sample(metrics, "nowait:tenant_tokens_total", tenant="team-a", kind="completion") == 7
    assert sample(metrics, "nowait:fallbacks_total", engine="diffusion", to="ar", cause="confidence") == 1
    assert sample(metrics, "nowait:routed_requests_total", rule="fast", engine="diffusion") == 1
    assert sample(metrics, "nowait:gateway_request_latency_seconds_count", route="ar") == 1
    assert metrics.fallback_share("diffusion") == 1.0


@pytest.mark.parametrize(("temperature", "draft"), [(None, '{"a": 1}'), (0.0, '{"a": 1}'), (0.7, None)])
def test_only_a_greedy_rerun_gets_the_fast_answer_as_its_draft(temperature, draft):
    _, _, slow, _, _ = low_confidence_fallback(temperature=temperature)
    assert slow.calls[0].draft_text == draft


def test_an_empty_fast_answer_is_no_draft():
    fast = FakeBackend("diffusion", answer=answer("diffusion", text="", confidence=0.1))
    slow = FakeBackend("ar", answer=answer("ar"))
    dispatcher, _, _ = make(fast, slow)
    run(dispatcher.complete(make_call()))
    assert slow.calls[0].draft_text is None


@pytest.mark.parametrize(("confidence", "reruns"), [(0.9, False), (0.95, False), (0.8999, True), (None, True)])
def test_the_threshold_is_inclusive_and_no_confidence_reruns(confidence, reruns):
    """An answer of unknown confidence (a remote fast engine whose upstream gave no logprobs)
    does not pass as a confident one."""
    fast = FakeBackend("diffusion", answer=answer("diffusion", confidence=confidence))
    slow = FakeBackend("ar", answer=answer("ar"))
    dispatcher, metrics, _ = make(fast, slow)
    outcome = run(dispatcher.complete(make_call()))
    assert bool(slow.calls) is reruns and outcome.fallback is reruns
    assert metrics.fallback_share("diffusion") == (1.0 if reruns else 0.0)
    if confidence is None:
        assert outcome.fallback_cause == "confidence_unknown"
        assert "diffusion gave no confidence (none reported): re-ran on ar" in outcome.reason


def test_the_fallback_share_counts_every_fast_answer():
    fast = FakeBackend("diffusion", answer=answer("diffusion", confidence=0.95))
    dispatcher, metrics, _ = make(fast, FakeBackend("ar", answer=answer("ar")))
    run(dispatcher.complete(make_call()))
    fast.answer = answer("diffusion", confidence=0.1)
    run(dispatcher.complete(make_call()))
    assert metrics.fallback_share("diffusion") == 0.5


@pytest.mark.parametrize(("json_mode", "text", "reruns"), [
    (True, '{"a": "x"}', True), (True, '{"a": 3}', False), (False, "not json", False)])
def test_a_json_answer_invalid_for_the_schema_reruns(json_mode, text, reruns):
    fast = FakeBackend("diffusion", answer=answer("diffusion", text=text, confidence=0.99))
    slow = FakeBackend("ar", answer=answer("ar", text='{"a": 1}'))
    dispatcher, metrics, _ = make(fast, slow)
    outcome = run(dispatcher.complete(make_call(json_mode=json_mode, schema=SCHEMA)))
    assert bool(slow.calls) is reruns
    if reruns:
        assert outcome.fallback_cause == "invalid_output"
        assert outcome.reason.endswith("; diffusion output is not JSON valid for the requested format: re-ran on ar")
        assert sample(metrics, "nowait:fallbacks_total", engine="diffusion", to="ar", cause="invalid_output") == 1


def test_a_pinned_engine_without_fallback_is_never_rerun():
    ar = FakeBackend("ar", answer=answer("ar", text="x", confidence=0.01))
    dispatcher, metrics, _ = make(ar, FakeBackend("diffusion"))
    outcome = run(dispatcher.complete(make_call("ar", json_mode=True, schema=SCHEMA)))
    assert len(ar.calls) == 1 and not outcome.fallback
    assert not list(metrics.fallbacks.collect()[0].samples)
