"""The rest of what mutmut found unguarded in the audit log (issue 26): every break the file
verifier names, field by field and word for word (the reader of `nowait audit verify` acts on
the line, kind and message); the writers' log lines, their clocks, entries that are not plain
JSON, a torn line another replica vouched for, and the store writer's batches and retry waits;
the CLI's usage errors and its default log."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from nowait.cli import app
from nowait.gateway.audit import GENESIS, AuditLog, read_audit_log, store_log, verify_audit_log
from nowait.gateway.audit import log as audit_log
from nowait.gateway.audit.chain import canonical, entry_hash
from nowait.gateway.audit.store_log import StoreAuditLog, read_store_audit_log
from nowait.gateway.audit.store_verify import verify_store
from nowait.store.database import StoreUnavailable
from nowait.store.scratch_postgres import free_port
from tests.store_support import postgres_like_sqlite

ENTRIES = 6
TAIL = ": a write cut short by a crash, or the end of an entry cut off; the gateway's next entry vouches for it " \
       "when it restarts"


@pytest.fixture
def database(tmp_path):
    opened = postgres_like_sqlite(tmp_path / "store.sqlite")
    yield opened
    opened.close()


def write(path: Path, count: int = ENTRIES, replica: str = "local", start: int = 0) -> None:
    log = AuditLog(path, replica)
    for number in range(start, start + count):
        log.record({"request_id": f"req-{number}", "tenant": "team-a", "status": 200, "cost_usd": 0.25 * number})
    log.close()


def broken(path: Path, change) -> dict:
    """The break verify names once `change` has rewritten the log's lines (each with its newline)."""
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(change(lines)))
    return asdict(verify_audit_log(path).broken)


def rehashed(line: bytes, **changes) -> bytes:
    """A line rewritten by someone who recomputes its hash: valid on its own."""
    entry = {**json.loads(line), **changes}
    entry["hash"] = entry_hash(entry)
    return canonical(entry) + b"\n"


def brk(line, kind, message, replica=None, seq=None, request_id=None) -> dict:
    return {"line": line, "kind": kind, "message": message, "replica": replica, "seq": seq, "request_id": request_id}


def named(seq: int) -> str:
    return f"entry {seq} of replica 'local' (request req-{seq})"


@pytest.fixture
def log_path(tmp_path) -> Path:
    path = tmp_path / "audit.jsonl"
    write(path)
    return path


def test_inserted_lines_are_named_with_the_line_and_what_they_repeat(log_path):
    original = log_path.read_bytes()
    assert broken(log_path, lambda lines: [*lines[:4], b"\n", *lines[4:]]) == brk(
        5, "inserted", "line 5 is empty: it was inserted")
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [*lines[:4], lines[1], *lines[4:]]) == brk(
        5, "inserted", f"line 5 repeats {named(1)}, already at line 2: one of them was inserted", "local", 1, "req-1")
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [*lines[:4], b'{"request_id":"req-x","tenant":"b"}\n', *lines[4:]]) == brk(
        5, "inserted", "line 5 is not a chained entry (the writer gives every entry a hash, prev, seq and replica): "
                       "it was inserted", request_id="req-x")


def test_edited_and_replaced_entries_are_named_altered_with_what_they_no_longer_follow(log_path):
    original = log_path.read_bytes()
    unhashed = {k: v for k, v in json.loads(original.splitlines()[2]).items() if k != "hash"}
    assert broken(log_path, lambda lines: [*lines[:2], canonical(unhashed) + b"\n", *lines[3:]]) == brk(
        3, "altered", "line 3 is not a chained entry (the writer gives every entry a hash, prev, seq and replica): "
                      "it was altered", request_id="req-2")
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [*lines[:2], lines[2].replace(b'"cost_usd":0.5', b'"cost_usd":0.6'),
                                           *lines[3:]]) == brk(
        3, "altered", f"line 3, {named(2)}, was altered: its hash does not match its content", "local", 2, "req-2")
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [*lines[:2], rehashed(lines[2], request_id="req-x"), *lines[3:]]) == brk(
        4, "altered", f"line 4, {named(3)}, does not follow entry 2 at line 3 (its prev is another hash): it, or the "
                      "entry before it, was replaced", "local", 3, "req-3")
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [rehashed(lines[0], prev="f" * 64), *lines[1:]]) == brk(
        1, "altered", f"line 1, {named(0)}, does not follow the chain's start (its prev is another hash): it, or the "
                      "entry before it, was replaced", "local", 0, "req-0")


