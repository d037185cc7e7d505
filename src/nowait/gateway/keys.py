"""API keys as records in the gateway's store: `nw-` secrets shown once, stored as a hash.

A key record holds a public id (`key_...`), its tenant, its times (created, expires, revoked) and
what it allows: models, a data-class floor, requests and tokens per minute, a budget per day.
The store is behind `KeyStore`; `SqlKeyStore` keeps it in a store database with the same
statements on SQLite and PostgreSQL: an embedded gateway's `keys.sqlite` beside the batch store
(`SqliteKeyStore`), or the shared PostgreSQL database that several replicas read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, TypeVar

from nowait.gateway.tenants import Caller, models_named
from nowait.router import DataClass
from nowait.store.database import Database, SqliteDatabase, StoreUnavailable
from nowait.store.schema import Component, migrate, sql_step
from nowait.store.wal_header import WalHeader

log = logging.getLogger("nowait.gateway")

KEY_PREFIX = "nw-"
SECRET_BYTES = 32  # 256 random bits: at least the 128 a key needs, with room to spare
DAY_S = 86_400


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def secret_hash(secret: str) -> str:
    # A plain SHA-256 is enough here, unlike for passwords: the secret holds 256 random bits, so
    # no dictionary or brute force can walk back from a leaked hash; a slow KDF (bcrypt, scrypt)
    # would only add its cost to every request.
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRecord:
    """One API key as stored (never its secret)."""

    id: str
    tenant: str
    created_at: int
    expires_at: int | None = None
    revoked_at: int | None = None
    models: tuple[str, ...] | None = None  # None: every model
    data_class_floor: DataClass | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    budget_usd_per_day: float | None = None

    def usable_at(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def caller(self) -> Caller:
        return self._caller

    @cached_property
    def _caller(self) -> Caller:
        # Built once per record read (a key is looked up on every request); a frozen dataclass's
        # cached_property writes the instance's __dict__, leaving its fields and equality alone.
        return Caller(tenant=self.tenant, key_id=self.id, allowed_models=models_named(self.models),
                      data_class_floor=self.data_class_floor, requests_per_minute=self.requests_per_minute,
                      tokens_per_minute=self.tokens_per_minute, budget_usd_per_day=self.budget_usd_per_day)

    def public(self) -> dict[str, Any]:
        """The record as `keys list` and `/admin/keys` show it."""
        record = asdict(self)
        record["models"] = list(self.models) if self.models is not None else None
        record["data_class_floor"] = self.data_class_floor.value if self.data_class_floor else None
        return {"object": "api_key", **record}


@dataclass(frozen=True)
class KeySettings:
    """What a new key allows (every field optional)."""

    tenant: str
    models: tuple[str, ...] | None = None
    data_class_floor: DataClass | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    budget_usd_per_day: float | None = None
    expires_in_days: float | None = None

    def __post_init__(self) -> None:
        if not self.tenant.strip():
            raise ValueError("tenant must be a non-empty name")
        for name in ("requests_per_minute", "tokens_per_minute", "budget_usd_per_day", "expires_in_days"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")


class KeyStore(Protocol):
    """Where key records live; one call is one transaction."""

    def create(self, settings: KeySettings) -> tuple[str, KeyRecord]: ...

    def find(self, secret: str) -> KeyRecord | None: ...

    def get(self, key_id: str) -> KeyRecord | None: ...

    def list(self, tenant: str | None = None) -> list[KeyRecord]: ...

    def revoke(self, key_id: str) -> KeyRecord | None: ...

    def any_keys(self) -> bool: ...

    def close(self) -> None: ...


SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, secret_sha256 TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL,
    created_at BIGINT NOT NULL, expires_at BIGINT, revoked_at BIGINT, models TEXT, data_class_floor TEXT,
    requests_per_minute INTEGER, tokens_per_minute INTEGER, budget_usd_per_day DOUBLE PRECISION);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant);
"""
KEYS_SCHEMA = Component("keys", (sql_step(SCHEMA),))  # a keys.sqlite from before versions: the same tables
COLUMNS = ("id, tenant, created_at, expires_at, revoked_at, models, data_class_floor, requests_per_minute, "
           "tokens_per_minute, budget_usd_per_day")


# How long `find` (and `any_keys`) may reuse what it read: a key is looked up on every request,
# and reading its row cost more than the rest of the keyed path together. On SQLite the record
# is reused only while the database is unchanged (`data_version`, which moves when another
# connection, such as `nowait keys revoke`, commits; asked only when the wal-index header has
# moved, store/wal_header.py, so a request runs no statement), so a revoke holds from the next request;
# on PostgreSQL (several replicas, no such counter) the age bound alone holds: a key created or
# revoked on one replica is honoured by every replica within FIND_CACHE_S. This store's own
# writes clear the cache at once. While the database is unreachable, a key found before is
# served from its last read, however old (chat and completions keep working; a revoke made
# during the outage, or in the second before it, holds once the database is back), and a key
# not read before is a 503. Only the lookup that finds the database gone waits for it (the
# pool's timeout); until a probe thread finds it back, lookups answer without asking it.
FIND_CACHE_S = 1.0
FIND_CACHE_ENTRIES = 4096  # at most this many keys remembered (cleared whole beyond it)
PROBE_S = 1.0  # while the database is unreachable, how often it is asked again (off the request path)
T = TypeVar("T")


