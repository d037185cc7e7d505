"""The OpenAI Batch API, durable: files and batches in SQLite, and the runner that answers them.

Durability rests on three rules, each a single SQLite transaction (WAL, synchronous=FULL):

1. A batch is committed (status `validating`) before `POST /v1/batches` answers: an accepted batch
   is on disk.
2. Validation inserts every input line and moves the batch to `in_progress` together, so a kill
   mid-validation leaves a batch that is validated again from the start.
3. Each line's answer is written with `UPDATE ... WHERE status_code IS NULL`: a line is answered at
   most once, and after a restart only the lines without an answer run again. Finalizing builds
   the output and error files from the stored answers and completes the batch in one transaction.

So `kill -9` at any point, then a restart, ends with every line answered exactly once. A line
whose answer was computed but not yet committed when the process died runs again (its compute is
spent twice; its answer appears once).

Statuses: validating -> in_progress -> finalizing -> completed; validating -> failed (bad input);
validating/in_progress -> cancelling -> cancelled (lines answered so far are kept; the others
are listed in the error file with code `batch_cancelled`).

Ownership: every file and batch records its tenant (and a batch the key that created it); a
lookup with a tenant finds only that tenant's objects, and a batch's output and error files are
its tenant's. A store written before tenants existed opens with its objects in the tenant
`default` (the columns are added on open).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

# The input file's parsing has its own module; the runner calls it by this module's name.
from nowait.gateway.batch_input import BatchInputError, parse_input
from nowait.gateway.schemas import Batch, BatchError, BatchErrors, BatchRequestCounts, FileObject
from nowait.gateway.tenants import DEFAULT_TENANT

log = logging.getLogger("nowait.gateway")

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
MAX_PROCESS_FAILURES = 5  # failed passes before a batch still validating is marked failed



class BatchOwner(NamedTuple):
    """Who a batch belongs to: its tenant, and the key that created it (None: a configured key)."""

    tenant: str
    key_id: str | None = None


DEFAULT_OWNER = BatchOwner(DEFAULT_TENANT)

# execute(endpoint, body, request_id, owner) -> (HTTP status, response body, retry after): the
# same path an HTTP request takes, as the batch's owner.
Executor = Callable[[str, dict, str, BatchOwner], Awaitable[tuple[int, dict, float | None]]]

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL, tenant TEXT NOT NULL DEFAULT 'default');
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
    expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, errors TEXT,
    tenant TEXT NOT NULL DEFAULT 'default', key_id TEXT);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status_code INTEGER, response TEXT, request_id TEXT, answered_at INTEGER,
    PRIMARY KEY (batch_id, line));
"""
# Columns added since the first schema, added to an older store when it opens (same order as above).
MIGRATIONS = (("files", "tenant", "TEXT NOT NULL DEFAULT 'default'"),
              ("batches", "tenant", "TEXT NOT NULL DEFAULT 'default'"),
              ("batches", "key_id", "TEXT"))
INDEXES = """
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant);
"""


def _owned(condition: str, args: tuple, tenant: str | None) -> tuple[str, tuple]:
    """`condition`, narrowed to one tenant's rows when a tenant is given."""
    if tenant is None:
        return condition, args
    return f"{condition} AND tenant = ?", (*args, tenant)


