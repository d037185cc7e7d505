"""One small interface over the two databases the store runs on, so the stores above it
(batches, keys, audit) write each statement once.

Statements are written with `?` placeholders and the SQL both databases accept; on PostgreSQL the
placeholders become `%s`. Rows are read by column name. `transaction(work)` runs `work(session)`
in one transaction and commits it, or rolls it back if `work` raises.

SQLite: one connection behind a lock (WAL, synchronous=FULL, BEGIN IMMEDIATE), errors as sqlite3
raises them. PostgreSQL: a psycopg 3 connection pool; a connection is checked before use, so a
restarted server costs the next transaction a reconnect, not an error; a server that cannot be
reached raises `StoreUnavailable` (the gateway answers 503 with Retry-After).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from nowait.store.url import StoreError, StoreURL, parse_store_url, redact, redact_text

log = logging.getLogger("nowait.store")
T = TypeVar("T")
CONNECT_TIMEOUT_S = 5
POOL_MAX = 10


class StoreUnavailable(RuntimeError):
    """The shared database could not be reached for this transaction (nothing was committed)."""


class Session(Protocol):
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...


class Database(Protocol):
    dialect: str  # "sqlite" or "postgresql"
    url: StoreURL

    def transaction(self, work: Callable[[Session], T]) -> T: ...

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]: ...

    def close(self) -> None: ...


class SqliteDatabase:
    dialect = "sqlite"

    def __init__(self, path: str | Path, timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self.url = StoreURL("sqlite", f"sqlite:///{self.path}", self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=timeout_s)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")

    def transaction(self, work: Callable[[Session], T]) -> T:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = work(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.OperationalError:  # disk full or locked at commit: leave no open transaction
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            return result

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()


def postgres_sql(sql: str) -> str:
    """`?` placeholders as psycopg's `%s` (a literal `%` doubled first)."""
    return sql.replace("%", "%%").replace("?", "%s")


class _PostgresSession:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._connection.execute(postgres_sql(sql), tuple(args))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._connection.cursor() as cursor:
            cursor.executemany(postgres_sql(sql), [tuple(r) for r in rows])


class PostgresDatabase:
    dialect = "postgresql"

    def __init__(self, url: StoreURL, max_connections: int = POOL_MAX) -> None:
        import psycopg
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        self.url = url
        self._errors = (psycopg.OperationalError, psycopg.errors.AdminShutdown, _pool_timeout())
        try:  # one direct connection first: its error says what is wrong (host, login, database)
            psycopg.connect(url.url, connect_timeout=CONNECT_TIMEOUT_S).close()
        except psycopg.Error as error:
            raise StoreError(f"store {url.redacted}: {first_line(error)}") from None
        self._pool = ConnectionPool(url.url, min_size=1, max_size=max_connections, timeout=CONNECT_TIMEOUT_S,
                                    kwargs={"row_factory": dict_row, "connect_timeout": CONNECT_TIMEOUT_S},
                                    check=ConnectionPool.check_connection, open=False, name="nowait-store")
        self._pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)

    def transaction(self, work: Callable[[Session], T]) -> T:
        try:
            with self._pool.connection() as connection:  # commits on success, rolls back on an error
                return work(_PostgresSession(connection))
        except self._errors as error:
            raise StoreUnavailable(f"the store {self.url.redacted} is unavailable: {first_line(error)}") from None

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        return self.transaction(lambda session: session.execute(sql, args).fetchall())

    def close(self) -> None:
        self._pool.close()


def _pool_timeout() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return redact_text(text[0]) if text else type(error).__name__


def open_database(url: str | StoreURL) -> Database:
    """The database a store URL names, ready to use; `StoreError` (one line) when it is not."""
    parsed = parse_store_url(url) if isinstance(url, str) else url
    if parsed.kind == "sqlite":
        assert parsed.path is not None
        try:
            return SqliteDatabase(parsed.path)
        except sqlite3.Error as error:
            raise StoreError(f"store {parsed.url}: {error}") from None
    return PostgresDatabase(parsed)


__all__ = ["Database", "PostgresDatabase", "Session", "SqliteDatabase", "StoreError", "StoreUnavailable",
           "open_database", "redact"]