class SqlKeyStore:
    """Key records in a store database (SQLite or PostgreSQL), the same statements on both."""

    def __init__(self, database: Database, clock: Callable[[], float] = time.time,
                 owns_database: bool = False) -> None:
        self.database, self.clock, self._owns_database = database, clock, owns_database
        migrate(database, KEYS_SCHEMA)
        # secret's SHA-256 (never the secret) -> (monotonic time read, record); real time, never
        # the injectable clock, which tests stop; only found keys (unknown secrets would fill it).
        self._found: dict[str, tuple[float, KeyRecord]] = {}
        self._by_id: dict[str, tuple[float, KeyRecord]] = {}  # `get`'s, for a batch's every line
        self._any: tuple[float, bool] | None = None  # any_keys' last answer and when it was read
        self._version = -1
        # The wal-index header seen at the last data_version check: while it reads the same, no
        # connection has committed since, and the check needs no statement (store/wal_header.py).
        self._wal = WalHeader(database.url.path) if database.dialect == "sqlite" else None  # SQLite only
        self._header: bytes | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._down = threading.Event()  # set while the database is unreachable (a probe waits for it)

    def close(self) -> None:
        """Close the database if it is this store's own (a shared one is its opener's to close)."""
        self._closed = True
        if self._wal is not None:
            self._wal.close()
        if self._owns_database:
            self.database.close()

    def _rows(self, sql: str, args: tuple = ()) -> list[Any]:
        return self.database.query(sql, args)

    def _write(self, sql: str, args: tuple) -> None:
        self.database.transaction(lambda session: session.execute(sql, args))
        self._forget()

    def _forget(self) -> None:
        with self._lock:
            self._found.clear()
            self._by_id.clear()
            self._any = None

    def _fresh(self) -> None:
        """Drop what was read if another connection wrote since (SQLite's data_version)."""
        if self._wal is None:  # PostgreSQL: no such counter (FIND_CACHE_S alone bounds a read's age)
            return
        # Read before data_version, so that the header kept is never newer than the version.
        header = self._wal.read()
        if header is not None and header == self._header:
            return  # no commit since the last check
        version = self.database.query("PRAGMA data_version")[0][0]
        with self._lock:
            if version != self._version:
                self._found.clear()
                self._by_id.clear()
                self._any = None
                self._version = version
            self._header = header

    def _last_read(self, cached: tuple[float, T] | None) -> T:
        """What was read before the database became unreachable, else `StoreUnavailable`."""
        if cached is None:
            raise StoreUnavailable(f"the store {self.database.url.redacted} is unavailable: this key was not read "
                                   "before it became so")
        return cached[1]

    def _went_down(self) -> None:
        """From now on, serve the last reads at once (never wait on the unreachable database in
        the request path), while one thread asks the database every PROBE_S until it answers."""
        with self._lock:
            if self._down.is_set():
                return
            self._down.set()
        log.warning("key store %s unreachable: keys found before are served from their last read until it is back",
                    self.database.url.redacted)
        threading.Thread(target=self._probe, name="key-store-probe", daemon=True).start()

    def _probe(self) -> None:
        while True:
            time.sleep(PROBE_S)
            try:
                self.database.query("SELECT 1")
            except Exception:  # still unreachable (or closed): ask again, unless closed
                if self._closed:
                    return
                continue
            self._down.clear()
            log.warning("key store %s reachable again: keys are read from it", self.database.url.redacted)
            return

    @staticmethod
    def _record(row: Any) -> KeyRecord:
        return KeyRecord(id=row["id"], tenant=row["tenant"], created_at=row["created_at"],
                         expires_at=row["expires_at"], revoked_at=row["revoked_at"],
                         models=tuple(json.loads(row["models"])) if row["models"] is not None else None,
                         data_class_floor=DataClass(row["data_class_floor"]) if row["data_class_floor"] else None,
                         requests_per_minute=row["requests_per_minute"], tokens_per_minute=row["tokens_per_minute"],
                         budget_usd_per_day=row["budget_usd_per_day"])

    def create(self, settings: KeySettings) -> tuple[str, KeyRecord]:
        """A new key: its secret (to be shown once, never stored) and its record."""
        secret, now = new_secret(), int(self.clock())
        expires = now + round(settings.expires_in_days * DAY_S) if settings.expires_in_days else None
        record = KeyRecord(id=f"key_{secrets.token_hex(12)}", tenant=settings.tenant.strip(), created_at=now,
                           expires_at=expires, models=tuple(settings.models) if settings.models else None,
                           data_class_floor=DataClass(settings.data_class_floor) if settings.data_class_floor
                           else None, requests_per_minute=settings.requests_per_minute,
                           tokens_per_minute=settings.tokens_per_minute,
                           budget_usd_per_day=settings.budget_usd_per_day)
        self._write(
            "INSERT INTO api_keys (id, secret_sha256, tenant, created_at, expires_at, revoked_at, models, "
            "data_class_floor, requests_per_minute, tokens_per_minute, budget_usd_per_day) "
            "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?)",
            (record.id, secret_hash(secret), record.tenant, now, expires,
             json.dumps(list(record.models)) if record.models else None,
             record.data_class_floor.value if record.data_class_floor else None, record.requests_per_minute,
             record.tokens_per_minute, record.budget_usd_per_day))
        return secret, record

    def find(self, secret: str) -> KeyRecord | None:
        """The record of a presented secret (revoked and expired ones included: the caller decides);
        `StoreUnavailable` only for a key not found before the database became unreachable."""
        digest = secret_hash(secret)
        if self._down.is_set():
            return self._last_read(self._found.get(digest))
        try:
            self._fresh()
            cached = self._found.get(digest)
            if cached is not None and time.monotonic() - cached[0] < FIND_CACHE_S:
                return cached[1]
            read_at = time.monotonic()
            rows = self._rows(f"SELECT {COLUMNS}, secret_sha256 FROM api_keys WHERE secret_sha256 = ?", (digest,))
        except StoreUnavailable:
            self._went_down()
            return self._last_read(self._found.get(digest))
        # The index lookup finds the row; the comparison that decides is constant-time.
        if rows and hmac.compare_digest(rows[0]["secret_sha256"], digest):
            record = self._record(rows[0])
            with self._lock:
                if len(self._found) >= FIND_CACHE_ENTRIES:
                    self._found.clear()
                self._found[digest] = (read_at, record)
            return record
        self._found.pop(digest, None)  # deleted since it was read
        return None

    def get(self, key_id: str) -> KeyRecord | None:
        """The record of a key id (a batch's lines run as their key: asked once a line), reused
        as `find`'s are; no last read is served while the database is unreachable (a batch
        line cannot be recorded then either)."""
        self._fresh()
        cached = self._by_id.get(key_id)
        if cached is not None and time.monotonic() - cached[0] < FIND_CACHE_S:
            return cached[1]
        read_at = time.monotonic()
        rows = self._rows(f"SELECT {COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
        if not rows:
            self._by_id.pop(key_id, None)
            return None
        record = self._record(rows[0])
        with self._lock:
            if len(self._by_id) >= FIND_CACHE_ENTRIES:
                self._by_id.clear()
            self._by_id[key_id] = (read_at, record)
        return record

    def list(self, tenant: str | None = None) -> list[KeyRecord]:
        if tenant is None:
            rows = self._rows(f"SELECT {COLUMNS} FROM api_keys ORDER BY created_at, id")
        else:
            rows = self._rows(f"SELECT {COLUMNS} FROM api_keys WHERE tenant = ? ORDER BY created_at, id", (tenant,))
        return [self._record(r) for r in rows]

    def revoke(self, key_id: str) -> KeyRecord | None:
        """The key's record, revoked from now on (a key revoked before keeps its time)."""
        self._write("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                    (int(self.clock()), key_id))  # clears the cache: honoured on the next request
        return self.get(key_id)

    def any_keys(self) -> bool:
        """Whether the store holds a key (asked on every request: reused as `find`'s records are)."""
        if self._down.is_set():
            return self._last_read(self._any)
        try:
            self._fresh()
            cached = self._any
            if cached is not None and time.monotonic() - cached[0] < FIND_CACHE_S:
                return cached[1]
            read_at = time.monotonic()
            found = bool(self._rows("SELECT 1 FROM api_keys LIMIT 1"))
        except StoreUnavailable:
            self._went_down()
            return self._last_read(self._any)
        self._any = (read_at, found)
        return found


class SqliteKeyStore(SqlKeyStore):
    """Key records in their own SQLite file (WAL: a `nowait keys` command and the server share it)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        database = SqliteDatabase(self.path)
        try:
            super().__init__(database, clock, owns_database=True)
        except BaseException:
            database.close()
            raise


def open_key_store(path: str | Path, clock: Callable[[], float] = time.time) -> KeyStore:
    """The key store of an embedded gateway: its SQLite file. A shared store's keys are a
    `SqlKeyStore` over that database (stores.py, `nowait keys --store`)."""
    return SqliteKeyStore(path, clock)
