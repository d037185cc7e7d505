"""The audit log in the shared store (audit/store_log.py, audit/store_verify.py), on SQLite and on
the session's PostgreSQL: one chain per replica in one table, the file writer's exact lines,
every edit of a row found and named, the chain continued after a reopen, spend since a moment,
a newer schema refused, and entries queued, not lost, while the database is unreachable."""

from __future__ import annotations

import json
import logging
from urllib.parse import urlsplit

import pytest

from nowait.gateway.audit import GENESIS, AuditLog, store_log, verify_audit_log
from nowait.gateway.audit.store_log import StoreAuditLog, read_store_audit_log, store_spent_since
from nowait.gateway.audit.store_verify import verify_store
from nowait.gateway.spend_restore import spent_since
from nowait.store.database import StoreUnavailable, open_database
from nowait.store.url import StoreError


@pytest.fixture
def database(store_url):
    db = open_database(store_url)
    yield db
    db.close()


def entry(number: int, **fields) -> dict:
    return {"request_id": f"req-{number}", "tenant": "teamA", "status": 200, "cost_usd": 0.001 * number,
            "engine": "ar", **fields}


def write(database, replica: str, count: int, start: int = 0) -> StoreAuditLog:
    log = StoreAuditLog(database, replica)
    for number in range(start, start + count):
        log.record(entry(number))
    assert log.flush()
    return log


def rows(database) -> list:
    return database.query("SELECT replica, seq, entry FROM audit_entries ORDER BY replica, seq")


def execute(database, sql: str, args: tuple = ()) -> None:
    database.transaction(lambda session: session.execute(sql, args))


def test_two_replicas_keep_one_chain_each_in_one_database_and_both_verify(store_url):
    first, second = open_database(store_url), open_database(store_url)  # two replicas: two connections
    a, b = StoreAuditLog(first, "replica-a"), StoreAuditLog(second, "replica-b")
    for number in range(6):  # interleaved, as two replicas serve at once
        (a if number % 3 else b).record(entry(number))
    a.close()
    b.close()
    verdict = verify_store(first)
    assert verdict.ok, verdict.broken
    assert verdict.entries == 6
    assert {name: state.entries for name, state in verdict.replicas.items()} == {"replica-a": 4, "replica-b": 2}
    assert verdict.replicas["replica-a"].last_hash == a.last_hash != GENESIS
    stored = [json.loads(row["entry"]) for row in rows(first)]
    assert [(e["replica"], e["seq"]) for e in stored] == [("replica-a", s) for s in range(4)] + \
        [("replica-b", s) for s in range(2)]
    assert stored[0]["prev"] == GENESIS and stored[1]["prev"] == stored[0]["hash"]
    first.close()
    second.close()


def test_a_row_holds_exactly_the_line_the_file_writer_writes(database, tmp_path):
    """One chain rule for both: the same entries give the file's lines byte for byte."""
    file_log, store = AuditLog(tmp_path / "audit.jsonl", "r1"), StoreAuditLog(database, "r1")
    odd = [entry(1, time=1.5), entry(2, time=2.0, note="é ✓", nested={"b": [1, 2.5, None], "a": True}),
           entry(3, time=3.0, client="lone \ud800 surrogate", tup=(1, 2))]
    for item in odd:
        file_log.record(item)
        store.record(item)
    file_log.close()
    store.close()
    assert [row["entry"].encode() for row in rows(database)] == (tmp_path / "audit.jsonl").read_bytes().splitlines()
    assert verify_audit_log(tmp_path / "audit.jsonl").ok and verify_store(database).ok


def test_the_chain_continues_after_the_replica_reopens(database):
    write(database, "r1", 3).close()
    reopened = StoreAuditLog(database, "r1")
    last = json.loads(rows(database)[-1]["entry"])
    assert reopened.last_hash == last["hash"]
    reopened.record(entry(3))
    reopened.close()
    newest = json.loads(rows(database)[-1]["entry"])
    assert (newest["seq"], newest["prev"]) == (3, last["hash"])
    verdict = verify_store(database)
    assert verdict.ok and verdict.replicas["r1"].entries == 4


def break_of(database):
    verdict = verify_store(database)
    assert not verdict.ok
    return verdict.broken


def test_an_edited_entry_is_named_altered(database):
    write(database, "r1", 4).close()
    text = rows(database)[2]["entry"]
    execute(database, "UPDATE audit_entries SET entry = ? WHERE replica = ? AND seq = ?",
            (text.replace('"teamA"', '"teamB"'), "r1", 2))
    broken = break_of(database)
    assert (broken.kind, broken.replica, broken.seq, broken.request_id) == ("altered", "r1", 2, "req-2")
    assert "row 3" in broken.message and "replica 'r1', seq 2" in broken.message


def test_a_deleted_row_is_named_removed(database):
    write(database, "r1", 5).close()
    write(database, "r2", 2).close()
    execute(database, "DELETE FROM audit_entries WHERE replica = ? AND seq = ?", ("r1", 1))
    broken = break_of(database)
    assert (broken.kind, broken.replica, broken.seq) == ("removed", "r1", 1)
    assert "entry 1 of replica 'r1' was removed" in broken.message


