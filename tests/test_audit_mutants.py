"""The audit log's parts that mutmut found unguarded (chain.py, log.py, spend.py, the store's
writer and verifier): the store's rows read as PostgreSQL's (tests/store_support.py), each break
the store verifier names in the words of rows, a time without a zone read as UTC whatever the
machine's zone, and a file read from its end in blocks of any size."""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import asdict

import pytest

from nowait.gateway.audit import AuditLog, read_audit_log, store_log, verify_audit_log
from nowait.gateway.audit import log as audit_log
from nowait.gateway.audit.spend import since_timestamp, spend, spend_json
from nowait.gateway.audit.store_log import StoreAuditLog, read_store_audit_log, store_spent_since
from nowait.gateway.audit.store_verify import verify_store
from nowait.store.database import StoreUnavailable
from tests.store_support import postgres_like_sqlite


@pytest.fixture
def database(tmp_path):
    opened = postgres_like_sqlite(tmp_path / "store.sqlite")
    yield opened
    opened.close()


def fill(database, count: int = 4, replica: str = "r1") -> None:
    log = StoreAuditLog(database, replica)
    for n in range(count):
        log.record({"request_id": f"req-{n}", "tenant": "teamA" if n % 2 else "teamB", "status": 200,
                    "cost_usd": 0.25 * n, "time": 100.0 + n})
    log.close()


def execute(database, sql: str, args: tuple = ()) -> None:
    database.transaction(lambda session: session.execute(sql, args))


def test_the_store_log_reads_back_and_continues_with_rows_read_as_postgresqls(database):
    fill(database, 3)
    again = StoreAuditLog(database, "r1")  # continues the chain from its last row
    again.record({"request_id": "req-3", "tenant": "teamA", "status": 200, "cost_usd": 1.0, "time": 103.0})
    again.close()
    entries = read_store_audit_log(database)
    assert [(e["seq"], e["request_id"]) for e in entries] == [(n, f"req-{n}") for n in range(4)]
    assert entries[3]["prev"] == entries[2]["hash"]
    assert [e["request_id"] for e in read_store_audit_log(database, 102.0)] == ["req-2", "req-3"]
    assert store_spent_since(database, 101.0) == {"teamA": 1.25, "teamB": 0.5}
    assert verify_store(database).ok


def test_each_store_break_is_told_in_rows_with_the_rows_key(database):
    fill(database)
    execute(database, "DELETE FROM audit_entries WHERE seq = 1")
    assert verify_store(database).broken.message == (
        "entry 1 of replica 'r1' was removed: row 2 holds entry 2 (request req-2) where entry 1 was due "
        "[row 2: replica 'r1', seq 2]")
    execute(database, "UPDATE audit_entries SET entry = '{torn' WHERE seq = 2")
    assert verify_store(database).broken.message == (
        "row 2 is not a JSON entry, and the entry after it does not vouch for it as a torn write: it was altered "
        "[row 2: replica 'r1', seq 2]")


def test_a_last_row_that_is_not_json_is_altered_not_torn(database):
    fill(database, 3)
    execute(database, "UPDATE audit_entries SET entry = '{torn' WHERE seq = 2")
    broken = verify_store(database).broken
    assert (broken.kind, broken.line) == ("altered", 3)
    assert broken.message == "row 3 is not a JSON entry: it was altered [row 3: replica 'r1', seq 2]"


def test_a_column_break_names_the_row_and_its_key(database):
    fill(database, 3)
    execute(database, "UPDATE audit_entries SET status = 500, tenant = 'x' WHERE seq = 1")
    broken = verify_store(database).broken
    assert (broken.kind, broken.line, broken.replica, broken.seq, broken.request_id) == ("altered", 2, "r1", 1, "req-1")
    assert broken.message == ("row 2's tenant, status column(s) do not say what its entry says: they were altered "
                              "[row 2: replica 'r1', seq 1]")
    execute(database, "UPDATE audit_entries SET status = 200, tenant = 'teamA' WHERE seq = 1")
    execute(database, "UPDATE audit_entries SET seq = 7 WHERE seq = 2")
    broken = verify_store(database).broken
    assert (broken.kind, broken.line, broken.replica, broken.seq, broken.request_id) == ("altered", 3, "r1", 2, "req-2")
    assert broken.message == (
        "row 3's key is not its entry's (replica 'r1', seq 2): it was altered [row 3: replica 'r1', seq 7]")
    execute(database, "UPDATE audit_entries SET seq = 2 WHERE seq = 7")
    execute(database, "UPDATE audit_entries SET time = 1, tenant = 'x', status = 1, cost_usd = 9 WHERE seq = 0")
    verdict = verify_store(database)
    assert verdict.path == database.url.redacted and verdict.broken.line == 1
    assert verdict.broken.message.startswith("row 1's time, tenant, status, cost_usd column(s) do not say")


