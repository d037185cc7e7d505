"""Continuous-batching scheduler, driven without a model: caps, FIFO admission, no starvation."""

from __future__ import annotations

import random

import pytest

from nowait.engines.ar.scheduler import QueueFullError, Scheduler, SchedulerConfig
from nowait.engines.ar.sequence import Sequence, SequenceStatus
from nowait.engines.base import GenerationRequest, SamplingParams


def make_seq(seq_id: int, prompt: int, max_tokens: int) -> Sequence:
    request = GenerationRequest(list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))
    return Sequence(seq_id, request, frozenset({0}), capacity=10_000, generator=None)


def run_step(scheduler: Scheduler, log: list) -> list[Sequence]:
    """What the engine does with a batch, minus the model: cache the chunk, emit a token."""
    batch = scheduler.schedule()
    if batch is None:
        return []
    log.append(batch)
    for seq, chunk in zip(batch.seqs, batch.chunks, strict=True):
        if batch.kind == "prefill":
            seq.num_cached += chunk
            if seq.is_prefilling:
                continue
        else:
            seq.num_cached += 1
        seq.append_token(7, 1.0, 0.0)
    finished = [s for s in batch.seqs if s.is_finished]
    scheduler.retire(finished)
    return finished


def check_caps(scheduler: Scheduler, batch) -> None:
    config = scheduler.config
    assert len(scheduler.running) <= config.max_num_seqs
    assert len(batch.seqs) <= config.max_num_seqs
    assert batch.num_positions <= config.max_num_batched_tokens


def test_caps_hold_and_every_request_finishes_in_arrival_order():
    rng = random.Random(0)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config)
    seqs = [make_seq(i, rng.randint(1, 150), rng.randint(1, 12)) for i in range(40)]
    admitted: list[int] = []
    log: list = []
    pending = list(seqs)
    for step in range(10_000):
        if pending and step % 3 == 0:  # requests keep arriving while others run
            scheduler.add(pending.pop(0))
        running_before = {s.seq_id for s in scheduler.running}
        run_step(scheduler, log)
        if log:
            check_caps(scheduler, log[-1])
            admitted += [s.seq_id for s in log[-1].seqs if s.seq_id not in running_before
                         and log[-1].kind == "prefill" and s.seq_id not in admitted]
        if not pending and not scheduler.has_work():
            break
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert admitted == sorted(admitted)  # first come, first served: nobody is overtaken
    assert all(len(s.output_ids) == s.max_tokens for s in seqs)


def test_prefill_comes_before_decode_and_long_prompts_are_chunked():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
    short, long = make_seq(0, 4, 5), make_seq(1, 40, 5)
    scheduler.add(short)
    log: list = []
    run_step(scheduler, log)
    assert log[-1].kind == "prefill" and log[-1].seqs == [short]
    run_step(scheduler, log)
    assert log[-1].kind == "decode"
    scheduler.add(long)
    for _ in range(3):  # 40 prompt tokens in chunks of at most 16, before any decode
        run_step(scheduler, log)
        assert log[-1].kind == "prefill" and log[-1].seqs == [long]
        assert log[-1].num_positions <= 16
    assert not long.is_prefilling and len(long.output_ids) == 1
    run_step(scheduler, log)
    assert log[-1].kind == "decode" and set(log[-1].seqs) == {short, long}


def test_a_request_that_does_not_fit_yet_is_not_overtaken():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))
    big, small = make_seq(0, 30, 2), make_seq(1, 2, 2)
    first = make_seq(2, 10, 2)
    for seq in (first, big, small):
        scheduler.add(seq)
    batch = scheduler.schedule()
    # first (10) + big (30) padded to 2 x 30 > 32: big waits, and small may not jump it.
    assert batch.seqs == [first]
    assert list(scheduler.waiting) == [big, small]


def test_back_pressure_when_rows_and_queue_are_full():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_waiting=1))
    seqs = [make_seq(i, 3, 50) for i in range(3)]
    scheduler.add(seqs[0])
    log: list = []
    run_step(scheduler, log)
    scheduler.add(seqs[1])
    run_step(scheduler, log)
    assert len(scheduler.running) == 2
    scheduler.add(seqs[2])
    with pytest.raises(QueueFullError):
        scheduler.add(make_seq(9, 3, 1))
    for _ in range(5):  # no free row: seqs[2] waits while the others decode
        run_step(scheduler, log)
        assert log[-1].kind == "decode" and seqs[2].status is SequenceStatus.WAITING


def test_max_waiting_counts_only_requests_beyond_the_free_rows():
    """max_waiting=0 on an idle engine still takes a request per free row: each waits only for
    the next step, which gives it a row."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_waiting=0))
    first, second = make_seq(0, 3, 5), make_seq(1, 3, 5)
    scheduler.add(first)
    scheduler.add(second)
    with pytest.raises(QueueFullError):
        scheduler.add(make_seq(2, 3, 5))
    run_step(scheduler, [])
    assert first.status is not SequenceStatus.WAITING and second.status is not SequenceStatus.WAITING


def test_generate_past_the_queue_withdraws_what_it_submitted(codec):
    from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
    from tests.conftest import build_model

    engine = AutoregressiveEngine(build_model(0, vocab_size=codec.vocab_size), codec,
                                  EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_waiting=1))
    requests = [GenerationRequest([5, 6, 7], SamplingParams(max_tokens=3)) for _ in range(4)]
    with pytest.raises(QueueFullError):
        engine.generate(requests)
    assert not engine.has_unfinished() and not engine._completed
    assert len(engine.generate(requests[:3])) == 3  # two rows and one waiting: taken


@pytest.mark.parametrize(("config", "message"), [
    (SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(config)
