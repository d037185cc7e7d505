"""The batch store method by method on SQLite (a file in tmp_path), fast enough for mutmut: every
field a row maps to, each status a statement moves from (and the ones it must not), the edges
of the request counts, leases without sleeping (a negative lease is one already expired), the
output and error files byte for byte, and a store from before tenants and leases migrated."""

from __future__ import annotations

import json
import re
import sqlite3
import time

import pytest

from nowait.gateway.batch_store import BatchOwner, BatchStore
from nowait.gateway.schemas import BatchError
from nowait.store.database import SqliteDatabase
from tests.store_support import postgres_like_sqlite

BODY = json.dumps({"model": "nowait", "messages": []})


@pytest.fixture
def store(tmp_path):
    """A store on SQLite whose rows read as PostgreSQL's (case-sensitive names)."""
    database = postgres_like_sqlite(tmp_path / "batches.sqlite")
    yield BatchStore(database)
    database.close()


def batch_in(store: BatchStore, lines: int = 0, owner: BatchOwner = BatchOwner("default")) -> str:
    """A batch (in_progress with `lines` lines `c1..cN` when lines > 0, else validating)."""
    file = store.create_file("in.jsonl", "batch", b"{}\n", tenant=owner.tenant)
    batch = store.create_batch(file.id, "/v1/chat/completions", "24h", None, owner)
    if lines:
        assert store.start(batch.id, [(n, f"c{n}", BODY) for n in range(1, lines + 1)])
    return batch.id


def set_status(store: BatchStore, batch_id: str, status: str) -> None:
    store.db.transaction(lambda db: db.execute("UPDATE batches SET status = ? WHERE id = ?", (status, batch_id)))


def lines_of(store: BatchStore, claimed: list) -> list[int]:
    return [line for line, _custom_id, _body in claimed]


def jsonl(store: BatchStore, file_id: str) -> list[dict]:
    return [json.loads(row) for row in store.file_content(file_id).decode().splitlines()]


def test_a_file_is_stored_field_by_field_replaced_whole_and_seen_by_its_tenant_only(store):
    before = int(time.time())
    made = store.create_file("a.jsonl", "batch", b"abc", tenant="t1")
    assert re.fullmatch(r"file-[0-9a-f]{24}", made.id)
    assert (made.bytes, made.filename, made.purpose) == (3, "a.jsonl", "batch")
    assert before <= made.created_at <= time.time()
    assert store.get_file(made.id) == made and store.get_file(made.id, tenant="t1") == made
    assert store.get_file(made.id, tenant="t2") is None and store.get_file("file-none") is None
    assert store.file_content(made.id) == b"abc" and store.file_content(made.id, tenant="t1") == b"abc"
    assert store.file_content(made.id, tenant="t2") is None and store.file_content("file-none") is None
    again = store.create_file("b.txt", "other", b"hello", file_id=made.id, tenant="t2")  # every column replaced
    assert again.id == made.id and store.get_file(made.id) == again
    assert (again.bytes, again.filename, again.purpose) == (5, "b.txt", "other")
    assert store.file_content(made.id, tenant="t2") == b"hello" and store.get_file(made.id, tenant="t1") is None
    assert store.create_file("c", "batch", b"").id != store.create_file("c", "batch", b"").id


def test_files_are_listed_newest_first_by_purpose_tenant_and_limit_and_deleted_by_their_tenant(store):
    a = store.create_file("a", "batch", b"1", tenant="t1")
    b = store.create_file("b", "batch_output", b"2", tenant="t1")
    c = store.create_file("c", "batch", b"3", tenant="t2")
    assert [f.id for f in store.list_files()] == [c.id, b.id, a.id]
    assert [f.id for f in store.list_files(purpose="batch")] == [c.id, a.id]
    assert [f.id for f in store.list_files(tenant="t1")] == [b.id, a.id]
    assert [f.id for f in store.list_files(purpose="batch", tenant="t1")] == [a.id]
    assert [f.id for f in store.list_files(limit=2)] == [c.id, b.id]
    assert store.list_files()[0] == c
    assert not store.delete_file(a.id, tenant="t2") and store.get_file(a.id) == a
    assert store.delete_file(a.id, tenant="t1") and store.get_file(a.id) is None
    assert not store.delete_file(a.id) and store.delete_file(c.id)
    assert [f.id for f in store.list_files()] == [b.id]


