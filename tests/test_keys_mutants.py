"""The key store piece by piece on SQLite, fast enough for mutmut: a secret and its hash, a record
field by field (as stored, as a caller, as `keys list` shows it), the settings it refuses, the
expiry and cache edges on clocks the test sets (the injected clock for times, the monotonic one
for the cache), the cache's size bound, and an outage: last reads served, the probe's return."""

from __future__ import annotations

import hashlib
import logging
import re
import sqlite3
import threading
import time

import pytest

import nowait.gateway.keys as keys
from nowait.gateway.keys import KeyRecord, KeySettings, SqliteKeyStore, SqlKeyStore, open_key_store
from nowait.router import DataClass
from nowait.store.database import SqliteDatabase, StoreUnavailable
from nowait.store.url import StoreError
from nowait.store.wal_header import HEADER_BYTES, WalHeader
from tests.store_support import postgres_like_sqlite

NOW = 1_000_000


class Monotonic:
    """The keys module's monotonic clock (the cache's), moved by the test."""

    def __init__(self, monkeypatch) -> None:
        self.t = 500.0
        monkeypatch.setattr(keys.time, "monotonic", lambda: self.t)


@pytest.fixture
def store(tmp_path):
    """Keys on SQLite whose rows read as PostgreSQL's (case-sensitive names)."""
    opened = SqlKeyStore(postgres_like_sqlite(tmp_path / "keys.sqlite"), clock=lambda: NOW + 0.9, owns_database=True)
    yield opened
    opened.close()


def delete_behind(store: SqlKeyStore, key_id: str) -> None:
    """Remove a row through the store's own connection: SQLite's data_version does not move."""
    store.database.transaction(lambda s: s.execute("DELETE FROM api_keys WHERE id = ?", (key_id,)))


def test_a_secret_is_long_random_and_prefixed_and_its_hash_is_its_sha256():
    first, second = keys.new_secret(), keys.new_secret()
    assert first.startswith("nw-") and len(first) == 3 + 43 and first != second  # 32 bytes, base64url
    assert re.fullmatch(r"nw-[A-Za-z0-9_-]{43}", first)
    assert keys.secret_hash("nw-abc") == hashlib.sha256(b"nw-abc").hexdigest()


def test_a_record_is_usable_until_its_expiry_unless_revoked():
    assert KeyRecord("key_1", "t", 0).usable_at(10**12)
    expiring = KeyRecord("key_1", "t", 0, expires_at=100)
    assert expiring.usable_at(99.9) and not expiring.usable_at(100) and not expiring.usable_at(101)
    assert not KeyRecord("key_1", "t", 0, revoked_at=5).usable_at(1)
    assert not KeyRecord("key_1", "t", 0, expires_at=100, revoked_at=5).usable_at(1)


def test_a_record_as_a_caller_and_as_listed():
    record = KeyRecord("key_1", "teamA", 7, expires_at=9, revoked_at=8, models=("m1", "m2"),
                       data_class_floor=DataClass.internal, requests_per_minute=3, tokens_per_minute=4,
                       budget_usd_per_day=1.5)
    caller = record.caller()
    assert (caller.tenant, caller.key_id, caller.allowed_models, caller.data_class_floor) == (
        "teamA", "key_1", frozenset({"m1", "m2"}), DataClass.internal)
    assert (caller.requests_per_minute, caller.tokens_per_minute, caller.budget_usd_per_day) == (3, 4, 1.5)
    assert record.public() == {"object": "api_key", "id": "key_1", "tenant": "teamA", "created_at": 7,
                               "expires_at": 9, "revoked_at": 8, "models": ["m1", "m2"],
                               "data_class_floor": "internal", "requests_per_minute": 3, "tokens_per_minute": 4,
                               "budget_usd_per_day": 1.5}
    plain = KeyRecord("key_2", "teamB", 1).public()
    assert (plain["models"], plain["data_class_floor"]) == (None, None)
    assert KeyRecord("key_2", "teamB", 1).caller().allowed_models is None


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute", "budget_usd_per_day",
                                   "expires_in_days"])
