"""The diffusion engine's worker (waves of requests, one streamed alone) and the pieces every
worker shares (tickets, refusals, stop strings, the last delta), on a stand-in engine whose
answers and stream chunks are fixed. Written against mutmut's survivors in gateway/workers.py
(docs/testing.md)."""

from __future__ import annotations

import pytest

from nowait.engines.base import Completion, GenerationRequest, InvalidRequestError, StreamChunk
from nowait.gateway import workers
from nowait.gateway.errors import APIError
from nowait.gateway.workers import (
    SCHEMA_UNSUPPORTED,
    DiffusionWorker,
    EngineWorker,
    Event,
    Ticket,
    apply_stop,
    invalid,
)
from tests.worker_support import ClosedLoop, RecordingStats, SecondClock, drain, kinds, make_ticket


def completion(text: str, tokens: int = 2) -> Completion:
    return Completion(request_id="", engine="diffusion", token_ids=list(range(tokens)), text=text,
                      finish_reason="length", prompt_tokens=1)


class FakeDiffusion:
    """Answers each prompt [n] with `answers[n]`; streams `chunks` then `answers[n]`."""

    def __init__(self, answers: dict[int, Completion], max_batch: int = 2, chunks: tuple[str, ...] = ()) -> None:
        self.answers, self.max_batch, self.chunks = answers, max_batch, chunks
        self.waves: list[list[int]] = []
        self.running_seen: list[int] = []
        self.streamed: list[int] = []
        self.worker: DiffusionWorker | None = None
        self.on_chunk = lambda: None

    def plan(self, request: GenerationRequest) -> None:
        if request.schema is not None:
            raise InvalidRequestError("schema: nested objects cannot be slotted")

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        self.waves.append([r.prompt_ids[0] for r in requests])
        self.running_seen.append(self.worker.running())
        return [self.answers[r.prompt_ids[0]] for r in requests]

    def stream(self, request: GenerationRequest):
        self.streamed.append(request.prompt_ids[0])
        self.running_seen.append(self.worker.running())
        for text in self.chunks:
            yield StreamChunk(text, [1])
            self.on_chunk()
        yield StreamChunk("", [], self.answers[request.prompt_ids[0]])


@pytest.fixture
def clock(monkeypatch):
    fake = SecondClock()
    monkeypatch.setattr(workers, "time", fake)
    return fake


def diffusion(answers, **options) -> tuple[FakeDiffusion, DiffusionWorker]:
    engine = FakeDiffusion(answers, **options)
    worker = DiffusionWorker("diffusion", engine, None, RecordingStats())  # type: ignore[arg-type]
    engine.worker = worker
    return engine, worker


def admit(worker, *tickets) -> None:
    for ticket in tickets:
        worker.put(ticket)
    worker._intake()


def test_requests_run_in_waves_of_max_batch_and_split_each_waves_time(clock):
    answers = {n: completion(f"answer {n}", tokens=n) for n in (1, 2, 3)}
    engine, worker = diffusion(answers, max_batch=2)
    tickets = [make_ticket([n]) for n in (1, 2, 3)]
    admit(worker, *tickets)
    assert worker._wave == [] and worker.running() == 0
    assert worker._advance() and engine.waves == [[1, 2]] and engine.running_seen == [2]
    assert worker.running() == 0 and [t.compute_s for t in tickets[:2]] == [0.5, 0.5]
    assert worker._advance() and engine.waves == [[1, 2], [3]] and tickets[2].compute_s == 1.0
    assert not worker._advance()
    assert worker.stats.records == [(1.0, 3), (1.0, 3)]
    for ticket, n in zip(tickets, (1, 2, 3), strict=True):
        events = drain(ticket)
        assert kinds(events) == ["accepted", "done"] and events[-1].completion.text == f"answer {n}"


def test_a_request_the_engine_cannot_plan_is_refused_at_intake():
    _, worker = diffusion({1: completion("x")})
    nested = make_ticket([1])
    nested.request.schema = {"type": "object"}
    fine = make_ticket([1])
    admit(worker, nested, fine)
    [refused] = drain(nested)
    assert refused.kind == "failed" and refused.error.code == SCHEMA_UNSUPPORTED
    assert kinds(drain(fine)) == ["accepted"] and worker._pending == [fine]


