"""Files, batches and their lines in the store (SQLite embedded, PostgreSQL shared): every method
is one transaction, written once for both databases (nowait.store.database).

Durability rests on these rules, each a single transaction:

1. A batch is committed (status `validating`) before `POST /v1/batches` answers: an accepted batch
   is on disk.
2. Validation inserts every input line and moves the batch to `in_progress` together; only the
   first validation of a batch does (a replica validating it too finds it no longer `validating`
   and writes nothing), and a kill mid-validation leaves a batch validated again from the start.
3. A runner claims lines with a lease (owner, expiry on the database's clock; on PostgreSQL
   `FOR UPDATE SKIP LOCKED`, so replicas claiming at once get disjoint lines). A line whose lease
   expired (its replica was killed) is claimed again by another.
4. Each line's answer and the release of its lease are written together, with `WHERE status_code
   IS NULL`, and only while its batch is `in_progress` or `cancelling` (under a share lock on the
   batch's row, which finalizing takes exclusively): a line is answered at most once, and never
   after its batch's output was built. Finalizing builds the output and error files from the
   stored answers and completes the batch in one transaction, once, whichever replica gets there.

So `kill -9` of any replica at any point ends, after its leases expire, with every line answered
exactly once. A line whose answer was computed but not committed when its replica died runs
again (its compute is spent twice; its answer appears once).

Statuses: validating -> in_progress -> finalizing -> completed; validating -> failed (bad input);
validating/in_progress -> cancelling -> cancelled (lines answered so far are kept; the others
are listed in the error file with code `batch_cancelled`); in_progress past `expires_at` ->
expired (the unanswered lines listed with code `batch_expired`), as OpenAI's 24 h window does.

Ownership: every file and batch records its tenant (and a batch the key that created it); a
lookup with a tenant finds only that tenant's objects, and a batch's output and error files are
its tenant's. A SQLite store written before tenants, leases or schema versions opens migrated,
its objects in the tenant `default`. File contents are kept in the database (BLOB / BYTEA).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from nowait.gateway.schemas import Batch, BatchError, BatchErrors, BatchRequestCounts, FileObject
from nowait.gateway.tenants import DEFAULT_TENANT
from nowait.store.database import Database, Session, SqliteDatabase
from nowait.store.schema import Component, migrate

COMPLETION_WINDOWS = {"24h": 24 * 3600}
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
CLOSING = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
UNANSWERED = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
              "expired": ("batch_expired", "the batch's completion window ended before this request ran"),
              "completed": ("batch_cancelled", "the batch ended before this request ran")}


class BatchOwner(NamedTuple):
    """Who a batch belongs to: its tenant, and the key that created it (None: a configured key)."""

    tenant: str
    key_id: str | None = None


DEFAULT_OWNER = BatchOwner(DEFAULT_TENANT)

TABLES = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at BIGINT NOT NULL, content {blob} NOT NULL, tenant TEXT NOT NULL DEFAULT 'default'{seq});
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, created_at BIGINT NOT NULL, in_progress_at BIGINT,
    expires_at BIGINT, finalizing_at BIGINT, completed_at BIGINT, failed_at BIGINT, cancelling_at BIGINT,
    cancelled_at BIGINT, output_file_id TEXT, error_file_id TEXT, errors TEXT,
    tenant TEXT NOT NULL DEFAULT 'default', key_id TEXT, expired_at BIGINT{seq});
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status_code INTEGER, response TEXT, request_id TEXT, answered_at BIGINT,
    lease_owner TEXT, lease_expires DOUBLE PRECISION, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status)
"""
# Columns added to a SQLite store written before schema versions (tenants, then leases, expiry).
LEGACY_COLUMNS = (("files", "tenant", "TEXT NOT NULL DEFAULT 'default'"),
                  ("batches", "tenant", "TEXT NOT NULL DEFAULT 'default'"),
                  ("batches", "key_id", "TEXT"), ("batches", "expired_at", "BIGINT"),
                  ("batch_lines", "lease_owner", "TEXT"), ("batch_lines", "lease_expires", "DOUBLE PRECISION"))