def test_removed_and_reordered_entries_are_named_with_the_entry_that_was_due(log_path):
    original = log_path.read_bytes()
    assert broken(log_path, lambda lines: [*lines[:2], *lines[3:]]) == brk(
        3, "removed", "entry 2 of replica 'local' was removed: line 3 holds entry 3 (request req-3) where entry 2 was "
                      "due", "local", 2)
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [*lines[:2], *lines[4:]]) == brk(
        3, "removed", "entries 2 to 3 of replica 'local' were removed: line 3 holds entry 4 (request req-4) where "
                      "entry 2 was due", "local", 2)
    log_path.write_bytes(original)
    assert broken(log_path, lambda lines: [*lines[:2], lines[3], lines[2], *lines[4:]]) == brk(
        3, "reordered", f"line 3 holds {named(3)} where entry 2 was due; entry 2 is at line 4: the lines were "
                        "reordered", "local", 3, "req-3")


def test_a_line_that_is_json_but_no_object_and_a_vouched_fragment_removed(tmp_path, log_path):
    assert broken(log_path, lambda lines: [*lines[:2], b"42\n", *lines[2:]]) == brk(
        3, "altered", "line 3 is not a JSON entry, and the entry after it does not vouch for it as a torn write: it "
                      "was altered")
    kept = [json.loads(line) for line in log_path.read_bytes().splitlines() if line != b"42"]
    assert read_audit_log(log_path) == kept and len(kept) == ENTRIES
    path = tmp_path / "vouched.jsonl"
    write(path, 2)
    with path.open("ab") as handle:
        handle.write(b'{"request_id":"cut')
    write(path, 1, start=2)
    assert broken(path, lambda lines: [*lines[:2], *lines[3:]]) == brk(
        3, "removed", f"line 3, {named(2)}, vouches for a torn line before it that is not there: that line was removed",
        "local", 2, "req-2")


def test_torn_lines_are_counted_with_their_bytes_and_whether_the_last_has_its_newline(log_path):
    original = log_path.read_bytes()
    log_path.write_bytes(original + b'{"cost')
    verdict = verify_audit_log(log_path)
    assert verdict.entries == ENTRIES and asdict(verdict.broken) == brk(
        7, "torn", "line 7 is torn (6 bytes, the last with no newline)" + TAIL)
    log_path.write_bytes(original + b'{"a\n{"bc\n{"def\n')
    assert asdict(verify_audit_log(log_path).broken) == brk(7, "torn", "lines 7 to 9 are torn (3, 4, 5 bytes)" + TAIL)


def test_a_log_is_opened_in_a_new_directory_tree_and_its_chain_logged_at_open_and_close(tmp_path, caplog):
    path = tmp_path / "a" / "b" / "audit.jsonl"
    with caplog.at_level(logging.INFO, logger="nowait.gateway"):
        log = AuditLog(path, "gw-1")
        log.record({"request_id": "req-0"})
        log.record({"request_id": "req-1"})
        log.close()
        log.close()  # a second close says nothing
        log.record({"request_id": "late"})  # after close: not written
    assert [e["request_id"] for e in read_audit_log(path)] == ["req-0", "req-1"]
    assert [r.getMessage() for r in caplog.records] == [
        f"audit log {path}: chain 'gw-1' continues at entry 0 after {GENESIS}",
        f"audit log {path}: chain 'gw-1' ends at entry 1, hash {log.last_hash}"]


def test_torn_lines_found_at_open_are_warned_with_their_sizes(log_path, caplog):
    last = read_audit_log(log_path)[-1]["hash"]
    with log_path.open("ab") as handle:
        handle.write(b'{"ab\n{"cde')
    with caplog.at_level(logging.INFO, logger="nowait.gateway"):
        AuditLog(log_path).close()
    assert [(r.levelname, r.getMessage()) for r in caplog.records[:2]] == [
        ("WARNING", f"audit log {log_path} ends with 2 torn line(s) (4, 5 bytes: a write cut short): the next entry "
                    "vouches for them"),
        ("INFO", f"audit log {log_path}: chain 'local' continues at entry {ENTRIES} after {last}")]


def test_an_entrys_time_is_the_clock_read_to_the_millisecond(tmp_path, database, monkeypatch):
    clock = SimpleNamespace(time=lambda: 1767312000.123456, monotonic=time.monotonic)
    monkeypatch.setattr(audit_log, "time", clock)
    monkeypatch.setattr(store_log, "time", clock)
    log, stored = AuditLog(tmp_path / "audit.jsonl"), StoreAuditLog(database, "r1")
    log.record({"request_id": "req-0"})
    stored.record({"request_id": "req-0"})
    log.close()
    stored.close()
    assert read_audit_log(tmp_path / "audit.jsonl")[0]["time"] == 1767312000.123
    assert read_store_audit_log(database)[0]["time"] == 1767312000.123