def test_a_new_batch_is_validating_with_every_field_and_its_owner(store):
    before = int(time.time())
    batch = store.create_batch("file-in", "/v1/completions", "24h", {"k": "v"}, BatchOwner("t1", "key_1"))
    assert re.fullmatch(r"batch_[0-9a-f]{24}", batch.id)
    assert (batch.input_file_id, batch.endpoint, batch.completion_window, batch.status) == (
        "file-in", "/v1/completions", "24h", "validating")
    assert before <= batch.created_at <= time.time() and batch.expires_at == batch.created_at + 86_400
    assert batch.metadata == {"k": "v"} and batch.errors is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (0, 0, 0)
    for field in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at", "cancelled_at",
                  "expired_at", "output_file_id", "error_file_id"):
        assert getattr(batch, field) is None, field
    assert store.owner(batch.id) == BatchOwner("t1", "key_1")
    plain = store.create_batch("file-in", "/v1/chat/completions", "24h", None)
    assert plain.metadata is None and store.owner(plain.id) == BatchOwner("default", None)
    assert store.db.query("SELECT metadata FROM batches WHERE id = ?", (plain.id,))[0]["metadata"] is None
    assert store.get_batch(batch.id, tenant="t1") == batch and store.get_batch(batch.id, tenant="t2") is None
    assert store.get_batch("batch_none") is None and store.status("batch_none") is None
    assert store.status(batch.id) == "validating"


def test_request_counts_split_at_the_edges_of_2xx(store):
    batch_id = batch_in(store, 7)
    for line, code in zip(range(1, 7), (199, 200, 250, 299, 300, 500), strict=True):
        assert store.answer(batch_id, line, code, {}, f"r{line}")
    counts = store.counts(batch_id)
    assert (counts.total, counts.completed, counts.failed) == (7, 3, 3)
    assert store.get_batch(batch_id).request_counts == counts


def test_batches_are_listed_newest_first_after_an_id_by_tenant_and_limit(store):
    ids = [batch_in(store, owner=BatchOwner(tenant)) for tenant in ("t1", "t2", "t1", "t1")]
    assert [b.id for b in store.list_batches()] == ids[::-1]
    assert [b.id for b in store.list_batches(limit=2)] == [ids[3], ids[2]]
    assert [b.id for b in store.list_batches(after=ids[2])] == [ids[1], ids[0]]
    assert [b.id for b in store.list_batches(after=ids[2], limit=1)] == [ids[1]]
    assert store.list_batches(after="batch_unknown") == []
    assert [b.id for b in store.list_batches(tenant="t1")] == [ids[3], ids[2], ids[0]]
    assert [b.id for b in store.list_batches(tenant="t1", after=ids[3])] == [ids[2], ids[0]]
    started = batch_in(store, 2)
    assert store.answer(started, 1, 200, {}, "r")
    listed = store.list_batches(limit=1)[0]
    assert listed == store.get_batch(started) and listed.request_counts.completed == 1


def test_unfinished_batches_are_every_open_status_oldest_first_and_their_tenants(store):
    ids = {status: batch_in(store, owner=BatchOwner(tenant)) for status, tenant in (
        ("validating", "t1"), ("in_progress", "t2"), ("finalizing", "t1"), ("cancelling", "t3"),
        ("completed", "t4"), ("failed", "t4"), ("cancelled", "t4"), ("expired", "t4"))}
    for status, batch_id in ids.items():
        set_status(store, batch_id, status)
    assert store.unfinished() == [ids[s] for s in ("validating", "in_progress", "finalizing", "cancelling")]
    assert store.unfinished(tenant="t1") == [ids["validating"], ids["finalizing"]]
    assert store.unfinished(tenant="t4") == []
    assert sorted(store.unfinished_tenants()) == ["t1", "t2", "t3"]