def _create_tables(session: Session, dialect: str) -> None:
    if dialect == "postgresql":  # rows in insertion order: SQLite has rowid, PostgreSQL a sequence
        script = TABLES.format(blob="BYTEA", seq=", seq BIGINT GENERATED BY DEFAULT AS IDENTITY")
    else:
        script = TABLES.format(blob="BLOB", seq="")
    for statement in script.split(";")[:3]:  # tables first, then (after legacy columns) indexes
        session.execute(statement)
    if dialect == "sqlite":
        for table, column, declaration in LEGACY_COLUMNS:
            present = {row["name"] for row in session.execute(f"PRAGMA table_info({table})").fetchall()}
            if column not in present:
                session.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
    for statement in script.split(";")[3:]:
        session.execute(statement)


SCHEMA = Component("batches", (_create_tables,))
# The database's clock, in seconds: leases are compared on one clock whichever replica wrote them.
NOW_S = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
         "postgresql": "EXTRACT(EPOCH FROM clock_timestamp())::DOUBLE PRECISION"}


def _owned(condition: str, args: tuple, tenant: str | None) -> tuple[str, tuple]:
    """`condition`, narrowed to one tenant's rows when a tenant is given."""
    if tenant is None:
        return condition, args
    return f"{condition} AND tenant = ?", (*args, tenant)


def _marks(values: tuple | list) -> str:
    return ", ".join("?" * len(values))


