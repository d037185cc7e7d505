"""The Dispatcher when an engine cannot answer at all: which failures hand the request to another
engine (and which do not), what the failed try leaves in the outcome, the audit log and the
metrics, and a client that hangs up. Stand-in engines (tests/dispatch_support.py); written
against mutmut's survivors in gateway/dispatch.py (docs/testing.md)."""

from __future__ import annotations

import asyncio

import pytest

from nowait.gateway.dispatch import Outcome
from nowait.gateway.errors import APIError
from nowait.gateway.remote import UpstreamFailure
from nowait.gateway.workers import SCHEMA_UNSUPPORTED
from nowait.router import Decision
from tests.dispatch_support import FakeBackend, answer, make, make_call, run, sample


@pytest.mark.parametrize(("status", "code", "cause"), [
    (500, "engine_error", "engine_failure"), (429, "rate_limit_exceeded", "engine_failure"),
    (503, "engine_unavailable", "engine_failure"), (400, SCHEMA_UNSUPPORTED, "schema_unsupported")])
def test_a_fast_engine_that_cannot_answer_hands_over_to_its_fallback(status, code, cause):
    fast = FakeBackend("diffusion", error=APIError(status, "simulated failure", code=code))
    # The fallback's own low confidence does not send it round again: only the fast engine's answer is judged.
    slow = FakeBackend("ar", answer=answer("ar", text="x", confidence=0.01, cost=0.5))
    dispatcher, metrics, audit = make(fast, slow)
    outcome = run(dispatcher.complete(make_call()))
    assert [a.engine for a in outcome.attempts] == ["diffusion", "ar"] and len(slow.calls) == 1
    failed = outcome.attempts[0]
    assert (failed.finish_reason, failed.outcome, failed.text) == ("error", "simulated failure", "")
    assert outcome.fallback_cause == cause and outcome.cost_usd == 0.5
    # Not re-run, but not silent either: below its floor (0.5 by default), the answer is flagged.
    assert outcome.reason == (f"{outcome.decision.reason}; simulated failure: re-ran on ar; "
                              "ar confidence 0.01 is below its floor 0.5: flagged")
    assert outcome.flagged
    entry = audit.entries[0]
    assert entry["status"] == 200 and entry["route"] == "ar" and entry["fallback_cause"] == cause
    assert entry["engines_tried"][0]["outcome"] == "simulated failure"
    # No fast answer was produced, so none counts towards its fallback share; the re-run is counted.
    assert metrics.fallback_share("diffusion") == 0.0
    assert sample(metrics, "nowait:fallbacks_total", engine="diffusion", to="ar", cause=cause) == 1
    assert sample(metrics, "nowait:routed_requests_total", rule="fast", engine="diffusion") == 1


@pytest.mark.parametrize(("status", "code"), [(504, "timeout"), (400, "invalid_value"), (502, "upstream_error")])
def test_other_failures_of_the_fast_engine_are_the_answer(status, code):
    fast = FakeBackend("diffusion", error=APIError(status, "no", code=code))
    slow = FakeBackend("ar", answer=answer("ar"))
    dispatcher, metrics, audit = make(fast, slow)
    with pytest.raises(APIError) as caught:
        run(dispatcher.complete(make_call()))
    assert caught.value is fast.error and caught.value.accounted and not slow.calls
    assert audit.entries[0]["status"] == status and audit.entries[0]["error"] == "no"
    assert audit.entries[0]["route"] is None and audit.entries[0]["fallback"] is False
    assert sample(metrics, "nowait:request_errors_total", status=str(status), code=code) == 1
    assert sample(metrics, "nowait:tenant_requests_total", tenant="team-a", code=str(status)) == 1
    assert not list(metrics.routed.collect()[0].samples)


