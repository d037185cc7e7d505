"""The batch runner against a real SQLite batch store and a stand-in executor, fast enough for
mutmut: what each line is sent as, validation that fails, expiry and cancellation, the in-flight
bound, 429s retried (and the ones that are answers), a store that fails a write, lease renewal
and release, the failure count that fails a batch, and the lanes per tenant. Sleeps are scaled
down 100 times and recorded, so each wait the runner asks for is checked without being waited."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket

import pytest

import nowait.gateway.batches as batches
from nowait.gateway.batch_store import BatchOwner, BatchStore
from nowait.gateway.batches import BatchRunner

ENDPOINT = "/v1/chat/completions"
REAL_SLEEP = asyncio.sleep  # the stand-in executor's own yields are not the runner's waits


class Sleeps:
    """asyncio.sleep scaled down 100 times; the delays asked for, in order."""

    def __init__(self, monkeypatch) -> None:
        self.asked: list[float] = []
        real = asyncio.sleep

        async def sleep(delay, result=None):
            self.asked.append(delay)
            await real(delay / 100)
            return result
        monkeypatch.setattr(batches.asyncio, "sleep", sleep)


class Executor:
    """Answers each call from `answers` (a list per line number, last one repeated), recording
    the calls and how many ran at once; `gate`, when set, holds every call until it opens."""

    def __init__(self, answers: dict[int, list[tuple]] | None = None, gate: asyncio.Event | None = None) -> None:
        self.answers, self.gate = answers or {}, gate
        self.calls: list[tuple] = []
        self.running = self.most = 0

    async def __call__(self, endpoint: str, body: dict, request_id: str, owner: BatchOwner):
        self.calls.append((endpoint, body, request_id, owner))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await REAL_SLEEP(0)
            queue = self.answers.get(body["n"], [(200, {"n": body["n"]}, None)])
            return queue.pop(0) if len(queue) > 1 else queue[0]
        finally:
            self.running -= 1


@pytest.fixture
def store(tmp_path):
    opened = BatchStore(tmp_path / "batches.sqlite")
    yield opened
    opened.close()


def request_line(n: int, url: str = ENDPOINT) -> str:
    return json.dumps({"custom_id": f"c{n}", "method": "POST", "url": url, "body": {"n": n}})


def new_batch(store: BatchStore, lines: int, owner: BatchOwner = BatchOwner("default")) -> str:
    content = "".join(request_line(n) + "\n" for n in range(1, lines + 1)).encode()
    file = store.create_file("in.jsonl", "batch", content, tenant=owner.tenant)
    return store.create_batch(file.id, ENDPOINT, "24h", None, owner).id


def answers_of(store: BatchStore, batch_id: str) -> dict[str, dict]:
    batch = store.get_batch(batch_id)
    entries = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            entries += [json.loads(row) for row in store.file_content(file_id).splitlines()]
    return {e["custom_id"]: e for e in entries}


def test_a_replica_is_named_by_its_host_and_process_and_its_leases_by_this_runner(store):
    assert batches.default_replica_name() == f"{socket.gethostname()}:{os.getpid()}"
    runner = BatchRunner(store, Executor(), 2, replica="r1")
    assert re.fullmatch(r"r1/[0-9a-f]{8}", runner.lease_owner) and runner.lease_s == 30.0
    other = BatchRunner(store, Executor(), 2, replica="r1", lease_s=4.0)
    assert other.lease_owner != runner.lease_owner and other.lease_s == 4.0
    assert BatchRunner(store, Executor(), 2).lease_owner.startswith(batches.default_replica_name() + "/")


def test_a_batch_is_validated_run_as_its_owner_and_completed(store, monkeypatch):
    Sleeps(monkeypatch)
    owner = BatchOwner("teamA", "key_9")
    batch_id = new_batch(store, 3, owner)
    execute = Executor({2: [(400, {"error": {"code": "bad"}}, None)]})
    asyncio.run(BatchRunner(store, execute, 2, replica="r1")._process(batch_id))
    hexid = batch_id.removeprefix("batch_")
    assert sorted(execute.calls, key=lambda c: c[2]) == [
        (ENDPOINT, {"n": n}, f"req_{hexid}_{n}", owner) for n in (1, 2, 3)]
    batch = store.get_batch(batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 2 and batch.request_counts.failed == 1
    answers = answers_of(store, batch_id)
    assert answers["c1"]["response"] == {"status_code": 200, "request_id": f"req_{hexid}_1", "body": {"n": 1}}
    assert answers["c2"]["response"]["status_code"] == 400


def test_a_batch_whose_input_is_bad_or_gone_fails_with_why(store, monkeypatch):
    Sleeps(monkeypatch)
    file = store.create_file("in.jsonl", "batch", (request_line(1, "/v1/other") + "\n").encode())
    bad = store.create_batch(file.id, ENDPOINT, "24h", None).id
    gone = store.create_batch("file-gone", ENDPOINT, "24h", None).id
    theirs = store.create_batch(file.id, ENDPOINT, "24h", None, BatchOwner("teamB")).id  # not its tenant's file
    execute = Executor()
    runner = BatchRunner(store, execute, 2, replica="r1")
    for batch_id in (bad, gone, theirs):
        asyncio.run(runner._process(batch_id))
    assert execute.calls == []
    assert [(e.code, e.line) for e in store.get_batch(bad).errors.data] == [("mismatched_endpoint", 1)]
    [error] = store.get_batch(gone).errors.data
    assert (error.code, error.message) == ("invalid_input_file", "input file file-gone no longer exists")
    assert store.get_batch(theirs).errors.data[0].message == f"input file {file.id} no longer exists"
    assert {store.status(b) for b in (bad, gone, theirs)} == {"failed"}


def test_a_batch_past_its_window_expires_without_running_a_line(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 2)
    store.db.transaction(lambda db: db.execute("UPDATE batches SET expires_at = 1 WHERE id = ?", (batch_id,)))
    execute = Executor()
    asyncio.run(BatchRunner(store, execute, 2, replica="r1")._process(batch_id))
    assert execute.calls == [] and store.status(batch_id) == "expired"
    assert {e["error"]["code"] for e in answers_of(store, batch_id).values()} == {"batch_expired"}


def test_a_cancelling_batch_is_finalized_cancelled_with_no_line_run(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 2)
    runner, execute = BatchRunner(store, Executor(), 2, replica="r1"), None
    store.start(batch_id, [(1, "c1", json.dumps({"n": 1}))])
    assert store.request_cancel(batch_id)
    asyncio.run(runner._process(batch_id))
    assert runner.execute.calls == [] and store.status(batch_id) == "cancelled" and execute is None
    assert answers_of(store, batch_id)["c1"]["error"]["code"] == "batch_cancelled"


def test_at_most_max_concurrent_lines_are_in_flight_and_all_get_answered(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 7)

    async def main() -> Executor:
        gate = asyncio.Event()
        execute = Executor(gate=gate)
        task = asyncio.create_task(BatchRunner(store, execute, 3, replica="r1")._process(batch_id))
        for _ in range(200):
            await asyncio.sleep(0.5)  # scaled: 5 ms
            if execute.running == 3:
                break
        held = store.db.query("SELECT COUNT(*) AS n FROM batch_lines WHERE lease_owner IS NOT NULL")[0]["n"]
        assert (execute.running, held) == (3, 3)
        gate.set()
        await task
        return execute
    execute = asyncio.run(main())
    assert execute.most == 3 and len(execute.calls) == 7 and store.status(batch_id) == "completed"


def test_a_429_is_retried_after_its_retry_after_and_a_quota_429_or_a_503_is_an_answer(store, monkeypatch):
    sleeps = Sleeps(monkeypatch)
    batch_id = new_batch(store, 3)
    quota = (429, {"error": {"code": "insufficient_quota"}}, 7.0)
    execute = Executor({1: [(429, {"error": {"code": "rate_limit_exceeded"}}, 3.0), (429, {}, None),
                            (200, {"n": 1}, None)], 2: [quota], 3: [(503, {"error": {"code": "x"}}, 9.0)]})
    asyncio.run(BatchRunner(store, execute, 1, replica="r1")._process(batch_id))
    assert [c[1]["n"] for c in execute.calls] == [1, 1, 1, 2, 3]
    assert [d for d in sleeps.asked if d != 10.0][:2] == [3.0, 0.5]  # 10 s: the lease renewer's
    answers = answers_of(store, batch_id)
    assert [answers[f"c{n}"]["response"]["status_code"] for n in (1, 2, 3)] == [200, 429, 503]


def test_a_line_waiting_out_a_429_stops_when_its_batch_is_cancelled_and_gives_its_lease_back(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 1)
    store.start(batch_id, [(1, "c1", json.dumps({"n": 1}))])
    runner = BatchRunner(store, Executor(), 1, replica="r1")
    cancelled = []

    async def execute(endpoint, body, request_id, owner):
        if not cancelled:
            cancelled.append(store.request_cancel(batch_id))
        return 429, {}, 1.0
    runner.execute = execute
    assert store.claim(batch_id, runner.lease_owner, 1, 60)
    asyncio.run(runner._answer(batch_id, ENDPOINT, 1, {"n": 1}, BatchOwner("default")))
    [row] = store.db.query("SELECT status_code, lease_owner FROM batch_lines")
    assert cancelled == [True] and (row["status_code"], row["lease_owner"]) == (None, None)


def test_an_answer_the_store_refuses_is_retried_until_it_is_kept(store, monkeypatch, caplog):
    sleeps = Sleeps(monkeypatch)
    batch_id = new_batch(store, 1)
    store.start(batch_id, [(1, "c1", json.dumps({"n": 1}))])
    real, failures = store.answer, [RuntimeError("store away"), RuntimeError("still away")]

    def answer(*args):
        if failures:
            raise failures.pop(0)
        return real(*args)
    monkeypatch.setattr(store, "answer", answer)
    runner = BatchRunner(store, Executor(), 1, replica="r1")
    with caplog.at_level(logging.WARNING, logger="nowait.gateway"):
        asyncio.run(runner._record(batch_id, 1, 200, {"ok": True}, "req-1"))
    assert sleeps.asked == [1.0, 1.0] and failures == []
    assert [r.getMessage() for r in caplog.records] == [
        f"could not store the answer of batch {batch_id} line 1: retrying"] * 2
    assert store.db.query("SELECT request_id FROM batch_lines")[0]["request_id"] == "req-1"


def test_a_cancelled_record_stops_retrying(store, monkeypatch):
    Sleeps(monkeypatch)

    def answer(*args):
        raise asyncio.CancelledError
    monkeypatch.setattr(store, "answer", answer)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(BatchRunner(store, Executor(), 1, replica="r1")._record("batch_x", 1, 200, {}, "r"))


def test_leases_of_lines_in_flight_are_renewed_every_third_of_a_lease_through_store_errors(store, monkeypatch):
    sleeps = Sleeps(monkeypatch)
    renewed: list[tuple] = []

    def renew(*args):
        renewed.append(args)
        if len(renewed) == 1:
            raise RuntimeError("store away")
        return 1
    monkeypatch.setattr(store, "renew", renew)
    runner = BatchRunner(store, Executor(), 1, replica="r1", lease_s=6.0)

    async def main() -> None:
        task = asyncio.create_task(runner._renew_leases("batch_x", {4: None, 7: None}))
        while len(renewed) < 3:
            await REAL_SLEEP(0.001)
        task.cancel()
    asyncio.run(main())
    assert renewed[0] == ("batch_x", runner.lease_owner, [4, 7], 6.0) and len(renewed) >= 3
    assert sleeps.asked[:3] == [2.0, 2.0, 2.0]


def test_a_runner_stopped_mid_batch_gives_its_leases_back_at_once(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 3)

    async def main() -> None:
        gate = asyncio.Event()
        execute = Executor(gate=gate)
        runner = BatchRunner(store, execute, 2, replica="r1")
        task = asyncio.create_task(runner._process(batch_id))
        while execute.running < 2:
            await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    rows = store.db.query("SELECT lease_owner, status_code FROM batch_lines")
    assert [(r["lease_owner"], r["status_code"]) for r in rows] == [(None, None)] * 3


def test_lines_leased_to_another_replica_are_waited_for_and_taken_once_their_lease_ends(store, monkeypatch):
    sleeps = Sleeps(monkeypatch)
    monkeypatch.setattr(batches, "POLL_S", 0.05)
    batch_id = new_batch(store, 2)
    store.start(batch_id, [(1, "c1", json.dumps({"n": 1})), (2, "c2", json.dumps({"n": 2}))])
    assert store.claim(batch_id, "other/1", 1, 0.3)  # line 1 held by a replica that then dies
    execute = Executor()
    asyncio.run(BatchRunner(store, execute, 2, replica="r1", lease_s=0.08)._process(batch_id))
    assert sorted(c[1]["n"] for c in execute.calls) == [1, 2] and store.status(batch_id) == "completed"
    assert 0.02 in sleeps.asked  # min(POLL_S, lease_s / 4) between looks at the other's lease


def test_a_cancel_is_seen_within_a_poll_and_the_remaining_lines_are_not_run(store, monkeypatch):
    Sleeps(monkeypatch)
    monkeypatch.setattr(batches, "POLL_S", 0.05)
    batch_id = new_batch(store, 4)

    async def main() -> Executor:
        gate = asyncio.Event()
        execute = Executor(gate=gate)
        task = asyncio.create_task(BatchRunner(store, execute, 1, replica="r1")._process(batch_id))
        while not execute.running:
            await asyncio.sleep(0.5)
        assert store.request_cancel(batch_id)
        gate.set()
        await task
        return execute
    execute = asyncio.run(main())
    assert len(execute.calls) < 4 and store.status(batch_id) == "cancelled"


class FailingStore:
    """`get_batch` raises for the batch ids in `failing`; the rest is the real store."""

    def __init__(self, store: BatchStore, failing: set[str]) -> None:
        self.store, self.failing = store, failing

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get_batch(self, batch_id, tenant=None):
        if batch_id in self.failing:
            raise RuntimeError(f"cannot read {batch_id}")
        return self.store.get_batch(batch_id, tenant)


def test_a_batch_that_keeps_failing_while_validating_is_failed_after_five_passes(store, monkeypatch, caplog):
    sleeps = Sleeps(monkeypatch)
    broken, fine = new_batch(store, 1), new_batch(store, 1)
    runner = BatchRunner(FailingStore(store, {broken}), Executor(), 1, replica="r1")
    # the broken batch does not hold up the one after it; bounded, so a lane that never fails it fails here
    with caplog.at_level(logging.ERROR, logger="nowait.gateway"):
        asyncio.run(asyncio.wait_for(runner._lane("default"), 30))
    assert [r.getMessage() for r in caplog.records] == [f"batch {broken} failed in processing"] * 5
    assert store.status(fine) == "completed" and store.status(broken) == "failed"
    [error] = store.get_batch(broken).errors.data
    assert (error.code, error.message) == (
        "internal_error", f"the batch could not be processed: RuntimeError: cannot read {broken}")
    assert sleeps.asked.count(1.0) == 4 and runner._failures == {}


def test_a_failing_batch_with_accepted_lines_is_retried_and_its_count_cleared_on_success(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_id = new_batch(store, 1)
    store.start(batch_id, [(1, "c1", json.dumps({"n": 1}))])
    failing = FailingStore(store, {batch_id})
    runner = BatchRunner(failing, Executor(), 1, replica="r1")
    runner._failures[batch_id] = batches.MAX_PROCESS_FAILURES - 1
    asyncio.run(runner._after_failure(batch_id, RuntimeError("x")))
    assert runner._failures == {batch_id: 5} and store.status(batch_id) == "in_progress"
    failing.failing.clear()
    asyncio.run(runner._lane("default"))
    assert store.status(batch_id) == "completed" and runner._failures == {}


def test_a_lane_whose_store_cannot_be_read_ends(store, monkeypatch, caplog):
    def unfinished(tenant=None):
        raise RuntimeError("store away")
    monkeypatch.setattr(store, "unfinished", unfinished)
    with caplog.at_level(logging.ERROR, logger="nowait.gateway"):
        asyncio.run(BatchRunner(store, Executor(), 1, replica="r1")._lane("teamA"))
    assert [r.getMessage() for r in caplog.records] == ["batch runner could not list tenant teamA's unfinished batches"]


def test_the_runner_answers_each_tenants_batches_in_a_lane_of_its_own(store, monkeypatch, caplog):
    Sleeps(monkeypatch)
    real, failures = store.unfinished_tenants, [RuntimeError("store away")]

    def unfinished_tenants():
        if failures:
            raise failures.pop(0)
        return real()
    monkeypatch.setattr(store, "unfinished_tenants", unfinished_tenants)
    first = [new_batch(store, 2, BatchOwner(t)) for t in ("teamA", "teamB")]

    async def main() -> BatchRunner:
        runner = BatchRunner(store, Executor(), 1, replica="r1")
        await runner.start()
        for _ in range(400):
            await asyncio.sleep(1)  # scaled: 10 ms
            if all(store.status(b) == "completed" for b in first):
                break
        assert set(runner._lanes) == {"teamA", "teamB"}
        later = new_batch(store, 1, BatchOwner("teamA"))  # its lane has ended: a new one starts
        runner.wake()
        for _ in range(400):
            await asyncio.sleep(1)
            if store.status(later) == "completed":
                break
        assert runner._task.get_name() == "nowait-batch-runner"
        assert {name: lane.get_name() for name, lane in runner._lanes.items()} == {
            "teamA": "nowait-batches-teamA", "teamB": "nowait-batches-teamB"}
        await runner.stop()
        assert runner._task.cancelled()
        return runner
    with caplog.at_level(logging.ERROR, logger="nowait.gateway"):
        asyncio.run(main())
    assert {store.status(b) for b in first} == {"completed"} and failures == []
    assert "batch runner could not list the unfinished batches" in [r.getMessage() for r in caplog.records]


def test_a_tenant_has_one_lane_however_often_the_runner_looks_and_it_runs_that_tenants_batches(store, monkeypatch):
    Sleeps(monkeypatch)
    batch_ids = {tenant: new_batch(store, 2, BatchOwner(tenant)) for tenant in ("teamA", "teamB")}

    async def main() -> Executor:
        gate = asyncio.Event()
        execute = Executor(gate=gate)
        runner = BatchRunner(store, execute, 1, replica="r1")
        await runner.start()
        while execute.running < 2:
            await REAL_SLEEP(0.005)
        for _ in range(5):  # each wake lists the tenants again while their lanes still run
            runner.wake()
            await REAL_SLEEP(0.02)
        tenants = sorted(owner.tenant for _endpoint, _body, _request_id, owner in execute.calls)
        assert (execute.running, tenants) == (2, ["teamA", "teamB"])  # one line each: one lane each
        gate.set()
        while any(store.status(b) != "completed" for b in batch_ids.values()):
            await REAL_SLEEP(0.005)
        await runner.stop()
        return execute
    execute = asyncio.run(asyncio.wait_for(main(), 60))
    assert execute.most == 2 and len(execute.calls) == 4


def test_stop_cancels_every_task_and_outlives_a_lane_that_failed(store):
    async def main() -> None:
        runner = BatchRunner(store, Executor(), 1, replica="r1")

        async def failed() -> None:
            raise RuntimeError("a lane's bug")

        async def waiting() -> None:
            await asyncio.Event().wait()
        runner._lanes = {"teamA": asyncio.create_task(failed()), "teamB": asyncio.create_task(waiting())}
        await REAL_SLEEP(0)
        await runner.stop()  # no runner task yet, a lane that raised: every other one still cancelled
        assert runner._lanes["teamB"].cancelled()
    asyncio.run(main())
