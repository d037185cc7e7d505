"""The Dispatcher's streams on stand-in engines: a fast-engine stream is held until its confidence
is known and then replayed; any other is relayed, and accounted once its deltas end or fail.
Written against mutmut's survivors in gateway/dispatch.py (docs/testing.md)."""

from __future__ import annotations

import asyncio

import pytest

from nowait.gateway.errors import APIError
from nowait.gateway.remote import UpstreamFailure
from tests.dispatch_support import FakeBackend, FakeStream, answer, make, make_call, run, sample


async def collect(plan) -> list[str]:
    return [piece async for piece in plan.deltas()]


def test_a_fast_engine_stream_is_held_then_replayed():
    fast = FakeBackend("diffusion", answer=answer("diffusion", text="held text", confidence=0.95))
    dispatcher, _, audit = make(fast, FakeBackend("ar"))
    plan = run(dispatcher.open_stream(make_call()))
    assert fast.streams_opened == 0 and len(fast.calls) == 1  # ran, not streamed
    assert plan.route == "diffusion" and plan.replay == "held text" and plan.stream is None
    assert len(audit.entries) == 1 and audit.entries[0]["status"] == 200  # accounted before the first byte
    assert run(collect(plan)) == ["held text"]
    assert len(audit.entries) == 1
    run(plan.aclose())  # nothing to close


def test_a_held_stream_that_falls_back_replays_the_fallbacks_answer():
    fast = FakeBackend("diffusion", answer=answer("diffusion", text="unsure", confidence=0.1))
    slow = FakeBackend("ar", answer=answer("ar", text=""))
    dispatcher, _, audit = make(fast, slow)
    plan = run(dispatcher.open_stream(make_call()))
    assert plan.route == "ar" and plan.outcome.fallback_cause == "confidence"
    assert run(collect(plan)) == []  # an empty answer sends no delta
    assert audit.entries[0]["route"] == "ar"


def test_a_held_stream_whose_engine_fails_is_an_http_error():
    fast = FakeBackend("diffusion", error=APIError(504, "late", code="timeout"))
    dispatcher, metrics, audit = make(fast, FakeBackend("ar", answer=answer("ar")))
    with pytest.raises(APIError) as caught:
        run(dispatcher.open_stream(make_call()))
    assert caught.value.accounted and audit.entries[0]["status"] == 504
    assert sample(metrics, "nowait:request_errors_total", status="504", code="timeout") == 1


class Hangs(FakeBackend):
    async def run(self, call, timeout_s):
        raise asyncio.CancelledError


def test_a_client_gone_before_a_held_streams_first_byte_is_a_499():
    dispatcher, metrics, audit = make(Hangs("diffusion"), FakeBackend("ar"))
    with pytest.raises(asyncio.CancelledError):
        run(dispatcher.open_stream(make_call()))
    assert audit.entries[0]["status"] == 499 and audit.entries[0]["error"] == "client closed the request"
    assert sample(metrics, "nowait:request_errors_total", status="499", code="cancelled") == 1


def relayed(pieces=("a", "b"), final="default", fail=None):
    attempt = answer("ar", text="".join(pieces), prompt=6, completion=2) if final == "default" else final
    stream = FakeStream(list(pieces), attempt, fail=fail)
    ar = FakeBackend("ar", stream=stream)
    dispatcher, metrics, audit = make(ar, FakeBackend("diffusion"), timeout_s=3.0)
    return dispatcher, metrics, audit, ar, stream


def test_another_stream_is_relayed_and_accounted_at_its_end():
    dispatcher, metrics, audit, ar, stream = relayed()
    call = make_call("ar")
    plan = run(dispatcher.open_stream(call))
    assert plan.route == "ar" and plan.replay is None and ar.timeouts == [3.0] and not audit.entries
    assert ar.calls == [call]
    assert run(collect(plan)) == ["a", "b"]
    [entry] = audit.entries
    assert entry["reason"] == "the caller asked for ar" == plan.outcome.reason
    assert entry["status"] == 200 and entry["route"] == "ar" and entry["completion_tokens"] == 2
    assert plan.outcome.attempts == [stream.attempt]
    assert sample(metrics, "nowait:prompt_tokens_total", engine="ar") == 6
    run(plan.aclose())
    assert stream.closed


def test_a_stream_that_ends_without_an_attempt_is_not_accounted():
    dispatcher, metrics, audit, _, _ = relayed(final=None)
    plan = run(dispatcher.open_stream(make_call("ar")))
    assert run(collect(plan)) == ["a", "b"]
    assert not audit.entries and not plan.outcome.attempts
    assert not list(metrics.request_success.collect()[0].samples)