class BatchStore:
    """Files, batches and their lines in one SQLite file; every method is one transaction. Lookups
    given a tenant see that tenant's objects only (None: any, for the runner)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        for table, column, declaration in MIGRATIONS:
            present = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
        self._db.executescript(INDEXES)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
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

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # --- files ---

    def create_file(self, filename: str, purpose: str, content: bytes, file_id: str | None = None,
                    tenant: str = DEFAULT_TENANT) -> FileObject:
        file_id = file_id or f"file-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        self._transaction(lambda db: db.execute(
            "INSERT OR REPLACE INTO files (id, purpose, filename, bytes, created_at, content, tenant) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", (file_id, purpose, filename, len(content), created, content, tenant)))
        return FileObject(id=file_id, bytes=len(content), created_at=created, filename=filename, purpose=purpose)

    @staticmethod
    def _file(row: sqlite3.Row) -> FileObject:
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
                                                   f"WHERE {where} ORDER BY rowid DESC LIMIT ?", (*args, limit))]

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

    def _batch(self, row: sqlite3.Row, counts: BatchRequestCounts) -> Batch:
        errors = json.loads(row["errors"]) if row["errors"] else None
        return Batch(id=row["id"], endpoint=row["endpoint"], input_file_id=row["input_file_id"],
                     completion_window=row["completion_window"], status=row["status"],
                     output_file_id=row["output_file_id"], error_file_id=row["error_file_id"],
                     created_at=row["created_at"], in_progress_at=row["in_progress_at"],
                     expires_at=row["expires_at"], finalizing_at=row["finalizing_at"],
                     completed_at=row["completed_at"], failed_at=row["failed_at"],
                     cancelling_at=row["cancelling_at"], cancelled_at=row["cancelled_at"],
                     errors=BatchErrors(data=[BatchError(**e) for e in errors]) if errors else None,
                     request_counts=counts, metadata=json.loads(row["metadata"]) if row["metadata"] else None)

    def counts(self, batch_id: str) -> BatchRequestCounts:
        [row] = self._query(
            "SELECT COUNT(*) AS total, SUM(status_code BETWEEN 200 AND 299) AS completed, "
            "SUM(status_code IS NOT NULL AND status_code NOT BETWEEN 200 AND 299) AS failed "
            "FROM batch_lines WHERE batch_id = ?", (batch_id,))
        return BatchRequestCounts(total=row["total"] or 0, completed=row["completed"] or 0, failed=row["failed"] or 0)

    def get_batch(self, batch_id: str, tenant: str | None = None) -> Batch | None:
        """The batch, if it exists and (given a tenant) is that tenant's."""
        where, args = _owned("id = ?", (batch_id,), tenant)
        rows = self._query(f"SELECT * FROM batches WHERE {where}", args)
        return self._batch(rows[0], self.counts(batch_id)) if rows else None

    def owner(self, batch_id: str) -> BatchOwner:
        [row] = self._query("SELECT tenant, key_id FROM batches WHERE id = ?", (batch_id,))
        return BatchOwner(row["tenant"], row["key_id"])

    def list_batches(self, limit: int = 20, after: str | None = None, tenant: str | None = None) -> list[Batch]:
        where, args = _owned("1 = 1", (), tenant)
        rows = self._query(f"SELECT * FROM batches WHERE {where} ORDER BY rowid DESC", args)
        if after is not None:
            ids = [r["id"] for r in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else []
        return [self._batch(r, self.counts(r["id"])) for r in rows[:limit]]

    def status(self, batch_id: str) -> str | None:
        rows = self._query("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return rows[0]["status"] if rows else None

    def unfinished(self, tenant: str | None = None) -> list[str]:
        marks = ", ".join("?" * len(UNFINISHED))
        where, args = _owned(f"status IN ({marks})", UNFINISHED, tenant)
        return [r["id"] for r in self._query(f"SELECT id FROM batches WHERE {where} ORDER BY rowid", args)]

    def unfinished_tenants(self) -> list[str]:
        marks = ", ".join("?" * len(UNFINISHED))
        return [r["tenant"] for r in self._query(f"SELECT DISTINCT tenant FROM batches WHERE status IN ({marks})",
                                                 UNFINISHED)]

    def start(self, batch_id: str, lines: list[tuple[int, str, str]]) -> None:
        """Rule 2: the lines and the in_progress status land together."""
        def work(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            db.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                           [(batch_id, n, c, b) for n, c, b in lines])
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? "
                       "AND status = 'validating'", (int(time.time()), batch_id))
        self._transaction(work)

    def fail(self, batch_id: str, errors: list[BatchError]) -> None:
        self._transaction(lambda db: db.execute(
            "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
            (int(time.time()), json.dumps([e.model_dump() for e in errors]), batch_id)))

    def request_cancel(self, batch_id: str, tenant: str | None = None) -> bool:
        where, args = _owned("id = ?", (batch_id,), tenant)
        return self._transaction(lambda db: db.execute(
            f"UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE {where} AND status IN "
            "('validating', 'in_progress')", (int(time.time()), *args)).rowcount) > 0

    def pending_lines(self, batch_id: str) -> list[tuple[int, str, dict]]:
        rows = self._query("SELECT line, custom_id, body FROM batch_lines WHERE batch_id = ? AND status_code IS NULL "
                           "ORDER BY line", (batch_id,))
        return [(r["line"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def answer(self, batch_id: str, line: int, status_code: int, response: dict, request_id: str) -> bool:
        """Rule 3: the first answer of a line is kept, any later one ignored."""
        return self._transaction(lambda db: db.execute(
            "UPDATE batch_lines SET status_code = ?, response = ?, request_id = ?, answered_at = ? "
            "WHERE batch_id = ? AND line = ? AND status_code IS NULL",
            (status_code, json.dumps(response), request_id, int(time.time()), batch_id, line)).rowcount) > 0

    def finalize(self, batch_id: str, final_status: str) -> None:
        """Output and error files from the stored answers, and the final status, in one transaction."""
        def work(db: sqlite3.Connection) -> None:
            now = int(time.time())
            rows = db.execute("SELECT line, custom_id, status_code, response, request_id FROM batch_lines "
                              "WHERE batch_id = ? ORDER BY line", (batch_id,)).fetchall()
            [owner] = db.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchall()
            output, errors = [], []
            for r in rows:
                entry: dict[str, Any] = {"id": f"batch_req_{batch_id.removeprefix('batch_')}_{r['line']}",
                                         "custom_id": r["custom_id"]}
                if r["status_code"] is None:
                    entry |= {"response": None, "error": {"code": "batch_cancelled",
                                                          "message": "the batch was cancelled before this request ran"}}
                    errors.append(entry)
                    continue
                entry |= {"response": {"status_code": r["status_code"], "request_id": r["request_id"],
                                       "body": json.loads(r["response"])}, "error": None}
                (output if 200 <= r["status_code"] < 300 else errors).append(entry)
            file_ids = {}
            for kind, entries in (("output", output), ("error", errors)):
                if not entries:
                    continue
                content = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()
                file_id = f"file-{batch_id}-{kind}"
                db.execute("INSERT OR REPLACE INTO files (id, purpose, filename, bytes, created_at, content, tenant) "
                           "VALUES (?, 'batch_output', ?, ?, ?, ?, ?)",
                           (file_id, f"{batch_id}_{kind}.jsonl", len(content), now, content, owner["tenant"]))
                file_ids[kind] = file_id
            stamp = "completed_at" if final_status == "completed" else "cancelled_at"
            db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?, "
                       "finalizing_at = COALESCE(finalizing_at, ?) WHERE id = ?",
                       (final_status, now, file_ids.get("output"), file_ids.get("error"), now, batch_id))
        self._transaction(work)

    def mark_finalizing(self, batch_id: str) -> None:
        self._transaction(lambda db: db.execute(
            "UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND status = 'in_progress'",
            (int(time.time()), batch_id)))


class BatchRunner:
    """Answers each tenant's batches in creation order, up to `max_concurrent` lines of a tenant in
    flight, resuming on start. Tenants run side by side, one lane each: a tenant whose lines wait
    out its rate limit, or whose batch is long, never holds up another tenant's batches."""

    def __init__(self, store: BatchStore, execute: Executor, max_concurrent: int) -> None:
        self.store, self.execute, self.max_concurrent = store, execute, max_concurrent
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lanes: dict[str, asyncio.Task] = {}  # tenant -> the task answering its batches
        self._failures: dict[str, int] = {}  # batch id -> processing passes failed in a row

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="nowait-batch-runner")

    async def stop(self) -> None:
        for task in [self._task, *self._lanes.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        """Start a lane for each tenant with unfinished batches and none running; then wait for
        a new batch (`wake`) or a second."""
        while True:
            try:
                tenants = await asyncio.to_thread(self.store.unfinished_tenants)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store could not be read: try again shortly
                log.exception("batch runner could not list the unfinished batches")
                tenants = []
            for tenant in tenants:
                lane = self._lanes.get(tenant)
                if lane is None or lane.done():
                    self._lanes[tenant] = asyncio.create_task(self._lane(tenant), name=f"nowait-batches-{tenant}")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _lane(self, tenant: str) -> None:
        """One tenant's unfinished batches in creation order, until it has none."""
        while True:
            try:
                batch_ids = await asyncio.to_thread(self.store.unfinished, tenant)
            except Exception:  # the store could not be read: the runner starts the lane again
                log.exception("batch runner could not list tenant %s's unfinished batches", tenant)
                return
            if not batch_ids:
                return
            for batch_id in batch_ids:
                try:
                    await self._process(batch_id)
                    self._failures.pop(batch_id, None)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # one failing batch must not hold up the ones after it
                    log.exception("batch %s failed in processing", batch_id)
                    await self._after_failure(batch_id, error)

    async def _after_failure(self, batch_id: str, error: Exception) -> None:
        """A batch still being validated after `MAX_PROCESS_FAILURES` failed passes is marked
        failed with the error (its input will not get better); one with accepted lines keeps
        being retried, as its lines are durable, while the batches after it go on."""
        self._failures[batch_id] = self._failures.get(batch_id, 0) + 1
        if self._failures[batch_id] >= MAX_PROCESS_FAILURES and \
                await asyncio.to_thread(self.store.status, batch_id) == "validating":
            message = f"the batch could not be processed: {type(error).__name__}: {error}"
            await asyncio.to_thread(self.store.fail, batch_id, [BatchError(code="internal_error", message=message)])
            self._failures.pop(batch_id, None)
        else:
            await asyncio.sleep(1.0)

    async def _process(self, batch_id: str) -> None:
        store = self.store
        batch = await asyncio.to_thread(store.get_batch, batch_id)
        if batch.status == "validating":
            owner = await asyncio.to_thread(store.owner, batch_id)
            content = await asyncio.to_thread(store.file_content, batch.input_file_id, owner.tenant)
            try:
                if content is None:
                    raise BatchInputError([BatchError(code="invalid_input_file",
                                                      message=f"input file {batch.input_file_id} no longer exists")])
                lines = await asyncio.to_thread(parse_input, content, batch.endpoint)  # off the event loop
            except BatchInputError as error:
                await asyncio.to_thread(store.fail, batch_id, error.errors)
                return
            await asyncio.to_thread(store.start, batch_id, lines)
        if await asyncio.to_thread(store.status, batch_id) in ("in_progress", "cancelling"):
            await self._answer_lines(batch_id, batch.endpoint)
        status = await asyncio.to_thread(store.status, batch_id)
        if status == "in_progress" and not await asyncio.to_thread(store.pending_lines, batch_id):
            await asyncio.to_thread(store.mark_finalizing, batch_id)
            status = "finalizing"
        if status in ("finalizing", "cancelling"):
            await asyncio.to_thread(store.finalize, batch_id, "completed" if status == "finalizing" else "cancelled")

    async def _answer_lines(self, batch_id: str, endpoint: str) -> None:
        slots = asyncio.Semaphore(self.max_concurrent)
        tasks: set[asyncio.Task] = set()
        owner = await asyncio.to_thread(self.store.owner, batch_id)
        try:
            for line, _custom_id, body in await asyncio.to_thread(self.store.pending_lines, batch_id):
                await slots.acquire()
                if await asyncio.to_thread(self.store.status, batch_id) != "in_progress":  # cancelled: run nothing new
                    slots.release()
                    break
                task = asyncio.create_task(self._answer(batch_id, endpoint, line, body, owner))
                task.add_done_callback(lambda _t: slots.release())
                tasks.add(task)
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            raise

    async def _answer(self, batch_id: str, endpoint: str, line: int, body: dict, owner: BatchOwner) -> None:
        request_id = f"req_{batch_id.removeprefix('batch_')}_{line}"
        while True:
            status, response, retry_after = await self.execute(endpoint, body, request_id, owner)
            if status != 429 or (response.get("error") or {}).get("code") == "insufficient_quota":
                break
            # A full engine queue, or the key's rate limit, is back-pressure, not an answer: wait
            # and try again while the batch runs (a cancelled batch leaves the line unanswered).
            # An engine that is not available (503) is an answer: waiting for it would hold up
            # every later batch; so is a spent budget, which lasts until the next day.
            await asyncio.sleep(retry_after or 0.5)
            if await asyncio.to_thread(self.store.status, batch_id) != "in_progress":
                return
        await asyncio.to_thread(self.store.answer, batch_id, line, status, response, request_id)
