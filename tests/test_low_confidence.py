"""No silent garbage (issue 23, item 6): an answer below its engine's confidence floor is flagged,
re-run on the frontier engine its data class may reach, or refused with a 422, as
`routing.low_confidence` says; on hand-made low-confidence answers from stand-in engines, with
what the audit log and the metrics say about each. Over HTTP: tests/test_gateway_low_confidence.py."""

from __future__ import annotations

import pytest

from nowait.gateway.errors import APIError
from nowait.gateway.low_confidence import LOW_CONFIDENCE, LowConfidenceError
from nowait.router import DEFAULT_CONFIDENCE_FLOOR, DataClass, below_floor, low_confidence_rerun
from tests.dispatch_support import FakeBackend, FakeStream, answer, make, make_call, policy, run, sample


def unsure_pair(ar_confidence: float = 0.2) -> tuple[FakeBackend, FakeBackend]:
    """A fast engine below the fallback threshold, and a fallback below its floor: the KYC case."""
    return (FakeBackend("diffusion", answer=answer("diffusion", text="guess", confidence=0.49, cost=0.25)),
            FakeBackend("ar", answer=answer("ar", text="invented", confidence=ar_confidence, cost=0.5)))


def low(metrics, engine: str, action: str) -> float:
    return sample(metrics, "nowait:low_confidence_total", engine=engine, action=action)


def test_the_floor_is_per_engine_with_a_default_and_needs_a_confidence():
    rules = policy(confidence_floors={"ar": 0.1})
    assert below_floor("diffusion", DEFAULT_CONFIDENCE_FLOOR - 0.01, rules)
    assert not below_floor("diffusion", DEFAULT_CONFIDENCE_FLOOR, rules)
    assert not below_floor("ar", 0.2, rules) and below_floor("ar", 0.05, rules)
    assert below_floor("ar", float("nan"), rules)  # an overflow is not a sure answer
    assert not below_floor("frontier", None, rules)  # an upstream without logprobs: nothing to compare


def test_flag_the_default_marks_the_answer_and_counts_it():
    fast, slow = unsure_pair()
    dispatcher, metrics, audit = make(fast, slow)
    outcome = run(dispatcher.complete(make_call()))
    assert outcome.final.text == "invented" and outcome.flagged
    assert outcome.reason.endswith("re-ran on ar; ar confidence 0.2 is below its floor 0.5: flagged")
    assert [r for r in audit.entries[0]["low_confidence"]] == [
        {"engine": "ar", "confidence": 0.2, "floor": 0.5, "action": "flag"}]
    assert audit.entries[0]["status"] == 200
    assert low(metrics, "ar", "flag") == 1 and low(metrics, "ar", "reject") == 0


def test_an_answer_at_its_floor_is_not_flagged():
    fast, slow = unsure_pair(ar_confidence=0.5)
    dispatcher, metrics, audit = make(fast, slow)
    outcome = run(dispatcher.complete(make_call()))
    assert not outcome.flagged and outcome.low_confidence == [] and audit.entries[0]["low_confidence"] == []
    assert low(metrics, "ar", "flag") == 0


def test_reject_answers_422_with_both_confidences():
    fast, slow = unsure_pair()
    dispatcher, metrics, audit = make(fast, slow, low_confidence="reject")
    with pytest.raises(LowConfidenceError) as caught:
        run(dispatcher.complete(make_call()))
    error = caught.value
    assert (error.status, error.code) == (422, LOW_CONFIDENCE) and error.accounted
    body = error.body()["error"]
    assert body["code"] == "low_confidence" and body["floor"] == 0.5
    assert body["confidences"] == [{"engine": "diffusion", "confidence": 0.49}, {"engine": "ar", "confidence": 0.2}]
    assert "ar confidence 0.2 is below its floor 0.5" in body["message"] and "diffusion 0.49" in body["message"]
    entry = audit.entries[0]
    assert entry["status"] == 422 and entry["route"] is None and entry["low_confidence"][0]["action"] == "reject"
    assert low(metrics, "ar", "reject") == 1
    assert sample(metrics, "nowait:request_errors_total", status="422", code="low_confidence") == 1