def test_start_moves_only_a_validating_batch_and_replaces_its_lines(store):
    batch_id = batch_in(store)
    store.db.transaction(lambda db: db.execute(  # a kill mid-validation left a line behind
        "INSERT INTO batch_lines (batch_id, line, custom_id, body) VALUES (?, 9, 'stale', ?)", (batch_id, BODY)))
    before = int(time.time())
    assert store.start(batch_id, [(1, "c1", BODY), (2, "c2", json.dumps({"n": 2}))])
    batch = store.get_batch(batch_id)
    assert batch.status == "in_progress" and before <= batch.in_progress_at <= time.time()
    assert store.pending_lines(batch_id) == [(1, "c1", json.loads(BODY)), (2, "c2", {"n": 2})]
    assert not store.start(batch_id, [(1, "x", BODY)]) and store.counts(batch_id).total == 2
    assert store.pending_lines(batch_id)[0][1] == "c1"


def test_fail_records_its_errors_on_a_validating_batch_only(store):
    batch_id = batch_in(store)
    before = int(time.time())
    store.fail(batch_id, [BatchError(code="invalid_json", message="line 2", line=2)])
    batch = store.get_batch(batch_id)
    assert batch.status == "failed" and before <= batch.failed_at <= time.time()
    [error] = batch.errors.data
    assert (error.code, error.message, error.line) == ("invalid_json", "line 2", 2)
    started = batch_in(store, 1)
    store.fail(started, [BatchError(code="x", message="y")])
    assert store.get_batch(started).status == "in_progress" and store.get_batch(started).errors is None


def test_a_cancel_is_taken_from_validating_and_in_progress_only_and_by_the_owner_tenant(store):
    validating, started = batch_in(store, owner=BatchOwner("t1")), batch_in(store, 1, BatchOwner("t1"))
    assert not store.request_cancel(validating, tenant="t2") and store.status(validating) == "validating"
    before = int(time.time())
    assert store.request_cancel(validating, tenant="t1") and store.request_cancel(started)
    batch = store.get_batch(validating)
    assert batch.status == "cancelling" and before <= batch.cancelling_at <= time.time()
    assert store.status(started) == "cancelling"
    assert not store.request_cancel(started)  # already cancelling
    for status in ("finalizing", "completed", "failed"):
        other = batch_in(store)
        set_status(store, other, status)
        assert not store.request_cancel(other) and store.status(other) == status
    assert not store.request_cancel("batch_none")


def test_pending_lines_are_the_unanswered_in_line_order(store):
    batch_id = batch_in(store)
    assert store.start(batch_id, [(3, "c3", BODY), (1, "c1", BODY), (2, "c2", BODY)])
    assert store.has_pending(batch_id)
    assert store.answer(batch_id, 2, 200, {}, "r2")
    assert [line for line, _c, _b in store.pending_lines(batch_id)] == [1, 3]
    assert store.answer(batch_id, 1, 500, {}, "r1") and store.answer(batch_id, 3, 200, {}, "r3")
    assert store.pending_lines(batch_id) == [] and not store.has_pending(batch_id)
    assert not store.has_pending("batch_none")


def test_a_claim_leases_the_lowest_free_lines_to_its_owner_while_in_progress(store):
    batch_id = batch_in(store, 5)
    assert store.claim(batch_id, "a", 0, 60) == [] and store.claim(batch_id, "a", -1, 60) == []
    claimed = store.claim(batch_id, "a", 2, 60)
    assert claimed == [(1, "c1", json.loads(BODY)), (2, "c2", json.loads(BODY))]
    rows = store.db.query("SELECT line, lease_owner, lease_expires FROM batch_lines WHERE batch_id = ? ORDER BY line",
                          (batch_id,))
    now = time.time()
    assert [r["lease_owner"] for r in rows] == ["a", "a", None, None, None]
    assert all(now + 55 < r["lease_expires"] < now + 65 for r in rows[:2])  # on the database's clock, 60 s on
    assert lines_of(store, store.claim(batch_id, "b", 10, 60)) == [3, 4, 5]
    assert store.claim(batch_id, "c", 10, 60) == []  # every lease still runs
    other = batch_in(store, 1)
    assert store.answer(other, 1, 200, {}, "r") and store.claim(other, "a", 1, 60) == []  # answered
    for status in ("validating", "cancelling", "finalizing"):
        closed = batch_in(store, 2)
        set_status(store, closed, status)
        assert store.claim(closed, "a", 2, 60) == [], status


