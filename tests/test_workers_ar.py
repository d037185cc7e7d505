"""The AR engine's worker (gateway/workers.py) driven step by step on a tiny real engine: what
each ticket is told, what it is charged, where stop strings cut, what a cancel or a failure
frees. The answers are compared with the same engine's own `generate`. Written against mutmut's
survivors in workers.py (docs/testing.md)."""

from __future__ import annotations

import pytest

from nowait.engines.ar import AutoregressiveEngine, EngineConfig
from nowait.engines.base import Completion, GenerationRequest, SamplingParams
from nowait.gateway import workers
from nowait.gateway.errors import APIError
from nowait.gateway.workers import SCHEMA_UNSUPPORTED, ArWorker
from tests.conftest import build_model
from tests.worker_support import RecordingStats, SecondClock, drain, kinds, make_ticket, streamed

REPEATS = "Name: Ann Lee\n"  # the tiny model answers 'mamama*' then bytes of no whole character
WORDS = "Amount: 12\n"  # it answers ', ", "applicationExtract...'


@pytest.fixture(scope="module")
def model(codec):
    return build_model(0, vocab_size=codec.vocab_size)


@pytest.fixture
def clock(monkeypatch):
    fake = SecondClock()
    monkeypatch.setattr(workers, "time", fake)
    return fake


def engine_and_worker(model, codec, max_num_seqs: int = 4) -> tuple[AutoregressiveEngine, ArWorker]:
    engine = AutoregressiveEngine(model, codec, EngineConfig(max_num_seqs=max_num_seqs))
    return engine, ArWorker("ar", engine, codec, RecordingStats())


def free_run(model, codec, prompt: str, max_tokens: int = 8) -> Completion:
    request = GenerationRequest(codec.encode(prompt), SamplingParams(max_tokens=max_tokens))
    return AutoregressiveEngine(model, codec).generate([request])[0]


def run_out(worker: ArWorker, limit: int = 100) -> int:
    """Advance until the engine is idle; the number of steps."""
    steps = 0
    while worker._advance():
        steps += 1
        assert steps < limit
    return steps


def done(events) -> Completion:
    [last] = [e for e in events if e.kind == "done"]
    return last.completion


def test_a_ticket_gets_the_engines_own_answer_and_is_charged_its_steps(model, codec, clock):
    expected = free_run(model, codec, WORDS)
    _, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(WORDS), max_tokens=8)
    worker.put(ticket)
    worker._intake()
    assert kinds(drain(ticket)) == ["accepted"] and not worker._inbox
    assert worker.running() == 0  # submitted, not yet scheduled
    assert worker._advance() and worker.running() == 1
    steps = 1 + run_out(worker)
    assert steps == 8 and worker.running() == 0 and not worker._advance()
    completion = done(drain(ticket))
    assert (completion.text, completion.token_ids) == (expected.text, expected.token_ids)
    assert completion.finish_reason == expected.finish_reason == "length"  # no stop string: not cut, not "stop"
    # The clock moves one second per reading, so each step lasts one second, all of it this ticket's.
    assert ticket.compute_s == 8.0 and worker.stats.busy_s == 8.0
    assert worker.stats.tokens == len(expected.token_ids) and ticket.tokens_seen == len(expected.token_ids)


def test_tickets_in_the_same_steps_split_their_time(model, codec, clock):
    _, worker = engine_and_worker(model, codec)
    first, second = (make_ticket(codec.encode(WORDS), max_tokens=8) for _ in range(2))
    for ticket in (first, second):
        worker.put(ticket)
    worker._intake()
    run_out(worker)
    assert first.compute_s == second.compute_s == 4.0
    assert worker.stats.tokens == 16 and [e.kind for e in drain(first)] == ["accepted", "done"]


