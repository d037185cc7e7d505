"""nowait.store.database, the one interface the batch, key and audit stores write their statements
through, fast enough for mutmut: SQLite's settings, a transaction committed, rolled back on any
error (an interrupt included) and after a commit that fails, rows read by name, the one-line
errors; and the same on a real PostgreSQL (the session's server, and a private one stopped and
started again), as a statement written once runs on both."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from nowait.store.database import (
    PostgresDatabase,
    SqliteDatabase,
    StoreUnavailable,
    first_line,
    open_database,
    postgres_sql,
)
from nowait.store.url import StoreError, parse_store_url

TABLE = "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)"


def insert(session, *names: str) -> int:
    session.executemany("INSERT INTO t (id, name) VALUES (?, ?)", [[n, name] for n, name in enumerate(names, 1)])
    return len(names)


def names(database) -> list[str]:
    return [row["name"] for row in database.query("SELECT name FROM t WHERE id >= ? ORDER BY id", [0])]


@pytest.fixture
def sqlite_db(tmp_path):
    database = SqliteDatabase(tmp_path / "deep" / "store.sqlite")
    database.transaction(lambda session: session.execute(TABLE))
    yield database
    database.close()


def test_a_sqlite_database_is_made_with_its_folders_in_wal_mode_with_full_sync(tmp_path):
    path = tmp_path / "a" / "b" / "store.sqlite"
    database = SqliteDatabase(path)
    assert path.exists() and database.dialect == "sqlite"
    assert database.url.kind == "sqlite" and database.url.url == f"sqlite:///{path}" and database.url.path == path
    assert database.query("PRAGMA journal_mode")[0][0] == "wal"
    assert database.query("PRAGMA synchronous")[0][0] == 2  # FULL: a committed line survives a power cut
    database.close()
    with pytest.raises(sqlite3.ProgrammingError):  # closed
        database.query("SELECT 1")


def test_a_transaction_commits_what_its_work_did_and_returns_its_result(sqlite_db, tmp_path):
    assert sqlite_db.transaction(lambda session: insert(session, "a", "b")) == 2
    other = sqlite3.connect(tmp_path / "deep" / "store.sqlite")  # another connection sees it: committed
    assert other.execute("SELECT name FROM t ORDER BY id").fetchall() == [("a",), ("b",)]
    other.close()
    assert names(sqlite_db) == ["a", "b"]


@pytest.mark.parametrize("error", [ValueError("bad row"), KeyboardInterrupt()])
def test_work_that_raises_anything_is_rolled_back_and_the_error_goes_on(sqlite_db, error):
    def work(session):
        insert(session, "lost")
        raise error

    with pytest.raises(type(error)):
        sqlite_db.transaction(work)
    assert names(sqlite_db) == []
    sqlite_db.transaction(lambda session: insert(session, "kept"))  # no transaction was left open
    assert names(sqlite_db) == ["kept"]


def test_a_transaction_takes_the_write_lock_at_its_start(sqlite_db, tmp_path):
    """BEGIN IMMEDIATE: a transaction that reads first cannot be refused its write later on (a
    deferred one can, after it read); while another writer holds the lock it waits `timeout_s`."""
    path = tmp_path / "deep" / "store.sqlite"
    waiting = SqliteDatabase(path, timeout_s=0.05)
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")
    later = threading.Timer(0.5, writer.execute, ("ROLLBACK",))  # a wait longer than timeout_s would get it
    later.start()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        waiting.transaction(lambda session: session.execute("SELECT 1").fetchall())
    assert waiting.query("SELECT COUNT(*) FROM t")[0][0] == 0  # reading needs no lock (WAL)
    later.join()
    writer.close()
    assert waiting.transaction(lambda session: session.execute("SELECT 7").fetchone()[0]) == 7
    waiting.close()


class CommitFails:
    """The real connection, except that COMMIT fails as a full disk makes it fail."""

    def __init__(self, connection: sqlite3.Connection, in_transaction: bool = True) -> None:
        self.connection, self.keep = connection, in_transaction

    def execute(self, sql: str, *args):
        if sql == "COMMIT":
            if not self.keep:
                self.connection.execute("ROLLBACK")  # as when SQLite rolled back on its own
            raise sqlite3.OperationalError("database or disk is full")
        return self.connection.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.connection, name)


@pytest.mark.parametrize("still_open", [True, False])
def test_a_commit_that_fails_leaves_no_transaction_open_and_raises(sqlite_db, still_open):
    real = sqlite_db._db
    sqlite_db._db = CommitFails(real, still_open)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        sqlite_db.transaction(lambda session: insert(session, "lost"))
    assert not real.in_transaction
    sqlite_db._db = real
    assert names(sqlite_db) == []
    sqlite_db.transaction(lambda session: insert(session, "kept"))
    assert names(sqlite_db) == ["kept"]


def test_one_connection_is_shared_by_threads_one_transaction_at_a_time(sqlite_db):
    def add(n: int) -> None:
        def work(session):
            count = session.execute("SELECT COUNT(*) FROM t").fetchone()[0]
            session.execute("INSERT INTO t (id, name) VALUES (?, ?)", (count + 1, f"n{n}"))
        sqlite_db.transaction(work)

    threads = [threading.Thread(target=add, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(names(sqlite_db)) == sorted(f"n{n}" for n in range(8))


def test_open_database_opens_a_sqlite_url_or_says_in_one_line_why_not(tmp_path):
    database = open_database(f"sqlite:///{tmp_path / 'x.sqlite'}")
    assert isinstance(database, SqliteDatabase) and database.path == tmp_path / "x.sqlite"
    database.close()
    database = open_database(parse_store_url(f"sqlite:///{tmp_path / 'y.sqlite'}"))
    assert isinstance(database, SqliteDatabase) and database.path == tmp_path / "y.sqlite"
    database.close()
    (tmp_path / "dir.sqlite").mkdir()
    url = f"sqlite:///{tmp_path / 'dir.sqlite'}"
    with pytest.raises(StoreError) as caught:
        open_database(url)
    assert str(caught.value) == f"store {url}: unable to open database file"
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_postgres_placeholders_are_psycopgs_with_literal_percents_doubled():
    assert postgres_sql("SELECT a FROM t WHERE b = ? AND c LIKE '5%' AND d = ?") == \
        "SELECT a FROM t WHERE b = %s AND c LIKE '5%%' AND d = %s"


def test_an_error_is_told_by_its_first_line_without_a_password():
    error = RuntimeError("\n  postgresql://u:secret@db:5432/x\nDETAIL: connection refused\n")
    assert first_line(error) == "postgresql://u:***@db:5432/x"
    assert first_line(TimeoutError()) == "TimeoutError"
    assert first_line(TimeoutError("  \n ")) == "TimeoutError"
    # Inside a sentence, several in a line, and libpq's key=value form, quoted or not.
    quoted = RuntimeError('invalid dsn: "postgresql://app:s3cr3t@db/x" and postgres://:pw@h2/y, retrying')
    assert first_line(quoted) == 'invalid dsn: "postgresql://app:***@db/x" and postgres://:***@h2/y, retrying'
    conninfo = RuntimeError("connection to host=db user=app password=s3cr3t dbname=x failed; password = 'a b\\'c' ok")
    assert first_line(conninfo) == "connection to host=db user=app password=*** dbname=x failed; password = *** ok"
    assert first_line(RuntimeError("https://example.com/a:b no password here")) == \
        "https://example.com/a:b no password here"


def test_on_postgresql_the_same_statements_commit_roll_back_and_read_by_name(postgres_url):
    database = open_database(postgres_url)
    assert isinstance(database, PostgresDatabase) and database.dialect == "postgresql"
    assert database.url.url == postgres_url and "***" in database.url.redacted
    database.transaction(lambda session: session.execute(TABLE))
    assert database.transaction(lambda session: insert(session, "a", "b")) == 2

    def fails(session):
        session.execute("INSERT INTO t (id, name) VALUES (?, ?)", (3, "c"))
        raise ValueError("bad row")

    with pytest.raises(ValueError):
        database.transaction(fails)
    assert names(database) == ["a", "b"]
    assert database.query("SELECT name FROM t WHERE name LIKE '%' || ? ORDER BY id", ("b",)) == [{"name": "b"}]
    other = open_database(postgres_url)  # another connection sees it: committed
    assert names(other) == ["a", "b"]
    other.close()
    database.close()
    with pytest.raises(Exception, match="closed"):
        database.query("SELECT 1")


def test_a_postgresql_login_refused_is_one_line_without_the_password(postgres_server):
    password = "not-" + postgres_server.password
    url = postgres_server.url_for("nowait", password=password)
    with pytest.raises(StoreError) as caught:
        PostgresDatabase(parse_store_url(url))
    message = str(caught.value)
    assert message.startswith(f"store {parse_store_url(url).redacted}: ")
    assert "password authentication failed" in message
    assert password not in message and "\n" not in message and caught.value.__cause__ is None


def test_a_postgresql_server_away_is_store_unavailable_and_back_is_used_again(private_postgres):
    database = PostgresDatabase(parse_store_url(private_postgres.url), max_connections=2)
    assert database.query("SELECT 1 AS one") == [{"one": 1}]
    private_postgres.restart()  # the pooled connection is broken: checked before use, and replaced
    assert database.query("SELECT 1 AS one") == [{"one": 1}]
    private_postgres.stop()
    with pytest.raises(StoreUnavailable) as caught:
        database.query("SELECT 1 AS one")
    assert str(caught.value).startswith(f"the store {database.url.redacted} is unavailable: ")
    assert private_postgres.password not in str(caught.value) and caught.value.__cause__ is None
    private_postgres.stop = lambda mode="fast": None  # already stopped: `restart` only starts it again
    private_postgres.restart()
    assert database.query("SELECT 2 AS two") == [{"two": 2}]  # the broken connection was checked and replaced
    database.close()


def test_a_postgresql_pool_holds_up_to_max_connections_at_once(postgres_url):
    database = PostgresDatabase(parse_store_url(postgres_url), max_connections=2)
    inside, leave = threading.Event(), threading.Event()

    def hold(session):
        inside.set()
        leave.wait(10)
        return session.execute("SELECT 1 AS one").fetchall()
    holder = threading.Thread(target=lambda: database.transaction(hold))
    holder.start()
    assert inside.wait(10)
    assert database.query("SELECT 2 AS two") == [{"two": 2}]  # a second connection while the first is held
    leave.set()
    holder.join()
    database.close()