def test_the_columns_say_what_the_line_says_with_no_nul_and_no_lone_surrogate(database):
    log = StoreAuditLog(database, "r1")
    for tenant, status in (("team\udc80", 200), ("a\x00b", "200"), ("", True), (7, 404)):
        log.record({"tenant": tenant, "status": status, "cost_usd": 0.5})
    log.close()
    columns = database.query("SELECT tenant, status FROM audit_entries ORDER BY seq")
    assert [(row["tenant"], row["status"]) for row in columns] == [
        ("team?", 200), ("a?b", None), (None, None), (None, 404)]
    assert [e["tenant"] for e in read_store_audit_log(database)] == ["team?", "a\x00b", "", 7]
    assert verify_store(database).ok


def test_the_writer_is_a_daemon_thread_named_for_its_replica_and_the_chain_is_logged(database, caplog):
    fill(database, 2)
    with caplog.at_level(logging.INFO, logger="nowait.gateway"):
        log = StoreAuditLog(database, "r1")
    [writer] = [t for t in threading.enumerate() if t.name == "audit-store-r1"]
    daemon = writer.daemon
    log.close()
    assert daemon and not writer.is_alive()  # a process that ends without close is not held up by it
    head = read_store_audit_log(database)[-1]["hash"]
    assert caplog.records[0].getMessage() == (
        f"audit log in {database.url.redacted}: chain 'r1' continues at entry 2 after {head}")


def test_flush_waits_for_a_slow_store_within_its_timeout(database, monkeypatch):
    real = database.transaction

    def slow(work):
        time.sleep(0.15)
        return real(work)
    log = StoreAuditLog(database, "r1")
    monkeypatch.setattr(database, "transaction", slow)
    log.record({"request_id": "req-0"})
    assert log.flush(0.9) and log.queued == 0
    log.close()


def test_entries_given_up_after_a_close_during_an_outage_are_named_with_the_store(database, monkeypatch, caplog):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(store_log, "CLOSE_WAIT_S", 0.1)
    log = StoreAuditLog(database, "r1")

    def unreachable(work):
        raise StoreUnavailable("the store is unavailable")
    monkeypatch.setattr(database, "transaction", unreachable)
    log.record({"request_id": "req-0"})
    with caplog.at_level(logging.ERROR, logger="nowait.gateway"):
        log.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"audit log in {database.url.redacted}: the store stayed unreachable for 0 s after close: 1 entr(ies) of "
        "chain 'r1' from entry 0 were not written"]