def test_settings_refuse_a_limit_that_is_not_positive(field):
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"^{field} must be > 0, got {bad}$"):
            KeySettings(tenant="t", **{field: bad})
    assert getattr(KeySettings(tenant="t", **{field: 1}), field) == 1


def test_settings_refuse_an_empty_tenant():
    for bad in ("", "  "):
        with pytest.raises(ValueError, match=r"^tenant must be a non-empty name$"):
            KeySettings(tenant=bad)


def test_a_created_key_is_stored_field_by_field_and_found_by_its_secret_only(store):
    settings = KeySettings(tenant=" teamA ", models=("m1",), data_class_floor=DataClass.restricted,
                           requests_per_minute=5, tokens_per_minute=6, budget_usd_per_day=0.5, expires_in_days=1.5)
    secret, record = store.create(settings)
    assert secret.startswith("nw-") and re.fullmatch(r"key_[0-9a-f]{24}", record.id)
    assert record == KeyRecord(record.id, "teamA", NOW, expires_at=NOW + 129_600, revoked_at=None, models=("m1",),
                               data_class_floor=DataClass.restricted, requests_per_minute=5, tokens_per_minute=6,
                               budget_usd_per_day=0.5)
    assert store.find(secret) == record and store.get(record.id) == record
    [row] = store.database.query("SELECT secret_sha256 FROM api_keys")
    assert row["secret_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    assert store.find(secret + "x") is None and store.find("") is None
    plain_secret, plain = store.create(KeySettings(tenant="teamB", models=()))
    assert plain == KeyRecord(plain.id, "teamB", NOW)
    assert store.find(plain_secret) == plain and store.get(plain.id) == plain
    assert store.create(KeySettings(tenant="teamB"))[1].id != plain.id
    assert store.create(KeySettings(tenant="t", expires_in_days=1 / 86_400 * 0.6))[1].expires_at == NOW + 1


def test_keys_are_listed_by_creation_then_id_and_by_tenant(tmp_path):
    times = iter([30, 10, 20, 10])
    store = SqliteKeyStore(tmp_path / "keys.sqlite", clock=lambda: next(times))
    made = [store.create(KeySettings(tenant=t))[1] for t in ("a", "b", "a", "b")]
    by_time = sorted(made, key=lambda r: (r.created_at, r.id))
    assert store.list() == by_time
    assert store.list(tenant="b") == [r for r in by_time if r.tenant == "b"]
    assert store.list(tenant="none") == []
    store.close()


def test_a_revoke_takes_the_clocks_time_once_and_holds_at_once(tmp_path):
    now = [100.7]
    store = SqliteKeyStore(tmp_path / "keys.sqlite", clock=lambda: now[0])
    secret, record = store.create(KeySettings(tenant="t"))
    assert store.find(secret) == record and store.get(record.id) == record
    now[0] = 200.2
    revoked = store.revoke(record.id)
    assert revoked == KeyRecord(record.id, "t", 100, revoked_at=200)
    assert store.find(secret) == revoked and store.get(record.id) == revoked  # not the cached reads
    now[0] = 300
    assert store.revoke(record.id).revoked_at == 200  # revoked before: keeps its time
    assert store.revoke("key_none") is None
    store.close()


def test_find_reuses_a_read_for_less_than_the_cache_bound(store, monkeypatch):
    clock = Monotonic(monkeypatch)
    secret, record = store.create(KeySettings(tenant="t"))
    assert store.find(secret) == record
    delete_behind(store, record.id)
    clock.t += keys.FIND_CACHE_S - 0.25
    assert store.find(secret) == record  # reused
    clock.t += 0.25  # exactly the bound: read again
    assert store.find(secret) is None
    store._down.set()  # forgotten once found deleted: no last read to serve
    with pytest.raises(StoreUnavailable, match="this key was not read before it became so"):
        store.find(secret)
    store._down.clear()


def test_get_reuses_a_read_for_less_than_the_cache_bound_and_forgets_a_deleted_key(store, monkeypatch):
    clock = Monotonic(monkeypatch)
    _secret, record = store.create(KeySettings(tenant="t"))
    assert store.get(record.id) == record
    delete_behind(store, record.id)
    clock.t += keys.FIND_CACHE_S - 0.25
    assert store.get(record.id) == record
    clock.t += 0.25
    assert store.get(record.id) is None
    assert record.id not in store._by_id
    assert store.get("key_none") is None


def test_a_write_by_another_connection_clears_what_was_read(tmp_path, monkeypatch):
    Monotonic(monkeypatch)  # stopped: only the data_version can make the store read again
    server = SqliteKeyStore(tmp_path / "keys.sqlite")
    command = SqliteKeyStore(tmp_path / "keys.sqlite")
    secret, record = server.create(KeySettings(tenant="t"))
    assert server.find(secret) == record and server.get(record.id) == record and server.any_keys()
    command.revoke(record.id)
    assert server.find(secret).revoked_at is not None
    command.revoke(record.id)  # no change, but a commit: the version moves
    command.database.transaction(lambda s: s.execute("DELETE FROM api_keys"))
    assert server.get(record.id) is None
    assert not server.any_keys()
    command.create(KeySettings(tenant="t"))
    assert server.any_keys()
    server.close()
    command.close()


def test_this_stores_own_writes_clear_every_read(store, monkeypatch):
    Monotonic(monkeypatch)
    assert not store.any_keys()
    secret, record = store.create(KeySettings(tenant="t"))
    assert store.any_keys()  # not the cached False
    assert store.get(record.id) == record and store.find(secret) == record
    store.revoke(record.id)
    assert store.find(secret).revoked_at == NOW and store.get(record.id).revoked_at == NOW


def test_any_keys_reuses_its_answer_for_less_than_the_cache_bound(store, monkeypatch):
    clock = Monotonic(monkeypatch)
    _secret, record = store.create(KeySettings(tenant="t"))
    assert store.any_keys()
    delete_behind(store, record.id)
    clock.t += keys.FIND_CACHE_S - 0.25
    assert store.any_keys()
    clock.t += 0.25
    assert not store.any_keys()
    assert store._any == (clock.t, False)


def test_the_caches_are_cleared_whole_beyond_their_bound(store, monkeypatch):
    monkeypatch.setattr(keys, "FIND_CACHE_ENTRIES", 2)
    Monotonic(monkeypatch)
    made = [store.create(KeySettings(tenant="t")) for _ in range(3)]
    for secret, record in made[:2]:
        assert store.find(secret) == record and store.get(record.id) == record
    assert len(store._found) == len(store._by_id) == 2
    secret, record = made[2]
    assert store.find(secret) == record and store.get(record.id) == record
    assert store._found == {keys.secret_hash(secret): (500.0, record)}
    assert store._by_id == {record.id: (500.0, record)}


class Outage:
    """The store's database unreachable (every query raises) until `end()`."""

    def __init__(self, store: SqlKeyStore, monkeypatch) -> None:
        self.store, self.real, self.calls = store, store.database.query, []
        monkeypatch.setattr(keys, "PROBE_S", 0.01)
        monkeypatch.setattr(store.database, "query", self.unreachable)

    def unreachable(self, sql, args=()):
        self.calls.append(sql)
        raise StoreUnavailable("connection refused")

    def end(self) -> None:
        self.store.database.query = self.real


def probe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "key-store-probe"]