class BatchStore:
    """Files, batches and their lines; lookups given a tenant see that tenant's objects only (None:
    any, for the runner). Built on a SQLite path (its own database) or on an open `Database`."""

    def __init__(self, database: Database | str | Path) -> None:
        self._owns_database = not hasattr(database, "transaction")
        self.db: Database = SqliteDatabase(database) if self._owns_database else database  # type: ignore[arg-type]
        migrate(self.db, SCHEMA)
        postgres = self.db.dialect == "postgresql"
        self._order = "seq" if postgres else "rowid"
        self._now = NOW_S[self.db.dialect]
        self._skip_locked = " FOR UPDATE SKIP LOCKED" if postgres else ""
        self._share_lock = " FOR SHARE" if postgres else ""
        self._update_lock = " FOR UPDATE" if postgres else ""

    @property
    def path(self) -> Path | None:
        """The SQLite file (None on PostgreSQL)."""
        return self.db.url.path

    def close(self) -> None:
        if self._owns_database:
            self.db.close()

    def _transaction(self, work: Any) -> Any:
        return self.db.transaction(work)

    def _query(self, sql: str, args: tuple = ()) -> list[Any]:
        return self.db.query(sql, args)

    # --- files ---

    def create_file(self, filename: str, purpose: str, content: bytes, file_id: str | None = None,
                    tenant: str = DEFAULT_TENANT) -> FileObject:
        file_id = file_id or f"file-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        self._transaction(lambda db: self._put_file(db, file_id, purpose, filename, created, content, tenant))
        return FileObject(id=file_id, bytes=len(content), created_at=created, filename=filename, purpose=purpose)

    @staticmethod
    def _put_file(db: Session, file_id: str, purpose: str, filename: str, created: int, content: bytes,
                  tenant: str) -> None:
        db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content, tenant) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET purpose = excluded.purpose, "
                   "filename = excluded.filename, bytes = excluded.bytes, created_at = excluded.created_at, "
                   "content = excluded.content, tenant = excluded.tenant",
                   (file_id, purpose, filename, len(content), created, content, tenant))

    @staticmethod
    def _file(row: Any) -> FileObject:
        return FileObject(id=row["id"], bytes=row["bytes"], created_at=row["created_at"], filename=row["filename"],
                          purpose=row["purpose"])

    def get_file(self, file_id: str, tenant: str | None = None) -> FileObject | None:
        """The file, if it exists and (given a tenant) is that tenant's."""
        where, args = _owned("id = ?", (file_id,), tenant)
        rows = self._query(f"SELECT id, purpose, filename, bytes, created_at FROM files WHERE {where}", args)
        return self._file(rows[0]) if rows else None

    def file_content(self, file_id: str, tenant: str | None = None) -> bytes | None:
        where, args = _owned("id = ?", (file_id,), tenant)
        rows = self._query(f"SELECT content FROM files WHERE {where}", args)
        return bytes(rows[0]["content"]) if rows else None

    def list_files(self, purpose: str | None = None, limit: int = 10000, tenant: str | None = None) -> list[FileObject]:
        where, args = _owned("purpose = ?" if purpose else "1 = 1", (purpose,) if purpose else (), tenant)
        return [self._file(r) for r in self._query(f"SELECT id, purpose, filename, bytes, created_at FROM files "
                                                   f"WHERE {where} ORDER BY {self._order} DESC LIMIT ?",
                                                   (*args, limit))]

    def delete_file(self, file_id: str, tenant: str | None = None) -> bool:
        where, args = _owned("id = ?", (file_id,), tenant)
        return self._transaction(lambda db: db.execute(f"DELETE FROM files WHERE {where}", args).rowcount) > 0

    # --- batches ---

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None, owner: BatchOwner = DEFAULT_OWNER) -> Batch:
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        expires = created + COMPLETION_WINDOWS[completion_window]
        self._transaction(lambda db: db.execute(
            "INSERT INTO batches (id, status, endpoint, input_file_id, completion_window, metadata, created_at, "
            "expires_at, tenant, key_id) VALUES (?, 'validating', ?, ?, ?, ?, ?, ?, ?, ?)",
            (batch_id, endpoint, input_file_id, completion_window, json.dumps(metadata) if metadata else None,
             created, expires, owner.tenant, owner.key_id)))
        return self.get_batch(batch_id)

    @staticmethod
    def _batch(row: Any, counts: BatchRequestCounts) -> Batch:
        errors = json.loads(row["errors"]) if row["errors"] else None
        return Batch(id=row["id"], endpoint=row["endpoint"], input_file_id=row["input_file_id"],
                     completion_window=row["completion_window"], status=row["status"],
                     output_file_id=row["output_file_id"], error_file_id=row["error_file_id"],
                     created_at=row["created_at"], in_progress_at=row["in_progress_at"],
                     expires_at=row["expires_at"], finalizing_at=row["finalizing_at"],
                     completed_at=row["completed_at"], failed_at=row["failed_at"],
                     cancelling_at=row["cancelling_at"], cancelled_at=row["cancelled_at"],
                     expired_at=row["expired_at"],
                     errors=BatchErrors(data=[BatchError(**e) for e in errors]) if errors else None,
                     request_counts=counts, metadata=json.loads(row["metadata"]) if row["metadata"] else None)

    @staticmethod
    def _counts(db: Session, batch_id: str) -> BatchRequestCounts:
        [row] = db.execute(
            "SELECT COUNT(*) AS total, SUM(CASE WHEN status_code BETWEEN 200 AND 299 THEN 1 ELSE 0 END) AS completed, "
            "SUM(CASE WHEN status_code IS NOT NULL AND status_code NOT BETWEEN 200 AND 299 THEN 1 ELSE 0 END) "
            "AS failed FROM batch_lines WHERE batch_id = ?", (batch_id,)).fetchall()
        return BatchRequestCounts(total=row["total"] or 0, completed=row["completed"] or 0, failed=row["failed"] or 0)

    def counts(self, batch_id: str) -> BatchRequestCounts:
        return self._transaction(lambda db: self._counts(db, batch_id))

    def get_batch(self, batch_id: str, tenant: str | None = None) -> Batch | None:
        """The batch, if it exists and (given a tenant) is that tenant's; its row and counts read
        in one transaction, so they agree."""
        where, args = _owned("id = ?", (batch_id,), tenant)

        def read(db: Session) -> Batch | None:
            rows = db.execute(f"SELECT * FROM batches WHERE {where}", args).fetchall()
            return self._batch(rows[0], self._counts(db, batch_id)) if rows else None
        return self._transaction(read)

    def owner(self, batch_id: str) -> BatchOwner:
        [row] = self._query("SELECT tenant, key_id FROM batches WHERE id = ?", (batch_id,))
        return BatchOwner(row["tenant"], row["key_id"])

    def list_batches(self, limit: int = 20, after: str | None = None, tenant: str | None = None) -> list[Batch]:
        where, args = _owned("1 = 1", (), tenant)

        def read(db: Session) -> list[Batch]:
            rows = db.execute(f"SELECT * FROM batches WHERE {where} ORDER BY {self._order} DESC", args).fetchall()
            if after is not None:
                ids = [r["id"] for r in rows]
                rows = rows[ids.index(after) + 1:] if after in ids else []
            return [self._batch(r, self._counts(db, r["id"])) for r in rows[:limit]]
        return self._transaction(read)

    def status(self, batch_id: str) -> str | None:
        rows = self._query("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return rows[0]["status"] if rows else None

    def unfinished(self, tenant: str | None = None) -> list[str]:
        where, args = _owned(f"status IN ({_marks(UNFINISHED)})", UNFINISHED, tenant)
        return [r["id"] for r in self._query(f"SELECT id FROM batches WHERE {where} ORDER BY {self._order}", args)]

    def unfinished_tenants(self) -> list[str]:
        return [r["tenant"] for r in self._query(f"SELECT DISTINCT tenant FROM batches WHERE status IN "
                                                 f"({_marks(UNFINISHED)})", UNFINISHED)]

    def start(self, batch_id: str, lines: list[tuple[int, str, str]]) -> bool:
        """Rule 2: the lines and the in_progress status land together, for the first validation
        only; whether this call was it."""
        def work(db: Session) -> bool:
            moved = db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? "
                               "AND status = 'validating'", (int(time.time()), batch_id)).rowcount
            if not moved:
                return False
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            db.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                           [(batch_id, n, c, b) for n, c, b in lines])
            return True
        return self._transaction(work)

    def fail(self, batch_id: str, errors: list[BatchError]) -> None:
        self._transaction(lambda db: db.execute(
            "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND status = 'validating'",
            (int(time.time()), json.dumps([e.model_dump() for e in errors]), batch_id)))

    def request_cancel(self, batch_id: str, tenant: str | None = None) -> bool:
        where, args = _owned("id = ?", (batch_id,), tenant)
        return self._transaction(lambda db: db.execute(
            f"UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE {where} AND status IN "
            "('validating', 'in_progress')", (int(time.time()), *args)).rowcount) > 0

    # --- lines: claimed with leases, answered once ---

    def pending_lines(self, batch_id: str) -> list[tuple[int, str, dict]]:
        """Every unanswered line, leased or not."""
        rows = self._query("SELECT line, custom_id, body FROM batch_lines WHERE batch_id = ? AND status_code IS NULL "
                           "ORDER BY line", (batch_id,))
        return [(r["line"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def has_pending(self, batch_id: str) -> bool:
        return bool(self._query("SELECT 1 FROM batch_lines WHERE batch_id = ? AND status_code IS NULL LIMIT 1",
                                (batch_id,)))

    def claim(self, batch_id: str, owner: str, count: int, lease_s: float) -> list[tuple[int, str, dict]]:
        """Rule 3: up to `count` unanswered lines whose lease is free or expired, leased to `owner`
        for `lease_s` seconds (lowest line numbers first); none once the batch is no longer
        in_progress (read in the same statement, so no line starts after a cancel committed)."""
        if count <= 0:
            return []
        sql = (f"UPDATE batch_lines SET lease_owner = ?, lease_expires = {self._now} + ? WHERE batch_id = ? "
               f"AND line IN (SELECT line FROM batch_lines WHERE batch_id = ? AND status_code IS NULL "
               f"AND (lease_expires IS NULL OR lease_expires < {self._now}) AND EXISTS (SELECT 1 FROM batches "
               f"WHERE id = ? AND status = 'in_progress') ORDER BY line LIMIT ?{self._skip_locked}) "
               "RETURNING line, custom_id, body")
        rows = self._transaction(lambda db: db.execute(sql, (owner, lease_s, batch_id, batch_id, batch_id,
                                                             count)).fetchall())
        return sorted((r["line"], r["custom_id"], json.loads(r["body"])) for r in rows)

    def renew(self, batch_id: str, owner: str, lines: list[int], lease_s: float) -> int:
        """Extend `owner`'s leases on `lines` (still unanswered) by `lease_s` from now; how many."""
        if not lines:
            return 0
        return self._transaction(lambda db: db.execute(
            f"UPDATE batch_lines SET lease_expires = {self._now} + ? WHERE batch_id = ? AND lease_owner = ? "
            f"AND status_code IS NULL AND line IN ({_marks(lines)})", (lease_s, batch_id, owner, *lines)).rowcount)

    def release(self, batch_id: str, owner: str, lines: list[int]) -> None:
        """Give back `owner`'s leases on unanswered `lines` (the runner stopped before answering)."""
        if lines:
            self._transaction(lambda db: db.execute(
                "UPDATE batch_lines SET lease_owner = NULL, lease_expires = NULL WHERE batch_id = ? AND "
                f"lease_owner = ? AND status_code IS NULL AND line IN ({_marks(lines)})", (batch_id, owner, *lines)))

    def answer(self, batch_id: str, line: int, status_code: int, response: dict, request_id: str) -> bool:
        """Rule 4: the first answer of a line is kept (and its lease released), any later one, or
        one after the batch's output was built, ignored."""
        def work(db: Session) -> bool:
            rows = db.execute(f"SELECT status FROM batches WHERE id = ?{self._share_lock}", (batch_id,)).fetchall()
            if not rows or rows[0]["status"] not in ("in_progress", "cancelling"):
                return False
            return db.execute(
                "UPDATE batch_lines SET status_code = ?, response = ?, request_id = ?, answered_at = ?, "
                "lease_owner = NULL, lease_expires = NULL WHERE batch_id = ? AND line = ? AND status_code IS NULL",
                (status_code, json.dumps(response), request_id, int(time.time()), batch_id, line)).rowcount > 0
        return self._transaction(work)

    def mark_finalizing(self, batch_id: str) -> bool:
        """in_progress -> finalizing, once no line is left unanswered; whether it moved."""
        return self._transaction(lambda db: db.execute(
            "UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND status = 'in_progress' "
            "AND NOT EXISTS (SELECT 1 FROM batch_lines WHERE batch_id = ? AND status_code IS NULL)",
            (int(time.time()), batch_id, batch_id)).rowcount) > 0

    def expire_due(self, batch_id: str) -> bool:
        """An in_progress batch past its completion window is finalized as `expired`; whether it was."""
        rows = self._query(f"SELECT 1 FROM batches WHERE id = ? AND status = 'in_progress' AND expires_at IS NOT NULL "
                           f"AND expires_at < {self._now}", (batch_id,))
        return bool(rows) and self.finalize(batch_id, "expired", from_statuses=("in_progress",))

    def finalize(self, batch_id: str, final_status: str,
                 from_statuses: tuple[str, ...] = ("finalizing", "cancelling")) -> bool:
        """Output and error files from the stored answers, and the final status, in one transaction,
        by the first replica to get here (a batch no longer in `from_statuses` is left alone)."""
        def work(db: Session) -> bool:
            found = db.execute(f"SELECT status, tenant FROM batches WHERE id = ?{self._update_lock}",
                               (batch_id,)).fetchall()
            if not found or found[0]["status"] not in from_statuses:
                return False
            now = int(time.time())
            rows = db.execute("SELECT line, custom_id, status_code, response, request_id FROM batch_lines "
                              "WHERE batch_id = ? ORDER BY line", (batch_id,)).fetchall()
            output, errors = self._result_entries(batch_id, rows, final_status)
            file_ids = {}
            for kind, entries in (("output", output), ("error", errors)):
                if entries:
                    content = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()
                    file_ids[kind] = f"file-{batch_id}-{kind}"
                    self._put_file(db, file_ids[kind], "batch_output", f"{batch_id}_{kind}.jsonl", now, content,
                                   found[0]["tenant"])
            db.execute(f"UPDATE batches SET status = ?, {CLOSING[final_status]} = ?, output_file_id = ?, "
                       "error_file_id = ?, finalizing_at = COALESCE(finalizing_at, ?) WHERE id = ?",
                       (final_status, now, file_ids.get("output"), file_ids.get("error"), now, batch_id))
            return True
        return self._transaction(work)

    @staticmethod
    def _result_entries(batch_id: str, rows: list[Any], final_status: str) -> tuple[list[dict], list[dict]]:
        """The output file's entries (2xx answers) and the error file's (the others, and the lines
        never answered, with the final status's code)."""
        code, message = UNANSWERED[final_status]
        output, errors = [], []
        for r in rows:
            entry: dict[str, Any] = {"id": f"batch_req_{batch_id.removeprefix('batch_')}_{r['line']}",
                                     "custom_id": r["custom_id"]}
            if r["status_code"] is None:
                errors.append(entry | {"response": None, "error": {"code": code, "message": message}})
                continue
            entry |= {"response": {"status_code": r["status_code"], "request_id": r["request_id"],
                                   "body": json.loads(r["response"])}, "error": None}
            (output if 200 <= r["status_code"] < 300 else errors).append(entry)
        return output, errors
