"""Keys in the shared store (keys.py's SqlKeyStore) on SQLite and on the session's PostgreSQL:
a key created or revoked through one store is honoured through another on the same database
within FIND_CACHE_S, keys found before an outage keep working through it, no secret is stored,
a newer schema is refused; and `nowait keys` with `--store` or a config's PostgreSQL store."""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import pytest
import yaml
from typer.testing import CliRunner

import nowait.gateway.keys as keys
from nowait.cli import app as nowait_app
from nowait.gateway.keys import KeySettings, SqlKeyStore
from nowait.store.database import StoreUnavailable, open_database
from nowait.store.scratch_postgres import free_port
from nowait.store.url import StoreError

runner = CliRunner()


@pytest.fixture
def two_replicas(store_url):
    """Two key stores on one database, each with its own connection(s), as two replicas hold."""
    first, second = open_database(store_url), open_database(store_url)
    yield SqlKeyStore(first), SqlKeyStore(second)
    first.close()
    second.close()


class Later:
    """Moves the keys module's monotonic clock (the cache's) forward."""

    def __init__(self, monkeypatch) -> None:
        self.offset, self._real = 0.0, keys.time.monotonic
        monkeypatch.setattr(keys.time, "monotonic", lambda: self._real() + self.offset)

    def past_the_cache(self) -> None:
        self.offset += keys.FIND_CACHE_S + 0.01


def test_a_key_created_on_one_replica_is_found_by_the_other_and_a_revoke_holds_within_the_cache_bound(
        two_replicas, monkeypatch):
    here, there = two_replicas
    later = Later(monkeypatch)
    assert not there.any_keys()
    secret, record = here.create(KeySettings(tenant="teamShared", models=("ar",), requests_per_minute=5))
    later.past_the_cache()  # `there` read `any_keys` before the create: its answer may be that old
    assert there.any_keys()
    assert there.find(secret) == record and there.find(secret).caller().tenant == "teamShared"
    assert there.get(record.id) == record and there.get("key_nosuch") is None
    assert there.find(secret + "x") is None

    revoked = here.revoke(record.id)
    assert revoked is not None and revoked.revoked_at is not None
    assert here.find(secret).revoked_at is not None  # its own store: at once
    later.past_the_cache()
    assert there.find(secret).revoked_at == revoked.revoked_at  # another replica: within FIND_CACHE_S
    assert there.get(record.id).revoked_at == revoked.revoked_at  # a batch line of the key: refused too


def test_on_postgresql_a_lookup_is_reused_for_at_most_the_cache_bound(postgres_url, monkeypatch):
    """The age bound is what holds across replicas there: a row changed behind a store's back
    is seen once FIND_CACHE_S has passed, not before (the cache does save the round trip)."""
    database = open_database(postgres_url)
    store, later = SqlKeyStore(database), Later(monkeypatch)
    secret, record = store.create(KeySettings(tenant="teamCache"))
    assert store.find(secret) == record and store.get(record.id) == record
    database.transaction(lambda s: s.execute("UPDATE api_keys SET revoked_at = 1 WHERE id = ?", (record.id,)))
    assert store.find(secret).revoked_at is None and store.get(record.id).revoked_at is None
    later.past_the_cache()
    assert store.find(secret).revoked_at == 1 and store.get(record.id).revoked_at == 1
    database.close()


def test_keys_found_before_an_outage_keep_working_through_it_and_others_are_unavailable(store_url, monkeypatch):
    monkeypatch.setattr(keys, "PROBE_S", 0.01)
    database = open_database(store_url)
    store, later = SqlKeyStore(database), Later(monkeypatch)
    known, record = store.create(KeySettings(tenant="teamKnown"))
    unknown, _ = store.create(KeySettings(tenant="teamNew"))
    assert store.find(known) == record and store.any_keys()
    real_query, calls = database.query, []

    def unreachable(sql, args=()):
        calls.append(sql)
        raise StoreUnavailable("the store is unavailable: connection refused")

    monkeypatch.setattr(database, "query", unreachable)
    later.past_the_cache()
    assert store.find(known) == record  # served from its last read, however old
    assert store.any_keys()
    with pytest.raises(StoreUnavailable):
        store.find(unknown)  # never read: a 503, not a 401
    asked = len(calls)
    for _ in range(20):
        store.find(known)
    assert len([c for c in calls[asked:] if "api_keys" in c]) == 0  # lookups no longer ask the database

    monkeypatch.setattr(database, "query", real_query)
    for _ in range(500):  # the probe thread clears the mark once the database answers again
        if not store._down.is_set():
            break
        time.sleep(0.01)
    assert store.find(unknown) is not None
    database.close()


