"""The batch runner's line loop (`_answer_lines`) against a real SQLite batch store, fast enough
for mutmut: the leases of the lines being answered are renewed while they run, and the batch's
status is read once per POLL_S, not once per line (each read is a round trip to a shared store).
The helpers are tests/test_batches_mutants.py's."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

import nowait.gateway.batches as batches
from nowait.gateway.batch_store import BatchStore
from nowait.gateway.batches import BatchRunner
from tests.test_batches_mutants import REAL_SLEEP, Executor, Sleeps, answers_of, new_batch


@pytest.fixture
def store(tmp_path):
    opened = BatchStore(tmp_path / "batches.sqlite")
    yield opened
    opened.close()


def recorded(monkeypatch, store, name: str) -> list[tuple]:
    """The arguments of every call to the store's method `name`, which still runs."""
    real, calls = getattr(store, name), []

    def record(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(store, name, record)
    return calls


async def both_lines_hanging(store, batch_id: str) -> tuple[asyncio.Task, asyncio.Event]:
    """A runner of two lanes processing the batch, its first two lines held until the gate opens."""
    gate = asyncio.Event()
    execute = Executor(gate=gate)
    task = asyncio.create_task(BatchRunner(store, execute, 2, replica="r1")._process(batch_id))
    while execute.running < 2:
        await REAL_SLEEP(0.005)
    return task, gate


def test_the_leases_of_the_lines_being_answered_are_renewed_for_this_batch(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 3)
    renewed = recorded(monkeypatch, store, "renew")

    async def main() -> BatchRunner:
        gate = asyncio.Event()
        runner = BatchRunner(store, Executor(gate=gate), 2, replica="r1", lease_s=3.0)
        task = asyncio.create_task(runner._process(batch_id))
        while not any(args[2] == [1, 2] for args in renewed):  # every lease_s / 3 (scaled: 10 ms)
            await REAL_SLEEP(0.005)
        gate.set()
        await task
        return runner
    runner = asyncio.run(asyncio.wait_for(main(), 10))
    assert (batch_id, runner.lease_owner, [1, 2], 3.0) in renewed
    assert store.status(batch_id) == "completed"


def test_the_batch_status_is_read_once_per_poll_not_once_per_line(store, monkeypatch):
    Sleeps(monkeypatch)
    monkeypatch.setattr(batches, "POLL_S", 30.0)  # no poll falls due during the run
    batch_id = new_batch(store, 12)
    real = store.status
    reads = recorded(monkeypatch, store, "status")
    asyncio.run(asyncio.wait_for(BatchRunner(store, Executor(), 1, replica="r1")._process(batch_id), 30))
    assert real(batch_id) == "completed"
    # _process reads it before and after the loop; the loop once, at its start
    assert len(reads) <= 4, reads


def test_lines_are_leased_for_lease_s_and_a_line_waiting_out_a_429_keeps_its_lease(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 2)
    real, released, leases = store.release, [], []

    def release(*args):
        released.append(args)
        return real(*args)
    monkeypatch.setattr(store, "release", release)

    async def execute(endpoint, body, request_id, owner):
        if not leases:
            leases.extend(store.db.query("SELECT lease_expires - ? AS left FROM batch_lines", (time.time(),)))
            return 429, {"error": {"code": "rate_limit_exceeded"}}, 1.0
        return 200, {"n": body["n"]}, None
    asyncio.run(asyncio.wait_for(BatchRunner(store, execute, 2, replica="r1", lease_s=300.0)._process(batch_id), 30))
    assert [round(row["left"] / 10) for row in leases] == [30, 30]  # both lines, leased for 300 s from now
    assert released == [] and store.status(batch_id) == "completed"


def test_a_batch_cancelled_while_lines_run_is_seen_within_a_poll_and_those_lines_are_still_answered(store, monkeypatch):
    Sleeps(monkeypatch)
    monkeypatch.setattr(batches, "POLL_S", 0.05)
    batch_id = new_batch(store, 3)
    reads = recorded(monkeypatch, store, "status")

    async def main() -> None:
        task, gate = await both_lines_hanging(store, batch_id)
        assert store.request_cancel(batch_id)
        seen = len(reads)
        for _ in range(400):  # the lines still hang: the loop looks again within a poll
            await REAL_SLEEP(0.005)
            if len(reads) > seen:
                break
        assert len(reads) > seen
        await REAL_SLEEP(0.06)
        gate.set()
        await task
    asyncio.run(asyncio.wait_for(main(), 30))
    answers = {line["custom_id"]: line for line in answers_of(store, batch_id).values()}
    assert [answers[f"c{n}"].get("response", {}).get("status_code") for n in (1, 2)] == [200, 200]
    assert answers["c3"]["error"]["code"] == "batch_cancelled" and store.status(batch_id) == "cancelled"


def test_a_slot_freed_by_one_line_is_refilled_while_another_line_still_runs(store, monkeypatch):
    Sleeps(monkeypatch)
    monkeypatch.setattr(batches, "POLL_S", 30.0)
    batch_id = new_batch(store, 4)
    hung, calls = asyncio.Event(), []

    async def execute(endpoint, body, request_id, owner):
        calls.append(body["n"])
        if body["n"] == 1:
            await hung.wait()
        return 200, {"n": body["n"]}, None

    async def main() -> None:
        task = asyncio.create_task(BatchRunner(store, execute, 2, replica="r1")._process(batch_id))
        for _ in range(400):
            await REAL_SLEEP(0.005)
            if len(calls) == 4:
                break
        assert sorted(calls) == [1, 2, 3, 4]  # lines 3 and 4 did not wait for line 1
        hung.set()
        await task
    asyncio.run(asyncio.wait_for(main(), 30))
    assert store.status(batch_id) == "completed"


def test_the_warnings_of_a_failed_renewal_or_answer_keep_their_batch_and_traceback(store, monkeypatch, caplog):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 1)
    store.start(batch_id, [(1, "c1", json.dumps({"n": 1}))])
    failures = [RuntimeError("store away")]

    def fails(*args):
        if failures:
            raise failures.pop(0)
        return 1
    runner = BatchRunner(store, Executor(), 1, replica="r1", lease_s=3.0)

    async def renew_once() -> None:
        task = asyncio.create_task(runner._renew_leases(batch_id, {1: None}))
        while not caplog.records:
            await REAL_SLEEP(0.001)
        task.cancel()
    monkeypatch.setattr(store, "renew", fails)
    with caplog.at_level(logging.WARNING, logger="nowait.gateway"):
        asyncio.run(renew_once())
        failures.append(RuntimeError("store away"))
        real = store.answer
        monkeypatch.setattr(store, "answer", lambda *args: fails() and real(*args))
        asyncio.run(runner._record(batch_id, 1, 200, {"ok": True}, "req-1"))
    assert [(r.getMessage(), type(r.exc_info[1])) for r in caplog.records] == [
        (f"could not renew the leases of batch {batch_id}'s lines", RuntimeError),
        (f"could not store the answer of batch {batch_id} line 1: retrying", RuntimeError)]


def test_a_runner_stopped_mid_batch_while_the_store_is_away_still_stops(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 2)

    def release(*args):
        raise RuntimeError("store away")
    monkeypatch.setattr(store, "release", release)

    async def main() -> None:
        task, _ = await both_lines_hanging(store, batch_id)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # the leases expire instead of being given back
            await task
    asyncio.run(asyncio.wait_for(main(), 30))