def test_a_ticket_cancelled_before_intake_never_reaches_the_engine(model, codec):
    engine, worker = engine_and_worker(model, codec)
    ticket, after = make_ticket(codec.encode(WORDS)), make_ticket(codec.encode(WORDS))
    ticket.cancelled.set()
    worker.put(ticket)
    worker.put(after)
    worker._intake()
    assert not drain(ticket) and not worker._inbox and len(engine.scheduler.waiting) == 1
    assert kinds(drain(after)) == ["accepted"]  # the one behind it is taken in the same intake


def test_a_running_ticket_cancelled_leaves_the_engine_and_the_other_finishes(model, codec):
    expected = free_run(model, codec, REPEATS)
    engine, worker = engine_and_worker(model, codec)
    gone, kept = make_ticket(codec.encode(WORDS), max_tokens=8), make_ticket(codec.encode(REPEATS), max_tokens=8)
    for ticket in (gone, kept):
        worker.put(ticket)
    worker._intake()
    worker._advance()
    worker._advance()
    gone.cancelled.set()
    worker._drop_cancelled()
    assert gone.seq.is_finished and gone.seq.finish_reason == "cancelled"
    assert worker.running() == 1 and gone.seq not in engine.scheduler.running
    run_out(worker)
    assert kinds(drain(gone)) == ["accepted"]
    assert done(drain(kept)).text == expected.text and not engine.has_unfinished()


def test_a_waiting_ticket_cancelled_is_withdrawn(model, codec):
    engine, worker = engine_and_worker(model, codec, max_num_seqs=1)
    first, waiting = make_ticket(codec.encode(WORDS)), make_ticket(codec.encode(REPEATS))
    for ticket in (first, waiting):
        worker.put(ticket)
    worker._intake()
    worker._advance()
    assert waiting.seq in engine.scheduler.waiting
    waiting.cancelled.set()
    worker._drop_cancelled()
    assert waiting.seq not in engine.scheduler.waiting and waiting.seq.finish_reason == "cancelled"
    run_out(worker)
    assert kinds(drain(waiting)) == ["accepted"] and kinds(drain(first)) == ["accepted", "done"]


def test_abort_answers_what_the_sequence_had(model, codec):
    engine, worker = engine_and_worker(model, codec, max_num_seqs=1)
    running = engine.submit(GenerationRequest(codec.encode(WORDS), SamplingParams(max_tokens=8)))
    waiting = engine.submit(GenerationRequest(codec.encode(REPEATS), SamplingParams(max_tokens=8)))
    engine.step()
    engine.step()
    withdrawn = worker._abort(waiting)
    assert (withdrawn.finish_reason, withdrawn.text, withdrawn.token_ids) == ("cancelled", "", [])
    assert withdrawn.engine == "ar"
    cut = worker._abort(running, "stop")
    assert cut.finish_reason == "stop" and cut.token_ids == running.output_ids and len(cut.token_ids) == 2
    assert cut.text == codec.decode(running.output_ids) and not engine.has_unfinished()
    finished = engine.submit(GenerationRequest(codec.encode(WORDS), SamplingParams(max_tokens=1)))
    engine.step()
    assert finished.is_finished and worker._abort(finished).token_ids == finished.output_ids
    assert worker._abort(finished) is None  # collected once


def test_a_bad_request_is_refused_alone_naming_its_field(model, codec):
    engine, worker = engine_and_worker(model, codec)
    good, empty = make_ticket(codec.encode(WORDS)), make_ticket([], where="prompt")
    schema = make_ticket(codec.encode(WORDS))
    schema.request.schema = {"type": "object"}
    for ticket in (empty, schema, good):
        worker.put(ticket)
    worker._intake()
    [refused] = drain(empty)
    assert refused.kind == "failed" and refused.error.status == 400 and refused.error.param == "prompt"
    assert refused.error.message.startswith("prompt_ids is empty") and refused.error.code is None
    [unsupported] = drain(schema)
    assert (unsupported.error.code, unsupported.error.param) == (SCHEMA_UNSUPPORTED, "response_format")
    assert kinds(drain(good)) == ["accepted"] and worker.running() == 0 and len(engine.scheduler.waiting) == 1