@pytest.mark.parametrize(("fail", "status", "message"), [
    (APIError(504, "stalled", code="timeout"), 504, "stalled"),
    (asyncio.CancelledError(), 499, "client closed the request"),
    (RuntimeError("bug"), 500, "internal error (RuntimeError)")])
def test_a_stream_that_fails_midway_is_accounted_with_its_error(fail, status, message):
    dispatcher, metrics, audit, _, _ = relayed(fail=fail)
    plan = run(dispatcher.open_stream(make_call("ar")))
    seen: list[str] = []

    async def consume():
        async for piece in plan.deltas():
            seen.append(piece)

    with pytest.raises(type(fail)):
        run(consume())
    assert seen == ["a", "b"]
    [entry] = audit.entries
    assert entry["status"] == status and entry["error"] == message and entry["route"] is None
    code = {504: "timeout", 499: "cancelled", 500: ""}[status]
    assert sample(metrics, "nowait:request_errors_total", status=str(status), code=code) == 1


def test_a_client_that_stops_reading_midway_is_a_499():
    dispatcher, _, audit, _, _ = relayed(pieces=("a", "b", "c"))
    plan = run(dispatcher.open_stream(make_call("ar")))

    async def read_one():
        deltas = plan.deltas()
        first = await deltas.__anext__()
        await deltas.aclose()  # GeneratorExit inside the relay
        return first

    assert run(read_one()) == "a"
    [entry] = audit.entries
    assert entry["status"] == 499


def test_a_stream_the_remote_cannot_open_fails_over():
    remote = FakeBackend("frontier", error=UpstreamFailure("frontier", "refused"), owned=False)
    stream = FakeStream(["owned"], answer("ar", text="owned"))
    ar = FakeBackend("ar", stream=stream)
    dispatcher, _, audit = make(remote, ar, FakeBackend("diffusion"), timeout_s=4.0)
    call = make_call(value=9.0)
    plan = run(dispatcher.open_stream(call))
    assert plan.route == "ar" and plan.outcome.fallback_cause == "upstream_failure"
    assert ar.calls == [call] and ar.timeouts == [4.0]
    assert [a.engine for a in plan.outcome.attempts] == ["frontier"]
    assert plan.outcome.reason.endswith("; upstream 'frontier' failed: refused: re-ran on ar")
    assert run(collect(plan)) == ["owned"]
    assert audit.entries[0]["route"] == "ar" and [e["engine"] for e in audit.entries[0]["engines_tried"]] \
        == ["frontier", "ar"]


def test_a_stream_nobody_can_open_is_an_http_error():
    remote = FakeBackend("frontier", error=UpstreamFailure("frontier", "refused"), owned=False)
    ar = FakeBackend("ar", error=APIError(503, "ar down", code="engine_unavailable"))
    dispatcher, metrics, audit = make(remote, ar, FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.open_stream(make_call(value=9.0)))
    assert caught.value is ar.error and caught.value.accounted
    assert audit.entries[0]["status"] == 503 and audit.entries[0]["fallback_cause"] == "upstream_failure"
    assert sample(metrics, "nowait:request_errors_total", status="503", code="engine_unavailable") == 1


def test_a_stream_with_no_alternative_is_an_http_error():
    ar = FakeBackend("ar", error=APIError(429, "full", code="rate_limit_exceeded"))
    dispatcher, _, audit = make(ar, FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.open_stream(make_call("ar")))
    assert caught.value.accounted and audit.entries[0]["status"] == 429 and ar.streams_opened == 1


def test_a_stream_to_a_forbidden_engine_is_refused_before_opening():
    from nowait.router import DataClass

    remote = FakeBackend("frontier", receives=(DataClass.public,), owned=False)
    dispatcher, _, audit = make(remote, FakeBackend("ar"), FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.open_stream(make_call("frontier")))
    assert caught.value.status == 403 and remote.streams_opened == 0 and audit.entries[0]["status"] == 403


def test_a_stream_for_an_unknown_model_is_refused_and_logged():
    dispatcher, metrics, audit = make(FakeBackend("ar"), FakeBackend("diffusion"))
    with pytest.raises(APIError) as caught:
        run(dispatcher.open_stream(make_call("gpt-9")))
    assert caught.value.code == "model_not_found" and caught.value.accounted
    [entry] = audit.entries
    assert entry["status"] == 404 and entry["reason"].startswith("refused: The model `gpt-9`")
    assert entry["seconds"] >= 0
    assert sample(metrics, "nowait:request_errors_total", status="404", code="model_not_found") == 1