@pytest.fixture
def new_york(monkeypatch):
    """A machine whose local time is not UTC, as a --since without a zone must not depend on it."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_since_without_a_zone_is_utc_and_one_with_a_zone_keeps_it(new_york):
    assert since_timestamp("2026-01-02T03:04:05") == 1767323045.0
    assert since_timestamp("2026-01-02") == 1767312000.0
    assert since_timestamp("2026-01-02T03:04:05+02:00") == 1767323045.0 - 7200


@pytest.mark.parametrize("block", [1, 2, 3, 7, 1 << 16])
def test_a_file_read_from_its_end_yields_every_line_last_first_for_any_block(monkeypatch, block):
    monkeypatch.setattr(audit_log, "TAIL_BLOCK", block)
    for data in (b"", b"\n", b"a", b"ab\ncd", b"first\n\nthird line\nfour\n", b"x" * 20 + b"\n" + b"y" * 9):
        assert list(audit_log.lines_from_end(io.BytesIO(data))) == data.split(b"\n")[::-1], data


def run(engine: str | None, prompt: int | None, completion: int | None, cost: float | None) -> dict:
    fields = {"engine": engine, "prompt_tokens": prompt, "completion_tokens": completion, "cost_usd": cost}
    return {name: value for name, value in fields.items() if value is not None}


SPEND_ENTRIES = [  # costs in powers of two, so every sum is exact
    {"tenant": "a", "status": 200, "time": 10.0, "cost_usd": 0.5, "fallback_cause": "engine_failure",
     "engines_tried": [run("diffusion", 3, 4, 0.125), run("ar", 5, 6, 0.375)]},
    {"tenant": None, "status": 500, "time": 20.0, "cost_usd": 0.25, "engines_tried": [run("ar", None, 1, 0.25)]},
    {"engines_tried": [run(None, 2, None, None), "not a run"]},  # no time, status, tenant or cost
    {"tenant": "a", "status": 200, "time": 30.0, "cost_usd": 0.5625, "fallback_cause": "low_confidence",
     "engines_tried": [run("diffusion", 7, 8, 0.0625), run("ar", 9, 10, 0.5)]},
    {"tenant": "b", "status": 200, "time": 40.0, "cost_usd": 0.25, "engines_tried": []},
    {"tenant": "c", "status": 200, "time": 50.0, "cost_usd": 0.5, "fallback_cause": "engine_failure",
     "engines_tried": [run("diffusion", 1, 1, 0.25), run("ar", 1, 1, 0.25)]},
]


def rows_of(rows) -> list[tuple]:
    return [(name, row.requests, row.errors, row.prompt_tokens, row.completion_tokens, row.cost_usd)
            for name, row in rows.items()]


def test_spend_by_tenant_counts_each_request_once_with_its_runs_tokens_largest_cost_first():
    assert rows_of(spend(SPEND_ENTRIES)) == [("a", 2, 0, 24, 28, 1.0625), ("c", 1, 0, 2, 2, 0.5),
                                             ("b", 1, 0, 0, 0, 0.25), ("default", 2, 1, 2, 1, 0.25)]  # a tie: by name
    assert rows_of(spend(SPEND_ENTRIES, since=1.0))[-1] == ("default", 1, 1, 0, 1, 0.25)  # no time: before any since
    assert [name for name in spend(SPEND_ENTRIES, since=30.0)] == ["a", "c", "b"]  # at `since` counts


def test_spend_by_engine_fails_an_earlier_run_only_when_it_is_why_the_request_moved_on():
    rows = spend(SPEND_ENTRIES, by="engine")
    assert rows_of(rows) == [("ar", 4, 1, 15, 18, 1.375), ("diffusion", 3, 2, 11, 13, 0.4375), ("?", 1, 0, 2, 0, 0.0)]
    assert spend_json(rows, "engine", 5.0) == {
        "by": "engine", "since": 5.0, "rows": {name: asdict(row) for name, row in rows.items()},
        "total": {"requests": 8, "errors": 3, "prompt_tokens": 28, "completion_tokens": 31, "cost_usd": 1.8125}}


def test_a_verdict_as_json_and_an_entrys_time_in_milliseconds(tmp_path, database):
    path = tmp_path / "audit.jsonl"
    writer = AuditLog(path)
    writer.record({"request_id": "req-0"})
    writer.close()
    verdict = verify_audit_log(path)
    assert verdict.as_json() == {"ok": True, "path": str(path), "entries": 1, "replicas": {
        "local": {"entries": 1, "last_seq": 0, "last_hash": writer.last_hash, "last_line": 1}},
        "torn_lines": [], "broken": None}
    stored = StoreAuditLog(database, "r1")
    stored.record({"request_id": "req-0"})
    stored.close()
    assert type(read_audit_log(path)[0]["time"]) is float and type(read_store_audit_log(database)[0]["time"]) is float


@pytest.mark.parametrize(("error", "said"), [("connection refused\nDETAIL: more", "connection refused"),
                                             ("", "StoreUnavailable")])
def test_an_outage_is_warned_once_and_its_end_once_and_the_chain_end_logged(database, monkeypatch, caplog, error, said):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    real, failures = database.transaction, [StoreUnavailable(error), StoreUnavailable(error)]

    def flaky(work):
        if failures:
            raise failures.pop(0)
        return real(work)
    log = StoreAuditLog(database, "r1")
    monkeypatch.setattr(database, "transaction", flaky)
    with caplog.at_level(logging.INFO, logger="nowait.gateway"):
        log.record({"request_id": "req-0"})
        assert log.flush(5)
        log.close()
    url = database.url.redacted
    assert [r.getMessage() for r in caplog.records] == [
        f"audit log in {url}: 1 entr(ies) queued, not written ({said}): retrying",
        f"audit log in {url}: written again (0 entr(ies) still queued)",
        f"audit log in {url}: chain 'r1' ends at entry 0, hash {log.last_hash}"]


def test_a_store_back_within_the_close_wait_gets_the_queued_entries(database, monkeypatch):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(store_log, "CLOSE_WAIT_S", 5.0)
    real, down = database.transaction, threading.Event()
    down.set()

    def unreachable(work):
        if down.is_set():
            raise StoreUnavailable("the store is unavailable")
        return real(work)
    log = StoreAuditLog(database, "r1")
    monkeypatch.setattr(database, "transaction", unreachable)
    log.record({"request_id": "req-0"})
    threading.Timer(0.2, down.clear).start()
    log.close()  # waits for the store, which comes back before CLOSE_WAIT_S
    assert [e["request_id"] for e in read_store_audit_log(database)] == ["req-0"]