def test_frontier_reruns_where_the_data_class_may_go():
    fast, slow = unsure_pair()
    remote = FakeBackend("frontier", answer=answer("frontier", text="sure", cost=2.0), owned=False,
                         receives=(DataClass.public, DataClass.internal))
    dispatcher, metrics, audit = make(fast, slow, remote, low_confidence="frontier")
    outcome = run(dispatcher.complete(make_call(data_class=DataClass.internal)))
    assert [a.engine for a in outcome.attempts] == ["diffusion", "ar", "frontier"]
    assert outcome.final.text == "sure" and not outcome.flagged and outcome.cost_usd == 2.75
    assert outcome.reason.endswith("ar confidence 0.2 is below its floor 0.5: re-ran on frontier")
    assert audit.entries[0]["route"] == "frontier" and audit.entries[0]["low_confidence"][0]["action"] == "frontier"
    assert low(metrics, "ar", "frontier") == 1 and low(metrics, "ar", "flag") == 0


def test_frontier_never_takes_restricted_data_out_and_flags_instead():
    fast, slow = unsure_pair()
    remote = FakeBackend("frontier", answer=answer("frontier", text="sure"), owned=False,
                         receives=(DataClass.public, DataClass.internal))
    dispatcher, metrics, _ = make(fast, slow, remote, low_confidence="frontier")
    outcome = run(dispatcher.complete(make_call(data_class=DataClass.restricted)))
    assert not remote.calls and outcome.final.engine == "ar" and outcome.flagged
    # The owned frontier engine (ar) already answered: running it again would say the same.
    assert "no other frontier engine may receive restricted data: flagged" in outcome.reason
    assert low(metrics, "ar", "flag") == 1 and low(metrics, "ar", "frontier") == 0


def test_a_frontier_rerun_that_fails_or_is_unsure_leaves_the_answer_flagged():
    fast, slow = unsure_pair()
    down = FakeBackend("frontier", error=APIError(502, "upstream down"), owned=False)
    dispatcher, _, _ = make(fast, slow, down, low_confidence="frontier")
    outcome = run(dispatcher.complete(make_call()))
    assert outcome.final.engine == "ar" and outcome.flagged and "frontier failed (upstream down)" in outcome.reason

    fast, slow = unsure_pair()
    unsure = FakeBackend("frontier", answer=answer("frontier", text="maybe", confidence=0.3), owned=False)
    dispatcher, metrics, _ = make(fast, slow, unsure, low_confidence="frontier")
    outcome = run(dispatcher.complete(make_call()))
    assert outcome.final.engine == "frontier" and outcome.flagged and len(unsure.calls) == 1  # once, not a loop
    assert [x.action for x in outcome.low_confidence] == ["frontier", "flag"]
    assert low(metrics, "frontier", "flag") == 1


def test_the_rerun_target_follows_the_routers_data_class_rules():
    rules = policy(low_confidence="frontier")
    assert low_confidence_rerun(DataClass.internal, {"ar"}, rules) == "frontier"
    assert low_confidence_rerun(DataClass.restricted, {"diffusion"}, rules) == "ar"  # owned frontier, not yet tried
    assert low_confidence_rerun(DataClass.restricted, {"ar"}, rules) is None
    assert low_confidence_rerun(DataClass.internal, {"ar"}, policy(low_confidence="flag")) is None


def test_a_held_stream_is_refused_before_its_first_byte():
    fast, slow = unsure_pair()
    dispatcher, _, audit = make(fast, slow, low_confidence="reject")
    with pytest.raises(LowConfidenceError):
        run(dispatcher.open_stream(make_call()))
    assert audit.entries[0]["status"] == 422


def test_a_held_stream_is_flagged_before_its_first_byte():
    fast, slow = unsure_pair()
    dispatcher, _, _ = make(fast, slow)
    plan = run(dispatcher.open_stream(make_call()))
    assert plan.outcome.flagged and plan.replay == "invented"


def test_a_relayed_stream_already_sent_can_only_be_flagged():
    final = answer("ar", text="ab", confidence=0.2)
    ar = FakeBackend("ar", stream=FakeStream(["a", "b"], final))
    dispatcher, metrics, audit = make(ar, FakeBackend("diffusion"), low_confidence="reject")
    plan = run(dispatcher.open_stream(make_call("ar")))
    assert not plan.outcome.flagged  # nothing known before the text

    async def collect() -> list[str]:
        return [piece async for piece in plan.deltas()]

    assert run(collect()) == ["a", "b"]
    assert plan.outcome.flagged and "(already streamed): flagged" in plan.outcome.reason
    assert audit.entries[0]["status"] == 200 and audit.entries[0]["low_confidence"][0]["action"] == "flag"
    assert low(metrics, "ar", "flag") == 1 and low(metrics, "ar", "reject") == 0
