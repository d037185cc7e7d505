"""API keys as records in the gateway's store: `nw-` secrets shown once, stored as a hash.

A key record holds a public id (`key_...`), its tenant, its times (created, expires, revoked) and
what it allows: models, a data-class floor, requests and tokens per minute, a budget per day.
The store is behind `KeyStore`; `SqliteKeyStore` keeps it in `keys.sqlite` beside the batch
store (its SQL is kept portable, so a PostgreSQL store can take the same statements).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from nowait.gateway.tenants import Caller, models_named
from nowait.router import DataClass

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
COLUMNS = ("id, tenant, created_at, expires_at, revoked_at, models, data_class_floor, requests_per_minute, "
           "tokens_per_minute, budget_usd_per_day")


# How long `find` may reuse a record it read: a key is looked up on every request, and reading
# its row cost more than the rest of the keyed path together. The record is reused only while
# the database is unchanged (SQLite's `data_version`, which moves when another connection, such
# as `nowait keys revoke`, commits; this store's own revoke clears the cache), so a revoke still
# holds from the next request; the age bound is a second guard.
FIND_CACHE_S = 1.0
FIND_CACHE_ENTRIES = 4096  # at most this many keys remembered (cleared whole beyond it)


class SqliteKeyStore:
    """Key records in one SQLite file (WAL: a `nowait keys` command and the server share it)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path, self.clock = Path(path), clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=10)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        # secret's SHA-256 -> (monotonic time read, record), valid for `_version`: real time,
        # never the injectable clock, which tests stop; only found keys (unknown secrets would fill it).
        self._found: dict[str, tuple[float, KeyRecord]] = {}
        self._version = -1

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    @staticmethod
    def _record(row: sqlite3.Row) -> KeyRecord:
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
        """The record of a presented secret (revoked and expired ones included: the caller decides)."""
        digest = secret_hash(secret)
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._version:  # another connection wrote: what was read may be stale
            self._found.clear()
            self._version = version
        cached = self._found.get(digest)
        if cached is not None and time.monotonic() - cached[0] < FIND_CACHE_S:
            return cached[1]
        read_at = time.monotonic()
        rows = self._rows(f"SELECT {COLUMNS}, secret_sha256 FROM api_keys WHERE secret_sha256 = ?", (digest,))
        # The index lookup finds the row; the comparison that decides is constant-time.
        if rows and hmac.compare_digest(rows[0]["secret_sha256"], digest):
            record = self._record(rows[0])
            if len(self._found) >= FIND_CACHE_ENTRIES:
                self._found.clear()
            self._found[digest] = (read_at, record)
            return record
        return None

    def get(self, key_id: str) -> KeyRecord | None:
        rows = self._rows(f"SELECT {COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
        return self._record(rows[0]) if rows else None

    def list(self, tenant: str | None = None) -> list[KeyRecord]:
        if tenant is None:
            rows = self._rows(f"SELECT {COLUMNS} FROM api_keys ORDER BY created_at, id")
        else:
            rows = self._rows(f"SELECT {COLUMNS} FROM api_keys WHERE tenant = ? ORDER BY created_at, id", (tenant,))
        return [self._record(r) for r in rows]

    def revoke(self, key_id: str) -> KeyRecord | None:
        """The key's record, revoked from now on (a key revoked before keeps its time)."""
        self._write("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                    (int(self.clock()), key_id))
        self._found.clear()  # honoured on the next request, not a second later
        return self.get(key_id)

    def any_keys(self) -> bool:
        return bool(self._rows("SELECT 1 FROM api_keys LIMIT 1"))


def open_key_store(path: str | Path, clock: Callable[[], float] = time.time) -> KeyStore:
    """The key store the configuration names: today a SQLite file. A shared PostgreSQL store
    (several gateway replicas) would be chosen here, behind the same `KeyStore` interface, with
    the same statements (the SQL above keeps to what both databases accept)."""
    return SqliteKeyStore(path, clock)