def test_cancelled_tickets_leave_before_their_wave():
    engine, worker = diffusion({1: completion("a"), 2: completion("b")})
    gone, kept = make_ticket([1]), make_ticket([2])
    admit(worker, gone, kept)
    gone.cancelled.set()
    worker._drop_cancelled()
    worker._advance()
    assert engine.waves == [[2]] and kinds(drain(gone)) == ["accepted"]


def test_a_ticket_cancelled_during_its_wave_gets_no_answer():
    engine, worker = diffusion({1: completion("a"), 2: completion("b")})
    gone, kept = make_ticket([1]), make_ticket([2])
    admit(worker, gone, kept)
    original = engine.generate

    def cancel_meanwhile(requests):
        gone.cancelled.set()
        return original(requests)

    engine.generate = cancel_meanwhile
    worker._advance()
    assert kinds(drain(gone)) == ["accepted"] and kinds(drain(kept)) == ["accepted", "done"]


def test_a_stop_string_cuts_a_wave_answer():
    engine, worker = diffusion({1: completion('{"a": 1} END more'), 2: completion("no stop here")})
    cut, whole = make_ticket([1], stop=(" END", "more")), make_ticket([2], stop=(" END",))
    admit(worker, cut, whole)
    worker._advance()
    answer = drain(cut)[-1].completion
    assert (answer.text, answer.finish_reason) == ('{"a": 1}', "stop")
    assert drain(whole)[-1].completion == engine.answers[2]


def test_a_lone_stream_is_sent_block_by_block(clock):
    engine, worker = diffusion({1: completion("abcdef", tokens=3)}, chunks=("ab", "", "cd"))
    ticket = make_ticket([1], stream=True)
    admit(worker, ticket)
    worker._advance()
    assert engine.streamed == [1] and not engine.waves and engine.running_seen == [1]
    events = drain(ticket)
    assert kinds(events) == ["accepted", "delta", "delta", "delta", "done"]  # the empty chunk sends nothing
    # The finish sends the rest the chunks did not ("ef"), and the ticket counts it as sent.
    assert [e.text for e in events[1:4]] == ["ab", "cd", "ef"] and ticket.sent_text == "abcdef"
    assert worker.stats.records == [(1.0, 3)] and ticket.compute_s == 1.0


def test_a_stream_with_stop_strings_or_company_runs_in_a_wave():
    engine, worker = diffusion({1: completion("a; b"), 2: completion("c")}, chunks=("x",))
    admit(worker, make_ticket([1], stream=True, stop=(";",)))
    worker._advance()
    admit(worker, make_ticket([1], stream=True), make_ticket([2], stream=True))
    worker._advance()
    assert not engine.streamed and engine.waves == [[1], [1, 2]]


def test_a_stream_cancelled_midway_stops_and_gets_no_answer(clock):
    engine, worker = diffusion({1: completion("abcd")}, chunks=("ab", "cd"))
    ticket = make_ticket([1], stream=True)
    engine.on_chunk = ticket.cancelled.set
    admit(worker, ticket)
    assert worker._advance()
    assert kinds(drain(ticket)) == ["accepted", "delta"] and worker.stats.records == [(1.0, 0)]


def test_a_failure_fails_the_wave_and_keeps_the_queue():
    _, worker = diffusion({1: completion("a")})
    tickets = [make_ticket([1]) for _ in range(3)]
    admit(worker, *tickets)
    worker._wave = tickets[:1]
    worker._pending = tickets[1:]
    error = APIError(500, "boom")
    worker._fail_step(error)
    assert drain(tickets[0])[-1] == Event("failed", error=error)
    assert all(Event("failed", error=error) not in drain(t) for t in tickets[1:])
    assert worker._wave == [] and worker._pending == tickets[1:]


def test_a_failure_outside_a_wave_fails_the_queue():
    _, worker = diffusion({1: completion("a")})
    tickets = [make_ticket([1]) for _ in range(2)]
    admit(worker, *tickets)
    error = APIError(500, "boom")
    worker._fail_step(error)
    assert all(drain(t)[-1] == Event("failed", error=error) for t in tickets)
    assert worker._wave == [] and worker._pending == [] and not worker._advance()


# --- shared by every worker ---

