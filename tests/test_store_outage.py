"""A real outage of the shared store: a private PostgreSQL server stopped and started again under
a replica's key store and audit log. Keys read before keep working through it, audit entries
recorded meanwhile wait in the queue and are all written, in chain order, once it is back."""

from __future__ import annotations

import json
import time

import pytest

import nowait.gateway.keys as keys
from nowait.gateway.audit import store_log
from nowait.gateway.audit.store_log import StoreAuditLog
from nowait.gateway.audit.store_verify import verify_store
from nowait.gateway.keys import KeySettings, SqlKeyStore
from nowait.store.database import StoreUnavailable, open_database


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


def test_a_gateway_on_the_shared_store_keeps_answering_known_keys_while_it_is_down(private_postgres, codec,
                                                                                   tmp_path, monkeypatch):
    """Through the real middleware: a key the replica read keeps chatting, one it never read is
    503 store_unavailable with Retry-After (not a 401), and the entries of the outage reach the
    store's chain once it is back."""
    from tests.gateway_support import base_config, free_port, live_server, save_tiny_models
    from tests.tenant_support import chat

    monkeypatch.setattr(store_log, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(store_log, "RETRY_MAX_S", 0.2)
    monkeypatch.setattr(keys, "PROBE_S", 0.05)
    models = save_tiny_models(tmp_path / "models", codec)
    config = base_config(models, tmp_path / "data", free_port(), store={"url": private_postgres.url, "replica": "r1"})
    database = open_database(private_postgres.url)
    with live_server(config) as server:
        operator = SqlKeyStore(database)  # `nowait keys create --store`, another connection
        known, _ = operator.create(KeySettings(tenant="teamKnown"))
        unread, _ = operator.create(KeySettings(tenant="teamUnread"))
        assert chat(server, known).status_code == 200
        private_postgres.stop()
        monkeypatch.setattr(keys, "FIND_CACHE_S", 0.0)  # the lookups below ask the (gone) database
        answers = [chat(server, known) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200], answers[0].text
        refused = chat(server, unread)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_unavailable"
        assert refused.headers["retry-after"]
        private_postgres.stop = lambda mode="fast": None
        private_postgres.restart()
        assert server.gateway.audit.flush(60)
    verdict = verify_store(database)
    assert verdict.ok, verdict.broken
    tenants = [json.loads(row["entry"]).get("tenant") for row in
               database.query("SELECT entry FROM audit_entries WHERE replica = 'r1' ORDER BY seq")]
    assert tenants.count("teamKnown") == 3  # the chat before the outage and both during it
    database.close()