def test_values_json_cannot_write_are_written_as_read_back_wherever_they_stand(tmp_path, database):
    """A Path as the only such value, and one inside a list: written as their str (not a crash),
    so the line is what a reader hashes; in the store the columns come from that line too."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.record({"where": tmp_path})
    log.record({"paths": [tmp_path]})
    log.close()
    assert [e.get("where") or e.get("paths") for e in read_audit_log(path)] == [str(tmp_path), [str(tmp_path)]]
    assert verify_audit_log(path).ok
    stored = StoreAuditLog(database, "r1")
    stored.record({"tenant": Path("team-p"), "status": 200, "cost_usd": 0.5})
    stored.close()
    assert [row["tenant"] for row in database.query("SELECT tenant FROM audit_entries")] == ["team-p"]
    assert verify_store(database).ok


def test_a_torn_line_another_replica_vouched_for_is_not_vouched_for_again(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, 1, replica="r1")
    with path.open("ab") as handle:
        handle.write(b'{"cut-a')
    AuditLog(path, "r2").close()  # ends the fragment with a newline
    with path.open("ab") as handle:
        handle.write(b'{"cut-b')
    write(path, 1, replica="r2")  # vouches for both
    write(path, 1, replica="r1", start=1)  # its last entry is before them: nothing to vouch for
    entries = read_audit_log(path)
    assert [len(e.get("torn", [])) for e in entries] == [0, 2, 0]
    verdict = verify_audit_log(path)
    assert verdict.ok and verdict.torn_lines == [2, 3]


def test_a_store_that_never_fails_logs_no_warning(database, caplog):
    log = StoreAuditLog(database, "r1")
    with caplog.at_level(logging.WARNING, logger="nowait.gateway"):
        for number in range(3):
            log.record({"request_id": f"req-{number}"})
            assert log.flush(5)
    log.close()
    assert caplog.records == []


def test_rows_queued_in_an_outage_are_written_in_batches_of_batch_rows(database, monkeypatch):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(store_log, "BATCH_ROWS", 2)
    real, down, sizes = database.transaction, threading.Event(), []
    down.set()

    class Counting:
        def __init__(self, session) -> None:
            self.session = session

        def __getattr__(self, name):
            return getattr(self.session, name)

        def executemany(self, sql, rows):
            sizes.append(len(rows))
            return self.session.executemany(sql, rows)

    def counted(work):
        if down.is_set():
            raise StoreUnavailable("the store is unavailable")
        return real(lambda session: work(Counting(session)))
    log = StoreAuditLog(database, "r1")
    monkeypatch.setattr(database, "transaction", counted)
    for number in range(5):
        log.record({"request_id": f"req-{number}"})
    down.clear()
    assert log.flush(5)
    log.close()
    assert max(sizes) == 2 and sum(sizes) == 5  # [2, 2, 1], unless the writer took the first row alone
    assert [e["seq"] for e in read_store_audit_log(database)] == [0, 1, 2, 3, 4]


def test_retries_wait_twice_as_long_each_time_up_to_retry_max_and_the_outage_is_warned_once(database, monkeypatch,
                                                                                          caplog):
    """The waits the writer asks its condition for (a timed test could only guess them); five
    failures in a row are one outage: one warning at its start, one at its end."""
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(store_log, "RETRY_MAX_S", 0.04)
    real, failures, waits = database.transaction, [StoreUnavailable("down")] * 5, []

    def flaky(work):
        if failures:
            raise failures.pop()
        return real(work)
    log = StoreAuditLog(database, "r1")
    condition_wait = log._lock.wait

    def wait(timeout=None):
        if threading.current_thread().name == "audit-store-r1" and timeout is not None:
            waits.append(timeout)
        return condition_wait(timeout)
    log._lock.wait = wait
    monkeypatch.setattr(database, "transaction", flaky)
    with caplog.at_level(logging.WARNING, logger="nowait.gateway"):
        log.record({"request_id": "req-0"})
        assert log.flush(5)
    log.close()
    assert waits == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "1 entr(ies) queued, not written (down): retrying", "written again (0 entr(ies) still queued)"]


runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), prog_name="nowait")


def test_a_path_and_a_store_together_are_a_usage_error(tmp_path):
    for command in ("verify", "spend"):
        result = invoke("audit", command, str(tmp_path / "audit.jsonl"), "--store", f"sqlite:///{tmp_path / 's'}")
        assert (result.exit_code, result.output) == (2, "error: give an audit log path or --store, not both\n")


def test_without_a_path_or_config_the_default_configs_log_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(Path("nowait-data/audit.jsonl"), 2)
    result = invoke("audit", "verify")
    assert result.exit_code == 0 and result.output.startswith("2 entries checked in nowait-data/audit.jsonl")


def test_a_config_whose_store_is_postgresql_reads_that_store_not_the_file(tmp_path):
    config = tmp_path / "nowait.yaml"
    url = f"postgresql://nowait:secret@127.0.0.1:{free_port()}/nowait"  # nothing listens there
    config.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), "store": {"url": url}}))
    for command in ("verify", "spend"):
        result = invoke("audit", command, "--config", str(config))
        assert result.exit_code == 2 and result.output.startswith("error: store postgresql://nowait:***@"), \
            result.output