def test_an_expired_lease_is_claimed_again_and_a_renewed_or_answered_one_is_not(store):
    batch_id = batch_in(store, 4)
    assert lines_of(store, store.claim(batch_id, "a", 4, -5)) == [1, 2, 3, 4]  # expired as soon as taken
    assert store.renew(batch_id, "a", [], 60) == 0
    assert store.renew(batch_id, "b", [1], 60) == 0  # not b's lease
    assert store.answer(batch_id, 4, 200, {}, "r4")
    assert store.renew(batch_id, "a", [1, 2, 4], 60) == 2  # line 4 is answered
    [row] = store.db.query("SELECT lease_expires FROM batch_lines WHERE batch_id = ? AND line = 1", (batch_id,))
    assert time.time() + 55 < row["lease_expires"] < time.time() + 65
    assert lines_of(store, store.claim(batch_id, "b", 10, 60)) == [3]
    assert store.claim(batch_id, "b", 10, 60) == []


def test_release_frees_only_its_owners_unanswered_leases(store):
    batch_id = batch_in(store, 3)
    assert lines_of(store, store.claim(batch_id, "a", 2, 60)) == [1, 2]
    store.release(batch_id, "b", [1, 2])  # not b's
    store.release(batch_id, "a", [])
    assert lines_of(store, store.claim(batch_id, "b", 10, 60)) == [3]
    store.release(batch_id, "a", [1])
    [row] = store.db.query("SELECT lease_owner, lease_expires FROM batch_lines WHERE batch_id = ? AND line = 1",
                           (batch_id,))
    assert (row["lease_owner"], row["lease_expires"]) == (None, None)
    assert lines_of(store, store.claim(batch_id, "b", 10, 60)) == [1]
    assert store.answer(batch_id, 2, 200, {}, "r2")
    store.db.transaction(lambda db: db.execute(
        "UPDATE batch_lines SET lease_owner = 'a' WHERE batch_id = ? AND line = 2", (batch_id,)))
    store.release(batch_id, "a", [2])  # answered: left as it is
    assert store.db.query("SELECT lease_owner FROM batch_lines WHERE batch_id = ? AND line = 2",
                          (batch_id,))[0]["lease_owner"] == "a"


def test_an_answer_is_kept_once_with_its_lease_released_while_the_batch_runs_or_cancels(store):
    batch_id = batch_in(store, 3)
    store.claim(batch_id, "a", 3, 60)
    before = int(time.time())
    assert store.answer(batch_id, 1, 201, {"text": "é"}, "req-1")
    [row] = store.db.query("SELECT * FROM batch_lines WHERE batch_id = ? AND line = 1", (batch_id,))
    assert (row["status_code"], json.loads(row["response"]), row["request_id"]) == (201, {"text": "é"}, "req-1")
    assert before <= row["answered_at"] <= time.time()
    assert (row["lease_owner"], row["lease_expires"]) == (None, None)
    assert not store.answer(batch_id, 1, 500, {}, "req-again")
    assert store.db.query("SELECT request_id FROM batch_lines WHERE batch_id = ? AND line = 1",
                          (batch_id,))[0]["request_id"] == "req-1"
    assert not store.answer(batch_id, 7, 200, {}, "no-such-line")
    set_status(store, batch_id, "cancelling")
    assert store.answer(batch_id, 2, 200, {}, "req-2")
    for status in ("finalizing", "completed", "validating"):
        set_status(store, batch_id, status)
        assert not store.answer(batch_id, 3, 200, {}, "late"), status
    assert store.pending_lines(batch_id)[0][0] == 3
    assert not store.answer("batch_none", 1, 200, {}, "r")