def test_a_failing_remote_upstream_fails_over_to_the_owned_frontier_engine():
    remote = FakeBackend("frontier", error=UpstreamFailure("frontier", "HTTP 500"), owned=False)
    ar = FakeBackend("ar", answer=answer("ar", text="owned"))
    dispatcher, metrics, audit = make(remote, ar, FakeBackend("diffusion"))
    outcome = run(dispatcher.complete(make_call(value=9.0)))
    assert outcome.decision.rule == "frontier" and outcome.decision.fallback_engine is None
    assert [a.engine for a in outcome.attempts] == ["frontier", "ar"] and outcome.final.text == "owned"
    assert outcome.fallback_cause == "upstream_failure"
    assert outcome.reason.endswith("; upstream 'frontier' failed: HTTP 500: re-ran on ar")
    assert audit.entries[0]["route"] == "ar" and audit.entries[0]["decision"] == "frontier"
    assert sample(metrics, "nowait:fallbacks_total", engine="frontier", to="ar", cause="upstream_failure") == 1


def test_a_pinned_remote_that_fails_is_not_failed_over():
    remote = FakeBackend("frontier", error=UpstreamFailure("frontier", "HTTP 500"), owned=False)
    ar = FakeBackend("ar", answer=answer("ar"))
    dispatcher, _, audit = make(remote, ar, FakeBackend("diffusion"))
    with pytest.raises(UpstreamFailure):
        run(dispatcher.complete(make_call("frontier")))
    assert not ar.calls and audit.entries[0]["status"] == 502


def test_a_pinned_fast_engine_keeps_its_fallback_for_engine_failures():
    fast = FakeBackend("diffusion", error=APIError(500, "boom"))
    dispatcher, _, _ = make(fast, FakeBackend("ar", answer=answer("ar")))
    outcome = run(dispatcher.complete(make_call("diffusion")))
    assert outcome.final.engine == "ar" and outcome.fallback_cause == "engine_failure"


def test_an_upstream_failure_of_an_owned_engine_has_nowhere_to_go():
    """failover() names no engine for an owned one: a 502 of the fast engine is the answer even
    though it has a fallback engine."""
    fast = FakeBackend("diffusion", error=UpstreamFailure("diffusion", "gone"))
    slow = FakeBackend("ar", answer=answer("ar"))
    dispatcher, _, _ = make(fast, slow)
    with pytest.raises(UpstreamFailure):
        run(dispatcher.complete(make_call()))
    assert not slow.calls


def test_a_fallback_that_fails_too_is_the_answer():
    fast = FakeBackend("diffusion", error=APIError(503, "down", code="engine_unavailable"))
    slow = FakeBackend("ar", error=APIError(504, "late", code="timeout"))
    dispatcher, metrics, audit = make(fast, slow)
    with pytest.raises(APIError) as caught:
        run(dispatcher.complete(make_call()))
    assert caught.value is slow.error
    [entry] = audit.entries
    assert entry["status"] == 504 and entry["error"] == "late"
    assert entry["fallback"] is True and entry["fallback_cause"] == "engine_failure"
    assert [e["engine"] for e in entry["engines_tried"]] == ["diffusion"]
    assert entry["prompt_tokens"] == 0  # the failed try's Attempt carries no tokens
    assert sample(metrics, "nowait:request_errors_total", status="504", code="timeout") == 1


class Hangs(FakeBackend):
    async def run(self, call, timeout_s):
        raise asyncio.CancelledError


def test_a_client_that_hangs_up_is_logged_as_499():
    dispatcher, metrics, audit = make(Hangs("ar"), FakeBackend("diffusion"))
    with pytest.raises(asyncio.CancelledError):
        run(dispatcher.complete(make_call("ar")))
    [entry] = audit.entries
    assert entry["status"] == 499 and entry["error"] == "client closed the request"
    assert sample(metrics, "nowait:request_errors_total", status="499", code="cancelled") == 1


def test_a_request_with_no_answer_and_no_error_is_a_500():
    """The accounting's last resort: nothing answered and nothing said why."""
    dispatcher, metrics, audit = make(FakeBackend("ar"))
    dispatcher._account(Outcome(make_call("ar"), Decision("ar", "pinned", rule="pinned")), 0.0)
    [entry] = audit.entries
    assert entry["status"] == 500 and entry["error"] == "no answer" and entry["route"] is None
    assert entry["prompt_tokens"] == 0 and entry["completion_tokens"] == 0 and entry["cost_usd"] == 0
    assert sample(metrics, "nowait:request_errors_total", status="500", code="") == 1
    assert sample(metrics, "nowait:tenant_requests_total", tenant="team-a", code="500") == 1