def test_rows_whose_seq_were_swapped_are_named_reordered(database):
    write(database, "r1", 5).close()
    for old, new in ((1, -1), (2, 1), (-1, 2)):  # rows 1 and 2 trade places in the chain's order
        execute(database, "UPDATE audit_entries SET seq = ? WHERE replica = ? AND seq = ?", (new, "r1", old))
    broken = break_of(database)
    assert (broken.kind, broken.replica, broken.seq) == ("reordered", "r1", 2)
    assert "the rows were reordered" in broken.message


def test_a_column_that_no_longer_says_what_its_entry_says_is_named_altered(database):
    """Spend reads the columns: a lowered cost or a renamed tenant must not pass as whole."""
    write(database, "r1", 3).close()
    assert verify_store(database).ok
    execute(database, "UPDATE audit_entries SET cost_usd = 0 WHERE replica = ? AND seq = ?", ("r1", 2))
    broken = break_of(database)
    assert (broken.kind, broken.seq) == ("altered", 2) and "cost_usd" in broken.message
    execute(database, "UPDATE audit_entries SET cost_usd = ?, tenant = ? WHERE replica = ? AND seq = ?",
            (0.002, "someoneElse", "r1", 2))
    broken = break_of(database)
    assert "tenant" in broken.message and "cost_usd" not in broken.message


def test_a_row_that_is_not_json_is_named_altered(database):
    write(database, "r1", 3).close()
    execute(database, "UPDATE audit_entries SET entry = ? WHERE replica = ? AND seq = ?", ("{torn", "r1", 2))
    broken = break_of(database)
    assert broken.kind == "altered" and "row 3" in broken.message


def test_spend_since_matches_the_file_rule(database, tmp_path):
    """store_spent_since counts what spent_since counts in a file of the same entries."""
    entries = [entry(1, time=100.0), entry(2, time=200.0), entry(3, time=300.0, tenant="teamB"),
               entry(4, time=300.0, status=429), entry(5, time=400.0, tenant=None),
               entry(6, time=400.0, tenant=""), {"request_id": "no-cost", "time": 500.0, "status": 200}]
    file_log, stores = AuditLog(tmp_path / "audit.jsonl", "r1"), [StoreAuditLog(database, "r1")]
    for item in entries:
        file_log.record(item)
        stores[0].record(item)
    file_log.close()
    stores[0].close()
    for since in (0.0, 150.0, 300.0, 450.0):
        from_store = store_spent_since(database, since)
        from_file = spent_since(tmp_path / "audit.jsonl", since)
        assert from_store.keys() == from_file.keys()
        assert all(from_store[t] == pytest.approx(from_file[t]) for t in from_file)
    assert store_spent_since(database, 150.0) == pytest.approx({"teamA": 0.002, "teamB": 0.003, "default": 0.011})
    assert [e["request_id"] for e in read_store_audit_log(database, 350.0)] == ["req-5", "req-6", "no-cost"]


def test_a_newer_audit_schema_is_refused_with_one_line(database):
    write(database, "r1", 1).close()
    execute(database, "UPDATE nowait_schema SET version = 99 WHERE component = 'audit'")
    with pytest.raises(StoreError) as refused:
        StoreAuditLog(database, "r1")
    message = str(refused.value)
    assert "audit schema is at version 99" in message and "upgrade nowait" in message and "\n" not in message
    password = urlsplit(database.url.url).password
    assert password is None or password not in message
    with pytest.raises(StoreError):
        verify_store(database)


def test_entries_stay_queued_while_the_store_is_unreachable_and_are_written_after(database, monkeypatch):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    log = write(database, "r1", 2)
    real = database.transaction
    down = {"on": True}

    def unreachable(work):
        if down["on"]:
            raise StoreUnavailable("the store is unavailable: connection refused")
        return real(work)

    monkeypatch.setattr(database, "transaction", unreachable)
    for number in range(2, 7):
        log.record(entry(number))  # answers at once: the request path never waits on the store
    assert not log.flush(0.2) and log.queued == 5
    down["on"] = False
    assert log.flush()
    log.close()
    verdict = verify_store(database)
    assert verdict.ok and verdict.replicas["r1"].entries == 7


def test_a_close_during_an_outage_gives_the_queued_entries_up_after_a_wait_and_says_so(database, monkeypatch,
                                                                                        caplog):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(store_log, "CLOSE_WAIT_S", 0.2)
    log = write(database, "r1", 1)

    def unreachable(work):
        raise StoreUnavailable("the store is unavailable")

    monkeypatch.setattr(database, "transaction", unreachable)
    log.record(entry(1))
    log.record(entry(2))
    with caplog.at_level(logging.ERROR, logger="nowait.gateway"):
        log.close()
    assert any("2 entr(ies) of chain 'r1' from entry 1 were not written" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert len(rows(database)) == 1