def test_finalizing_waits_for_the_last_answer_and_moves_in_progress_only(store):
    batch_id = batch_in(store, 2)
    assert store.answer(batch_id, 1, 200, {}, "r1")
    assert not store.mark_finalizing(batch_id)
    assert store.answer(batch_id, 2, 200, {}, "r2")
    before = int(time.time())
    assert store.mark_finalizing(batch_id)
    batch = store.get_batch(batch_id)
    assert batch.status == "finalizing" and before <= batch.finalizing_at <= time.time()
    assert not store.mark_finalizing(batch_id)
    other = batch_in(store, 1)
    assert store.answer(other, 1, 200, {}, "r") and store.mark_finalizing(other)  # its own lines only


def test_finalize_writes_the_output_and_error_files_and_closes_once(store):
    owner = BatchOwner("t1", "key_1")
    batch_id = batch_in(store, 5, owner)
    store.db.transaction(lambda db: db.execute(
        "UPDATE batch_lines SET custom_id = 'naïve' WHERE batch_id = ? AND line = 1", (batch_id,)))
    for line, code in ((1, 200), (3, 400), (4, 299), (5, 300)):  # line 2 never answered
        assert store.answer(batch_id, line, code, {"n": line}, f"req-{line}")
    assert not store.finalize(batch_id, "completed")  # in_progress is not a state it finalizes from
    set_status(store, batch_id, "cancelling")
    before = int(time.time())
    assert store.finalize(batch_id, "cancelled")
    batch = store.get_batch(batch_id, tenant="t1")
    assert batch.status == "cancelled" and before <= batch.cancelled_at <= time.time()
    assert batch.finalizing_at == batch.cancelled_at and batch.completed_at is None
    hexid = batch_id.removeprefix("batch_")
    assert (batch.output_file_id, batch.error_file_id) == (f"file-{batch_id}-output", f"file-{batch_id}-error")
    for kind in ("output", "error"):
        file = store.get_file(f"file-{batch_id}-{kind}", tenant="t1")
        assert (file.filename, file.purpose) == (f"{batch_id}_{kind}.jsonl", "batch_output")
    raw = store.file_content(batch.output_file_id).decode()
    assert '"naïve"' in raw and raw.endswith("}\n")

    def answered(n: int, custom_id: str, code: int) -> dict:
        return {"id": f"batch_req_{hexid}_{n}", "custom_id": custom_id,
                "response": {"status_code": code, "request_id": f"req-{n}", "body": {"n": n}}, "error": None}
    assert jsonl(store, batch.output_file_id) == [answered(1, "naïve", 200), answered(4, "c4", 299)]
    assert jsonl(store, batch.error_file_id) == [
        {"id": f"batch_req_{hexid}_2", "custom_id": "c2", "response": None,
         "error": {"code": "batch_cancelled", "message": "the batch was cancelled before this request ran"}},
        answered(3, "c3", 400), answered(5, "c5", 300)]
    assert not store.finalize(batch_id, "completed") and store.status(batch_id) == "cancelled"
    assert not store.finalize("batch_none", "completed")


def test_a_completed_batch_keeps_its_finalizing_time_and_has_no_empty_files(store):
    batch_id = batch_in(store, 1)
    assert store.answer(batch_id, 1, 200, {}, "r") and store.mark_finalizing(batch_id)
    store.db.transaction(lambda db: db.execute("UPDATE batches SET finalizing_at = 5 WHERE id = ?", (batch_id,)))
    assert store.finalize(batch_id, "completed")
    batch = store.get_batch(batch_id)
    assert (batch.status, batch.finalizing_at, batch.error_file_id) == ("completed", 5, None)
    assert batch.completed_at >= batch.created_at and batch.output_file_id == f"file-{batch_id}-output"
    assert store.get_file(batch.output_file_id).id == batch.output_file_id
    failed = batch_in(store, 1)
    assert store.answer(failed, 1, 503, {}, "r") and store.mark_finalizing(failed)
    assert store.finalize(failed, "completed")
    assert store.get_batch(failed).output_file_id is None
    assert [e["error"] for e in jsonl(store, store.get_batch(failed).error_file_id)] == [None]


