"""A real outage of the shared store: a private PostgreSQL server stopped and started again under
a replica's key store and audit log. Keys read before keep working through it, audit entries
recorded meanwhile wait in the queue and are all written, in chain order, once it is back."""

from __future__ import annotations

import time

import pytest

import nowait.gateway.keys as keys
from nowait.gateway.audit import store_log
from nowait.gateway.audit.store_log import StoreAuditLog
from nowait.gateway.audit.store_verify import verify_store
from nowait.gateway.keys import KeySettings, SqlKeyStore
from nowait.store.database import StoreUnavailable, open_database
from nowait.store.scratch_postgres import PostgresNotFound, ScratchPostgres


@pytest.fixture
def private_postgres():
    try:
        server = ScratchPostgres().start()
    except PostgresNotFound as error:
        pytest.fail(f"the PostgreSQL store's tests need a PostgreSQL server: {error}", pytrace=False)
    yield server
    server.close()


def test_a_restarted_database_loses_no_audit_entry_and_known_keys_keep_working(private_postgres, monkeypatch):
    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(store_log, "RETRY_MAX_S", 0.2)
    monkeypatch.setattr(keys, "PROBE_S", 0.05)
    monkeypatch.setattr(keys, "FIND_CACHE_S", 0.0)  # every lookup asks the database
    database = open_database(private_postgres.url)
    audit, key_store = StoreAuditLog(database, "r1"), SqlKeyStore(database)
    secret, record = key_store.create(KeySettings(tenant="teamOutage"))
    assert key_store.find(secret) == record
    for number in range(2):
        audit.record({"request_id": f"before-{number}", "tenant": "teamOutage", "status": 200, "cost_usd": 0.1})
    assert audit.flush()

    private_postgres.stop()
    started = time.monotonic()
    for number in range(3):
        audit.record({"request_id": f"during-{number}", "tenant": "teamOutage", "status": 200, "cost_usd": 0.1})
    recording_s = time.monotonic() - started
    assert key_store.find(secret) == record  # its last read, the database being gone
    with pytest.raises(StoreUnavailable):
        key_store.find(keys.new_secret())
    assert not audit.flush(0.5) and audit.queued == 3

    private_postgres.stop = lambda mode="fast": None  # already stopped: `restart` only starts it again
    private_postgres.restart()
    assert audit.flush(60)
    audit.close()
    verdict = verify_store(database)
    assert verdict.ok, verdict.broken
    assert verdict.replicas["r1"].entries == 5
    written = [row["entry"] for row in database.query("SELECT entry FROM audit_entries ORDER BY seq")]
    assert [w.split('"request_id":"')[1].split('"')[0] for w in written] == \
        ["before-0", "before-1", "during-0", "during-1", "during-2"]
    for _ in range(600):  # the probe finds the database back
        if not key_store._down.is_set():
            break
        time.sleep(0.05)
    other, other_record = SqlKeyStore(database).create(KeySettings(tenant="teamAfter"))
    assert key_store.find(other) == other_record
    print(f"3 entries recorded during the outage in {recording_s * 1e3:.2f} ms (the request path never waits)")
    database.close()