def wait_for(condition) -> bool:
    for _ in range(1000):
        if condition():
            return True
        time.sleep(0.005)
    return False


def test_through_an_outage_last_reads_are_served_without_asking_and_one_probe_waits(store, monkeypatch, caplog):
    clock = Monotonic(monkeypatch)
    secret, record = store.create(KeySettings(tenant="t"))
    unknown, _ = store.create(KeySettings(tenant="t"))
    assert store.find(secret) == record and store.any_keys()
    clock.t += 5
    outage = Outage(store, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nowait.gateway"):
        assert store.find(secret) == record  # the lookup that finds it gone
        assert store._down.is_set() and [t.daemon for t in probe_threads()] == [True]  # never holds up an exit
        assert store.any_keys() and store.find(secret) == record
        with pytest.raises(StoreUnavailable, match=r"^the store sqlite:///.*keys\.sqlite is unavailable"):
            store.find(unknown)
        store._went_down()  # a second finding starts no second probe
        assert len(probe_threads()) == 1
        store._any = None  # any_keys never read: none to serve
        with pytest.raises(StoreUnavailable):
            store.any_keys()
        assert wait_for(lambda: len(outage.calls) > 4)
        assert all(sql == "SELECT 1" for sql in outage.calls[-3:])  # the probe asks
        outage.end()
        assert wait_for(lambda: not store._down.is_set() and not probe_threads())
    url = store.database.url.redacted
    assert [r.getMessage() for r in caplog.records] == [
        f"key store {url} unreachable: keys found before are served from their last read until it is back",
        f"key store {url} reachable again: keys are read from it"]
    assert store.find(unknown) is not None


def test_a_probe_of_a_closed_store_stops(store, monkeypatch):
    Outage(store, monkeypatch)
    store._went_down()
    assert len(probe_threads()) == 1
    store.close()
    assert wait_for(lambda: not probe_threads())
    assert store._down.is_set()


def test_a_store_closes_only_its_own_database(tmp_path):
    database = SqliteDatabase(tmp_path / "shared.sqlite")
    SqlKeyStore(database).close()
    assert database.query("SELECT 1")[0][0] == 1
    SqlKeyStore(database, owns_database=True).close()
    with pytest.raises(Exception, match="closed"):
        database.query("SELECT 1")


def test_a_key_file_at_a_newer_schema_is_refused_and_its_database_closed(tmp_path, monkeypatch):
    path = tmp_path / "keys.sqlite"
    SqliteKeyStore(path).close()
    database = SqliteDatabase(path)
    database.transaction(lambda s: s.execute("UPDATE nowait_schema SET version = 9 WHERE component = 'keys'"))
    database.close()
    opened: list[SqliteDatabase] = []

    class Recorded(SqliteDatabase):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(keys, "SqliteDatabase", Recorded)
    with pytest.raises(StoreError, match="keys schema is at version 9"):
        SqliteKeyStore(path)
    with pytest.raises(Exception, match="closed"):
        opened[0].query("SELECT 1")


def test_open_key_store_is_the_sqlite_file_with_the_clock_given(tmp_path):
    store = open_key_store(tmp_path / "k" / "keys.sqlite", clock=lambda: 42)
    assert isinstance(store, SqliteKeyStore) and store.path == tmp_path / "k" / "keys.sqlite"
    assert store.create(KeySettings(tenant="t"))[1].created_at == 42
    store.close()
    with pytest.raises(Exception, match="closed"):  # its own file's database
        store.database.query("SELECT 1")


def test_any_keys_finding_the_outage_serves_its_last_answer(store, monkeypatch):
    clock = Monotonic(monkeypatch)
    store.create(KeySettings(tenant="t"))
    assert store.any_keys()
    clock.t += 5
    Outage(store, monkeypatch)
    assert store.any_keys() and store._down.is_set() and len(probe_threads()) == 1
    store.close()
    assert wait_for(lambda: not probe_threads())


def test_an_outage_before_any_read_serves_nothing(store, monkeypatch):
    Outage(store, monkeypatch)
    with pytest.raises(StoreUnavailable):
        store.find("nw-never-read")  # the lookup that finds the database gone
    with pytest.raises(StoreUnavailable):
        store.any_keys()  # never answered: no last answer to serve
    store.close()
    assert wait_for(lambda: not probe_threads())


# --- the change check without a statement (store/wal_header.py) ---


def test_the_wal_header_moves_with_every_commit_of_any_connection(tmp_path):
    database = SqliteDatabase(tmp_path / "k.sqlite")
    database.transaction(lambda s: s.execute("CREATE TABLE t (x)"))
    header = WalHeader(tmp_path / "k.sqlite")
    seen = header.read()
    assert seen is not None and len(seen) == HEADER_BYTES
    assert header.read() == seen  # nothing committed since
    other = sqlite3.connect(tmp_path / "k.sqlite")
    for value in range(3):  # each commit of another connection, and of the database's own
        other.execute("INSERT INTO t VALUES (?)", (value,))
        other.commit()
        assert header.read() != seen
        seen = header.read()
        database.transaction(lambda s: s.execute("INSERT INTO t VALUES (9)"))
        assert header.read() != seen
        seen = header.read()
    other.close()
    header.close()
    assert header.read() is None
    database.close()
    assert WalHeader(tmp_path / "none.sqlite").read() is None  # no -shm file: nothing to read
    (tmp_path / "short.sqlite-shm").write_bytes(b"\0" * (HEADER_BYTES - 1))
    assert WalHeader(tmp_path / "short.sqlite").read() is None  # shorter than a header: none mapped
    (tmp_path / "exact.sqlite-shm").write_bytes(bytes(range(HEADER_BYTES)))
    assert WalHeader(tmp_path / "exact.sqlite").read() == bytes(range(HEADER_BYTES))


class CountedStatements:
    """The statements a store's database runs, by their first word."""

    def __init__(self, store: SqlKeyStore, monkeypatch) -> None:
        self.run: list[str] = []
        query = store.database.query
        monkeypatch.setattr(store.database, "query", lambda sql, args=(): self.run.append(sql.split()[0])
                            or query(sql, args))


def test_while_the_wal_header_stays_the_same_a_lookup_runs_no_statement(tmp_path, monkeypatch):
    clock = Monotonic(monkeypatch)
    server = SqliteKeyStore(tmp_path / "keys.sqlite")
    command = SqliteKeyStore(tmp_path / "keys.sqlite")
    secret, record = command.create(KeySettings(tenant="t"))
    statements = CountedStatements(server, monkeypatch)
    assert server.find(secret) == record and statements.run == ["PRAGMA", "SELECT"]
    assert server.find(secret) == record and server.any_keys()
    assert statements.run == ["PRAGMA", "SELECT", "SELECT"]  # any_keys' first read; no version asked
    clock.t += keys.FIND_CACHE_S
    assert server.find(secret) == record
    assert statements.run[3:] == ["SELECT"]  # the age bound still holds; the header said unchanged
    command.revoke(record.id)  # another connection commits: the header moves
    assert server.find(secret).revoked_at is not None
    assert statements.run[4:] == ["PRAGMA", "SELECT"]
    server.close()
    assert server._wal.read() is None  # the mapping goes with the store
    command.close()


def test_without_a_wal_header_every_lookup_asks_the_version(tmp_path, monkeypatch):
    Monotonic(monkeypatch)
    server = SqliteKeyStore(tmp_path / "keys.sqlite")
    command = SqliteKeyStore(tmp_path / "keys.sqlite")
    secret, record = command.create(KeySettings(tenant="t"))
    monkeypatch.setattr(server._wal, "read", lambda: None)  # e.g. a system without mmap
    statements = CountedStatements(server, monkeypatch)
    assert server.find(secret) == record and server.find(secret) == record
    assert statements.run == ["PRAGMA", "SELECT", "PRAGMA"]
    command.revoke(record.id)
    assert server.find(secret).revoked_at is not None
    server.close()
    command.close()