def test_a_batch_past_its_window_expires_with_its_unanswered_lines_listed(store):
    batch_id = batch_in(store, 2)
    assert not store.expire_due(batch_id)  # 24 h to go
    assert store.answer(batch_id, 1, 200, {}, "r1")
    store.db.transaction(lambda db: db.execute("UPDATE batches SET expires_at = ? WHERE id = ?",
                                               (int(time.time()) - 5, batch_id)))
    assert store.expire_due(batch_id)
    batch = store.get_batch(batch_id)
    assert batch.status == "expired" and batch.expired_at >= batch.created_at
    [entry] = jsonl(store, batch.error_file_id)
    assert entry["custom_id"] == "c2" and entry["error"] == {
        "code": "batch_expired", "message": "the batch's completion window ended before this request ran"}
    assert not store.expire_due(batch_id)
    cancelling = batch_in(store, 1)
    store.db.transaction(lambda db: db.execute("UPDATE batches SET expires_at = 1, status = 'cancelling' WHERE id = ?",
                                               (cancelling,)))
    assert not store.expire_due(cancelling) and store.status(cancelling) == "cancelling"
    unbounded = batch_in(store, 1)
    store.db.transaction(lambda db: db.execute("UPDATE batches SET expires_at = NULL WHERE id = ?", (unbounded,)))
    assert not store.expire_due(unbounded)


def test_a_completed_batch_lists_a_line_never_answered_as_ended(store):
    batch_id = batch_in(store, 1)
    set_status(store, batch_id, "finalizing")
    assert store.finalize(batch_id, "completed")
    [entry] = jsonl(store, store.get_batch(batch_id).error_file_id)
    assert entry["error"] == {"code": "batch_cancelled", "message": "the batch ended before this request ran"}


LEGACY = """
CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE batches (id TEXT PRIMARY KEY, status TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
    expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, errors TEXT);
CREATE TABLE batch_lines (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status_code INTEGER, response TEXT, request_id TEXT, answered_at INTEGER, PRIMARY KEY (batch_id, line));
INSERT INTO files VALUES ('file-old', 'batch', 'old.jsonl', 2, 1, X'7B7D');
INSERT INTO batches (id, status, endpoint, input_file_id, completion_window, created_at, expires_at)
    VALUES ('batch_old', 'in_progress', '/v1/chat/completions', 'file-old', '24h', 1, 86401);
INSERT INTO batch_lines (batch_id, line, custom_id, body) VALUES ('batch_old', 1, 'c1', '{}');
"""


def test_a_store_from_before_tenants_and_leases_opens_migrated_with_its_objects_in_default(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as old:
        old.executescript(LEGACY)
    store = BatchStore(path)
    assert store.path == path
    assert store.owner("batch_old") == BatchOwner("default", None)
    assert store.get_file("file-old", tenant="default").filename == "old.jsonl"
    assert store.get_batch("batch_old").expired_at is None
    assert lines_of(store, store.claim("batch_old", "a", 1, 60)) == [1]
    indexes = {r["name"] for r in store.db.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"files_tenant", "batches_tenant", "batches_status"} <= indexes
    store.close()


def test_a_store_on_a_shared_database_leaves_it_open_and_one_on_a_path_closes_its_own(tmp_path):
    database = SqliteDatabase(tmp_path / "shared.sqlite")
    shared = BatchStore(database)
    assert shared.db is database and shared.path == tmp_path / "shared.sqlite"
    shared.close()
    assert database.query("SELECT 1")[0][0] == 1
    database.close()
    own = BatchStore(tmp_path / "own.sqlite")
    own.close()
    with pytest.raises(sqlite3.ProgrammingError):
        own.db.query("SELECT 1")


def test_lists_hold_at_most_their_default_limits(store):
    store.db.transaction(lambda db: db.executemany(
        "INSERT INTO files (id, purpose, filename, bytes, created_at, content) VALUES (?, 'batch', 'f', 0, 0, x'')",
        [(f"file-{n}",) for n in range(10_001)]))
    assert len(store.list_files()) == 10_000
    store.db.transaction(lambda db: db.executemany(
        "INSERT INTO batches (id, status, endpoint, input_file_id, completion_window, created_at) "
        "VALUES (?, 'completed', '/v1/completions', 'file-0', '24h', 0)", [(f"batch_{n}",) for n in range(21)]))
    assert [b.id for b in store.list_batches()] == [f"batch_{n}" for n in range(20, 0, -1)]