def test_an_unexpected_intake_error_is_a_500_for_that_request(model, codec):
    engine, worker = engine_and_worker(model, codec)

    def broken(request):
        raise ValueError("queue on fire")

    engine.submit = broken
    ticket = make_ticket(codec.encode(WORDS))
    worker.put(ticket)
    worker._intake()
    [event] = drain(ticket)
    assert event.kind == "failed" and (event.error.status, event.error.code) == (500, "engine_error")
    assert event.error.message == "engine 'ar' could not take the request: queue on fire"
    assert event.error.type == "server_error"


def test_a_stop_string_ends_the_sequence_as_soon_as_it_appears(model, codec):
    expected = free_run(model, codec, WORDS)
    assert expected.text.startswith(', ", "app')
    engine, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(WORDS), max_tokens=8, stop=("app",))
    worker.put(ticket)
    worker._intake()
    steps = run_out(worker)
    completion = done(drain(ticket))
    assert completion.text == ', ", "' and completion.finish_reason == "stop"
    assert steps == 3 and len(completion.token_ids) == 3 and not engine.has_unfinished()


def test_a_stop_string_in_the_last_token_cuts_the_answer(model, codec):
    expected = free_run(model, codec, WORDS, max_tokens=1)
    assert expected.text == ', "'
    _, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(WORDS), max_tokens=1, stop=('"',))
    worker.put(ticket)
    worker._intake()
    run_out(worker)
    completion = done(drain(ticket))
    assert (completion.text, completion.finish_reason) == (", ", "stop")


def test_a_stream_sends_the_text_as_it_grows(model, codec):
    expected = free_run(model, codec, WORDS)
    _, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(WORDS), max_tokens=8, stream=True)
    worker.put(ticket)
    worker._intake()
    sent = []
    while worker._advance():
        sent.append(streamed(drain(ticket)))
    assert sent[:3] == [', "', ', "', "application"]  # one delta per step, before the answer is done
    assert "".join(sent) == expected.text


def test_a_stream_holds_back_what_could_be_half_a_stop_string(model, codec):
    expected = free_run(model, codec, WORDS)
    _, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(WORDS), max_tokens=8, stream=True, stop=("zzz", "q"))
    worker.put(ticket)
    worker._intake()
    worker._advance()
    worker._advance()
    assert streamed(drain(ticket)) == ', ",'  # ', ", "' less the two characters a 'zzz' could start with
    run_out(worker)
    events = drain(ticket)
    assert ', ",' + streamed(events) == expected.text and events[-1].kind == "done"


def test_a_stream_waits_for_a_whole_character(model, codec):
    expected = free_run(model, codec, REPEATS)
    assert expected.text.startswith("mamama*\ufffd")
    _, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(REPEATS), max_tokens=8, stream=True)
    worker.put(ticket)
    worker._intake()
    before_done = []
    while worker._advance():
        events = drain(ticket)
        before_done += [e.text for e in events if e.kind == "delta"]
        if events and events[-1].kind == "done":
            break
    assert "".join(before_done[:-1]) == "mamama*"  # nothing of the undecodable bytes until the end
    assert "".join(before_done) == expected.text


def test_a_failure_fails_every_running_ticket_and_frees_the_engine(model, codec):
    engine, worker = engine_and_worker(model, codec)
    tickets = [make_ticket(codec.encode(WORDS)), make_ticket(codec.encode(REPEATS))]
    for ticket in tickets:
        worker.put(ticket)
    worker._intake()
    worker._advance()
    error = APIError(500, "boom")
    worker._fail_step(error)
    for ticket in tickets:
        assert drain(ticket)[-1] == workers.Event("failed", error=error)
    assert not engine.has_unfinished() and not worker._active and engine.pool.used == 0


