"""The batch store's rules on both databases (SQLite file, PostgreSQL): two `BatchStore`s on one
database stand for two replicas. Claims at once are disjoint, an expired lease is claimed again,
a line is answered once, a batch finalized once, counts exact, cancellation and expiry seen by
the other store."""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nowait.gateway.batch_store import BatchStore
from nowait.store.database import PostgresDatabase
from nowait.store.url import StoreError, parse_store_url

LONG_LEASE_S = 60.0


@pytest.fixture(params=["sqlite", "postgresql"])
def replicas(request, tmp_path):
    """A factory of stores on one database: each call is another replica's store."""
    opened: list[BatchStore] = []
    databases = []
    if request.param == "postgresql":
        url = parse_store_url(request.getfixturevalue("postgres_url"))

    def open_store() -> BatchStore:
        if request.param == "sqlite":
            store = BatchStore(tmp_path / "batches.sqlite")
        else:
            databases.append(PostgresDatabase(url, max_connections=8))
            store = BatchStore(databases[-1])
        opened.append(store)
        return store
    yield open_store
    for store in opened:
        store.close()
    for database in databases:
        database.close()


def started_batch(store: BatchStore, lines: int, prefix: str = "doc") -> str:
    """A batch in_progress with `lines` lines, custom_ids `{prefix}-{n}`."""
    file = store.create_file("in.jsonl", "batch", b"{}\n")
    batch = store.create_batch(file.id, "/v1/chat/completions", "24h", None)
    body = json.dumps({"model": "nowait", "messages": []})
    assert store.start(batch.id, [(n, f"{prefix}-{n}", body) for n in range(1, lines + 1)])
    return batch.id


def answer_all(store: BatchStore, batch_id: str, owner: str) -> None:
    for line, _custom_id, _body in store.claim(batch_id, owner, 10_000, LONG_LEASE_S):
        assert store.answer(batch_id, line, 200, {"line": line}, f"req-{line}")