@pytest.mark.parametrize(("stop", "holdback"), [((), 0), (("x",), 0), (("ab", "abcd"), 3), (("", "xy"), 1)])
def test_a_ticket_holds_back_one_less_than_its_longest_stop_string(stop, holdback):
    ticket = make_ticket([1], stop=stop)
    assert ticket.holdback == holdback and ticket.where == "messages" and not ticket.released
    assert (ticket.compute_s, ticket.tokens_seen, ticket.sent_tokens, ticket.checked_tokens) == (0, 0, 0, 0)
    assert ticket.sent_text == "" and ticket.seq is None and not ticket.cancelled.is_set()


def test_a_ticket_refusal_names_messages_unless_told_otherwise():
    request = GenerationRequest([1])
    assert Ticket(request, False, (), ClosedLoop()).where == "messages"


def test_an_event_for_a_closed_loop_is_dropped():
    ticket = make_ticket([1], loop=ClosedLoop())
    ticket.emit(Event("done"))
    assert ticket.events.empty()


def test_a_schema_refusal_names_response_format_and_any_other_the_field():
    schema = invalid(InvalidRequestError("schema: arrays are not slotted"), "messages")
    assert (schema.status, schema.code, schema.param) == (400, SCHEMA_UNSUPPORTED, "response_format")
    assert schema.message == "schema: arrays are not slotted"
    other = invalid(InvalidRequestError("max_tokens must be at least 1"), "prompt")
    assert (other.status, other.code, other.param) == (400, None, "prompt")
    assert other.message == "max_tokens must be at least 1"


@pytest.mark.parametrize(("text", "stop", "cut"), [
    ("abc END def STOP", ("STOP", "END"), 4), ("abc", ("x",), None), ("abc", ("", "c"), 2), ("abc", (), None),
    ("END", ("END",), 0), ("a;b;c", (";",), 1)])
def test_apply_stop_finds_the_first_stop_string(text, stop, cut):
    assert apply_stop(text, stop) == cut


@pytest.mark.parametrize(("sent", "text", "deltas"), [
    ("ab", "abcd", ["cd"]), ("ab", "ab", []), ("ab", "xyz", []), ("", "abc", ["abc"])])
def test_the_last_delta_is_what_was_not_yet_sent(sent, text, deltas):
    worker = DiffusionWorker("diffusion", FakeDiffusion({}), None, RecordingStats())  # type: ignore[arg-type]
    ticket = make_ticket([1], stream=True)
    ticket.sent_text = sent
    answer = completion(text)
    worker._finish(ticket, answer)
    events = drain(ticket)
    assert [e.text for e in events if e.kind == "delta"] == deltas and events[-1] == Event("done", completion=answer)
    quiet = make_ticket([1])
    worker._finish(quiet, answer)
    assert drain(quiet) == [Event("done", completion=answer)]


def test_the_base_worker_leaves_every_engine_step_to_its_subclass():
    worker = EngineWorker("x", None, None, RecordingStats())  # type: ignore[arg-type]
    for method, args in ((worker.running, ()), (worker._admit, (None,)), (worker._drop_cancelled, ()),
                         (worker._advance, ()), (worker._fail_step, (None,))):
        with pytest.raises(NotImplementedError):
            method(*args)
    assert (worker.failures, worker.last_failure, worker.name) == (0, None, "x")
    assert worker._thread.name == "nowait-engine-x" and worker._thread.daemon


def test_stop_ends_the_thread():
    _, worker = diffusion({})
    worker.start()
    worker.stop(timeout_s=30)
    assert not worker._thread.is_alive()
    worker.poke()
    assert worker._wake.is_set()


def test_a_diffusion_worker_is_named_after_its_engine():
    worker = DiffusionWorker("wave", FakeDiffusion({}), None, RecordingStats())  # type: ignore[arg-type]
    assert worker.name == "wave" and worker._thread.name == "nowait-engine-wave"


def test_an_engine_that_answers_fewer_requests_than_its_wave_fails_the_step():
    """A wave answered short is an engine bug: the step raises (and the thread fails the wave)
    instead of leaving a request without an answer until its timeout."""
    engine, worker = diffusion({1: completion("a"), 2: completion("b")})
    admit(worker, make_ticket([1]), make_ticket([2]))
    engine.generate = lambda requests: [completion("a")]
    with pytest.raises(ValueError):
        worker._advance()