def test_a_sequence_admitted_without_a_cache_row_is_released(model, codec):
    """A step that raised after admitting a sequence but before giving it a row leaves it running
    without one: aborting it frees nothing and answers nothing, and the engine is idle again."""
    engine, worker = engine_and_worker(model, codec)
    seq = engine.submit(GenerationRequest(codec.encode(WORDS), SamplingParams(max_tokens=4)))
    engine.scheduler.schedule()  # admitted to the running set, no forward run
    assert seq in engine.scheduler.running and seq.row < 0
    assert worker._abort(seq) is None
    assert seq.is_finished and not engine.has_unfinished() and engine.pool.used == 0


def test_queued_tickets_with_stop_strings_wait_their_turn(model, codec):
    _, worker = engine_and_worker(model, codec, max_num_seqs=1)
    tickets = [make_ticket(codec.encode(WORDS), max_tokens=8, stop=("app",)) for _ in range(2)]
    for ticket in tickets:
        worker.put(ticket)
    worker._intake()
    run_out(worker)
    assert [done(drain(t)).text for t in tickets] == [', ", "', ', ", "']


def test_a_ticket_ended_by_its_stop_string_is_done_with(model, codec):
    _, worker = engine_and_worker(model, codec)
    stopped = make_ticket(codec.encode(WORDS), max_tokens=8, stop=("app",))
    running = make_ticket(codec.encode(REPEATS), max_tokens=8)
    for ticket in (stopped, running):
        worker.put(ticket)
    worker._intake()
    for _ in range(3):
        worker._advance()
    assert kinds(drain(stopped)) == ["accepted", "done"]
    worker._fail_step(APIError(500, "boom"))  # a later failure is not this finished ticket's
    assert not drain(stopped) and kinds(drain(running)) == ["accepted", "failed"]


def test_a_failed_step_fails_the_running_ticket_and_serves_the_queued_one(model, codec):
    expected = free_run(model, codec, REPEATS)
    _, worker = engine_and_worker(model, codec, max_num_seqs=1)
    running, queued = make_ticket(codec.encode(WORDS), max_tokens=8), make_ticket(codec.encode(REPEATS), max_tokens=8)
    for ticket in (running, queued):
        worker.put(ticket)
    worker._intake()
    worker._advance()
    worker._fail_step(APIError(500, "boom"))
    assert kinds(drain(running)) == ["accepted", "failed"] and kinds(drain(queued)) == ["accepted"]
    run_out(worker)
    assert done(drain(queued)).text == expected.text


def test_a_sequence_that_cannot_be_released_is_logged_and_its_ticket_still_fails(model, codec, caplog):
    _, worker = engine_and_worker(model, codec)
    ticket = make_ticket(codec.encode(WORDS))
    worker.put(ticket)
    worker._intake()
    worker._advance()

    def broken(seq, reason="cancelled"):
        raise RuntimeError("row lost")

    worker._abort = broken
    worker._fail_step(APIError(500, "boom"))
    assert kinds(drain(ticket)) == ["accepted", "failed"] and not worker._active
    assert "engine ar: could not release a failed sequence" in caplog.messages


def test_an_unexpected_intake_error_is_logged_with_the_engine(model, codec, caplog):
    engine, worker = engine_and_worker(model, codec)

    def broken(request):
        raise ValueError("queue on fire")

    engine.submit = broken
    worker.put(make_ticket(codec.encode(WORDS)))
    worker._intake()
    assert "engine ar could not take a request" in caplog.messages


def test_a_stream_never_sends_an_empty_delta(model, codec):
    _, worker = engine_and_worker(model, codec)
    # A four-character stop string holds back three: exactly the first step's ', "'.
    ticket = make_ticket(codec.encode(WORDS), max_tokens=8, stream=True, stop=("wxyz",))
    worker.put(ticket)
    worker._intake()
    worker._advance()
    assert not drain(ticket)[1:]
    run_out(worker)
    deltas = [e.text for e in drain(ticket) if e.kind == "delta"]
    assert all(deltas) and "".join(deltas) == free_run(model, codec, WORDS).text