def test_no_secret_is_stored_in_clear(store_url):
    database = open_database(store_url)
    store = SqlKeyStore(database)
    secrets = [store.create(KeySettings(tenant=f"team{n}"))[0] for n in range(3)]
    for secret in secrets:
        store.find(secret)
    table = database.query("SELECT * FROM api_keys")
    cells = " ".join(str(value) for row in table for value in (row.values() if isinstance(row, dict) else row))
    assert len(table) == 3
    for secret in secrets:
        assert secret not in cells and secret.removeprefix(keys.KEY_PREFIX) not in cells
        assert keys.secret_hash(secret) in cells
    database.close()


def test_a_newer_keys_schema_is_refused_with_one_line(store_url):
    database = open_database(store_url)
    SqlKeyStore(database)
    database.transaction(lambda s: s.execute("UPDATE nowait_schema SET version = 7 WHERE component = 'keys'"))
    with pytest.raises(StoreError) as refused:
        SqlKeyStore(database)
    message = str(refused.value)
    assert "keys schema is at version 7" in message and "\n" not in message
    password = urlsplit(store_url).password
    assert password is None or password not in message
    result = runner.invoke(nowait_app, ["keys", "list", "--store", store_url])
    assert result.exit_code == 2 and "keys schema is at version 7" in result.output
    database.close()


def invoke(*args: str):
    return runner.invoke(nowait_app, list(args))


def test_nowait_keys_create_list_revoke_with_store(store_url):
    made = invoke("keys", "create", "--tenant", "teamCli", "--rpm", "9", "--store", store_url, "--json")
    assert made.exit_code == 0, made.output
    created = json.loads(made.stdout)
    database = open_database(store_url)
    server = SqlKeyStore(database)  # a replica reading the same database
    assert server.find(created["key"]).id == created["id"]

    listed = json.loads(invoke("keys", "list", "--tenant", "teamCli", "--store", store_url, "--json").stdout)
    assert [r["id"] for r in listed] == [created["id"]] and listed[0]["requests_per_minute"] == 9
    assert created["key"] not in invoke("keys", "list", "--store", store_url).output

    revoked = invoke("keys", "revoke", created["id"], "--store", store_url)
    assert revoked.exit_code == 0 and f"revoked {created['id']}" in revoked.output
    assert SqlKeyStore(database).find(created["key"]).revoked_at is not None
    missing = invoke("keys", "revoke", "key_nosuchkey", "--store", store_url)
    assert missing.exit_code == 2 and "no key 'key_nosuchkey'" in missing.output
    database.close()


def test_nowait_keys_uses_the_postgresql_store_a_config_names(postgres_url, tmp_path):
    config = tmp_path / "nowait.yaml"
    config.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), "store": {"url": postgres_url}}))
    made = invoke("keys", "create", "--tenant", "teamConfig", "--config", str(config), "--json")
    assert made.exit_code == 0, made.output
    database = open_database(postgres_url)
    assert [r.tenant for r in SqlKeyStore(database).list()] == ["teamConfig"]
    database.close()
    assert not (tmp_path / "data" / "keys.sqlite").exists()  # not the embedded file


def test_a_store_that_cannot_be_used_is_one_line_and_exit_2(postgres_server):
    password = postgres_server.password
    cases = {
        "mysql://u:p@h/db": "expected sqlite:///PATH or postgresql://",
        f"postgresql://nowait:{password}@127.0.0.1:{free_port()}/nowait": "127.0.0.1",  # nothing listens
        postgres_server.url_for("nowait", password="wrong-" + password): "password authentication failed",
    }
    for url, says in cases.items():
        result = invoke("keys", "list", "--store", url)
        assert result.exit_code == 2, (url, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
        assert password not in result.output and "wrong-" not in result.output