def output_ids(store: BatchStore, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    return [json.loads(row)["custom_id"] for row in store.file_content(file_id).decode().splitlines()]


def test_claims_by_two_replicas_at_once_are_disjoint(replicas):
    a, b = replicas(), replicas()
    batch_id = started_batch(a, 200)
    claimed: dict[str, list[int]] = {}
    start = threading.Barrier(8)

    def claimer(store: BatchStore, owner: str) -> None:
        start.wait()
        mine = claimed.setdefault(owner, [])
        while batch := store.claim(batch_id, owner, 5, LONG_LEASE_S):
            mine.extend(line for line, _, _ in batch)

    with ThreadPoolExecutor(8) as pool:
        for i in range(8):
            pool.submit(claimer, (a, b)[i % 2], f"replica-{i % 2}/{i}")
    every = [line for lines in claimed.values() for line in lines]
    assert sorted(every) == list(range(1, 201))  # every line once, none twice
    by_replica = {r: sum(len(v) for k, v in claimed.items() if k.startswith(r)) for r in ("replica-0", "replica-1")}
    if a.db.dialect == "postgresql":  # SKIP LOCKED: both took part (SQLite's file lock may let one win all)
        assert all(by_replica.values()), by_replica
    assert b.claim(batch_id, "late", 10, LONG_LEASE_S) == []  # all leased


def test_an_expired_lease_is_claimed_by_another_replica_and_a_renewed_one_is_not(replicas):
    a, b = replicas(), replicas()
    batch_id = started_batch(a, 4)
    assert [line for line, _, _ in a.claim(batch_id, "a/1", 2, 1.5)] == [1, 2]  # 1.5 s: a loaded machine's margin
    assert [line for line, _, _ in b.claim(batch_id, "b/1", 10, LONG_LEASE_S)] == [3, 4]
    assert b.claim(batch_id, "b/1", 10, LONG_LEASE_S) == []  # line 1 and 2 are a's while its lease lasts
    assert a.renew(batch_id, "a/1", [2], LONG_LEASE_S) == 1
    assert b.renew(batch_id, "b/1", [1], LONG_LEASE_S) == 0  # not b's lease
    time.sleep(1.8)  # a's lease on line 1 ran out (a "killed" replica); line 2's was renewed
    [(line, custom_id, body)] = b.claim(batch_id, "b/1", 10, LONG_LEASE_S)
    assert (line, custom_id, body["model"]) == (1, "doc-1", "nowait")
    a.release(batch_id, "a/1", [2])
    assert [line for line, _, _ in b.claim(batch_id, "b/1", 10, LONG_LEASE_S)] == [2]  # released: at once


def test_a_line_is_answered_once_even_when_two_replicas_ran_it(replicas):
    a, b = replicas(), replicas()
    batch_id = started_batch(a, 1)
    assert a.claim(batch_id, "a/1", 1, 0.2)
    time.sleep(0.4)
    assert b.claim(batch_id, "b/1", 1, LONG_LEASE_S)  # a's lease expired while it still ran the line
    assert b.answer(batch_id, 1, 200, {"by": "b"}, "req-b")
    assert not a.answer(batch_id, 1, 200, {"by": "a"}, "req-a")  # the late answer is ignored
    assert not b.answer(batch_id, 1, 500, {"by": "b again"}, "req-b2")
    assert not a.has_pending(batch_id) and a.claim(batch_id, "a/1", 1, LONG_LEASE_S) == []
    assert a.mark_finalizing(batch_id) and a.finalize(batch_id, "completed")
    [entry] = [json.loads(row) for row in a.file_content(a.get_batch(batch_id).output_file_id).splitlines()]
    assert entry["response"]["body"] == {"by": "b"} and entry["response"]["request_id"] == "req-b"


def test_two_replicas_racing_to_finalize_finalize_once(replicas):
    stores = [replicas(), replicas()]
    for _ in range(3):
        batch_id = started_batch(stores[0], 30)
        answer_all(stores[1], batch_id, "b/1")
        start = threading.Barrier(6)

        def finish(store: BatchStore, batch_id: str = batch_id, start: threading.Barrier = start) -> bool:
            start.wait()
            store.mark_finalizing(batch_id)
            return store.finalize(batch_id, "completed")

        with ThreadPoolExecutor(6) as pool:
            won = list(pool.map(finish, [stores[i % 2] for i in range(6)]))
        assert won.count(True) == 1, won
        batch = stores[1].get_batch(batch_id)
        assert batch.status == "completed" and batch.error_file_id is None
        assert sorted(output_ids(stores[0], batch.output_file_id)) == sorted(f"doc-{n}" for n in range(1, 31))
        assert not stores[0].answer(batch_id, 1, 200, {}, "late")  # nothing after the output was built


def test_request_counts_are_exact_while_two_replicas_answer(replicas):
    a, b = replicas(), replicas()
    batch_id = started_batch(a, 60)
    stop, seen, errors = threading.Event(), [], []

    def watch() -> None:
        while not stop.is_set():
            counts = b.get_batch(batch_id).request_counts
            seen.append((counts.completed, counts.failed))
            if counts.total != 60 or counts.completed + counts.failed > 60:
                errors.append(counts)

    def answer(store: BatchStore, owner: str) -> None:
        while claimed := store.claim(batch_id, owner, 3, LONG_LEASE_S):
            for line, _, _ in claimed:
                store.answer(batch_id, line, 200 if line % 4 else 429, {"line": line}, f"req-{line}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(4) as pool:
        for i in range(4):
            pool.submit(answer, (a, b)[i % 2], f"r{i}")
    stop.set()
    watcher.join()
    assert not errors
    assert all(x[0] <= y[0] and x[1] <= y[1] for x, y in itertools.pairwise(seen))  # never backwards
    counts = a.counts(batch_id)
    assert (counts.total, counts.completed, counts.failed) == (60, 45, 15)


def test_a_cancellation_on_one_replica_is_seen_by_the_other(replicas):
    a, b = replicas(), replicas()
    batch_id = started_batch(a, 5)
    claimed = b.claim(batch_id, "b/1", 2, LONG_LEASE_S)
    assert b.answer(batch_id, claimed[0][0], 200, {"ok": 1}, "req-1")
    assert a.request_cancel(batch_id)
    assert b.status(batch_id) == "cancelling" and not b.request_cancel(batch_id)
    assert b.claim(batch_id, "b/1", 10, LONG_LEASE_S) == []  # no line starts after the cancel
    assert b.answer(batch_id, claimed[1][0], 200, {"ok": 2}, "req-2")  # a line in flight is kept
    assert not b.mark_finalizing(batch_id)  # cancelling is not in_progress
    assert b.finalize(batch_id, "cancelled") and not a.finalize(batch_id, "cancelled")
    assert not a.answer(batch_id, 3, 200, {}, "req-3")
    batch = a.get_batch(batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert sorted(output_ids(a, batch.output_file_id)) == ["doc-1", "doc-2"]
    errors = [json.loads(row) for row in a.file_content(batch.error_file_id).splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"doc-{n}", "batch_cancelled")
                                                                      for n in (3, 4, 5)]


def test_a_batch_past_its_window_expires_once_and_every_replica_sees_it(replicas):
    a, b = replicas(), replicas()
    batch_id = started_batch(a, 3)
    [(line, _, _)] = a.claim(batch_id, "a/1", 1, LONG_LEASE_S)
    assert a.answer(batch_id, line, 200, {"ok": True}, "req-1")
    assert not b.expire_due(batch_id)  # 24 h to go
    a.db.transaction(lambda db: db.execute("UPDATE batches SET expires_at = expires_at - 90000 WHERE id = ?",
                                           (batch_id,)))
    with ThreadPoolExecutor(4) as pool:
        expired = list(pool.map(lambda store: store.expire_due(batch_id), [a, b, a, b]))
    assert expired.count(True) == 1, expired
    batch = a.get_batch(batch_id)
    assert batch.status == "expired" and batch.expired_at is not None and b.status(batch_id) == "expired"
    assert output_ids(b, batch.output_file_id) == ["doc-1"]
    errors = [json.loads(row) for row in b.file_content(batch.error_file_id).splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("doc-2", "batch_expired"),
                                                                      ("doc-3", "batch_expired")]
    assert not b.answer(batch_id, 2, 200, {}, "late") and not b.request_cancel(batch_id)
    assert a.claim(batch_id, "a/1", 10, LONG_LEASE_S) == []


def test_concurrent_creates_and_cancels_on_two_replicas_leave_consistent_counts(replicas):
    """Each replica creates batches and answers lines of every batch while the other cancels
    some of them; every batch ends with counts that match its files, every line once."""
    stores = [replicas(), replicas()]
    created: list[tuple[str, int, str]] = []  # batch id, lines, custom_id prefix
    lock = threading.Lock()

    def creator(index: int) -> None:
        store = stores[index]
        for k in range(6):
            lines = 5 + 3 * k
            prefix = f"r{index}-b{k}"
            batch_id = started_batch(store, lines, prefix)
            with lock:
                created.append((batch_id, lines, prefix))
            if k % 2:  # the other replica cancels every second batch, while lines are being answered
                stores[1 - index].request_cancel(batch_id)

    def answerer(index: int, done: threading.Event) -> None:
        store = stores[index]
        while True:
            finished = done.is_set()
            with lock:
                batch_ids = [batch_id for batch_id, _, _ in created]
            for batch_id in batch_ids:
                if store.status(batch_id) not in ("in_progress", "cancelling"):
                    continue
                for line, _, _ in store.claim(batch_id, f"r{index}", 2, LONG_LEASE_S):
                    store.answer(batch_id, line, 200, {"line": line}, f"req-{line}")
                status = store.status(batch_id)
                if status == "in_progress" and store.mark_finalizing(batch_id):
                    status = "finalizing"
                if status in ("finalizing", "cancelling"):
                    store.finalize(batch_id, "completed" if status == "finalizing" else "cancelled")
            if finished and not store.unfinished():
                return

    done = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        answering = [pool.submit(answerer, i, done) for i in (0, 1)]
        for future in [pool.submit(creator, i) for i in (0, 1)]:
            future.result()
        done.set()
        for future in answering:
            future.result()
    assert len(created) == 12
    listed = [{b.id: (b.status, b.request_counts) for b in store.list_batches(limit=100)} for store in stores]
    assert listed[0] == listed[1]
    for batch_id, lines, prefix in created:
        batch = stores[0].get_batch(batch_id)
        assert batch.status in ("completed", "cancelled"), batch.status
        counts = batch.request_counts
        outputs = output_ids(stores[1], batch.output_file_id)
        unanswered = output_ids(stores[1], batch.error_file_id)
        assert counts.total == lines and counts.failed == 0
        assert counts.completed == len(outputs) == len(set(outputs))
        assert sorted(outputs + unanswered) == sorted(f"{prefix}-{n}" for n in range(1, lines + 1))
        if batch.status == "completed":
            assert unanswered == [] and counts.completed == lines



def test_a_database_at_a_newer_batches_schema_is_refused_and_an_older_one_brought_up_to_date(replicas):
    first = replicas()
    batch_id = started_batch(first, 3)
    first.db.transaction(lambda db: db.execute("UPDATE nowait_schema SET version = 0 WHERE component = 'batches'"))
    again = replicas()  # its steps run again: they keep what is there
    assert again.db.query("SELECT version FROM nowait_schema WHERE component = 'batches'")[0]["version"] == 1
    assert again.counts(batch_id).total == 3
    first.db.transaction(lambda db: db.execute("UPDATE nowait_schema SET version = 99 WHERE component = 'batches'"))
    with pytest.raises(StoreError, match="batches schema is at version 99, newer than this nowait's 1"):
        replicas()
