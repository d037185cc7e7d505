"""The audit log in the shared store: the same chained entries as the JSONL file (chain.py), one
row each, one chain per replica, so several gateway replicas write one database.

    audit_entries (replica, seq, time, tenant, status, cost_usd, entry)   primary key (replica, seq)

`entry` is the entry's canonical JSON, exactly the line the file writer would write (its `hash`,
`prev`, `seq` and `replica` included); the other columns repeat what it says, for the spend
queries, and `nowait audit verify --store` checks that they still do.

A request never waits for the database: `record` chains the entry (under a lock, so the chain
is the order requests ended) and queues its row; one writer thread inserts what is queued, in
batches of up to BATCH_ROWS, one transaction each. While the database is unreachable the rows
stay queued, in order, and the writer retries (RETRY_FIRST_S doubling to RETRY_MAX_S); they are
written once it is back. A process killed during an outage loses the rows still queued (its
chain then ends at the last row written, and the restarted replica continues from there), and
one closed during an outage waits CLOSE_WAIT_S for the database before giving them up (logged).

At open the replica's last row is read and its chain continues (`prev` = that row's hash, `seq`
= its number + 1). Two processes must not share a replica name: each would continue the same
chain, and the second one's rows could not be inserted (logged, and retried, as an outage is).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from itertools import islice
from typing import Any

from nowait.gateway.audit.chain import GENESIS, LOCAL_REPLICA, hashed_line, is_plain, plain_json
from nowait.gateway.tenants import DEFAULT_TENANT
from nowait.store.database import Database
from nowait.store.schema import Component, migrate, sql_step

log = logging.getLogger("nowait.gateway")

BATCH_ROWS = 500  # rows per insert transaction: one round trip carries a burst of requests
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0
CLOSE_WAIT_S = 10.0

SCHEMA = Component("audit", (sql_step("""
CREATE TABLE IF NOT EXISTS audit_entries (
    replica TEXT NOT NULL, seq BIGINT NOT NULL, time DOUBLE PRECISION, tenant TEXT, status INTEGER,
    cost_usd DOUBLE PRECISION, entry TEXT NOT NULL, PRIMARY KEY (replica, seq));
CREATE INDEX IF NOT EXISTS audit_entries_time ON audit_entries (time)
"""),))
COLUMNS = "replica, seq, time, tenant, status, cost_usd, entry"
INSERT = f"INSERT INTO audit_entries ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def entry_columns(entry: dict[str, Any]) -> tuple[float | None, str | None, int | None, float | None]:
    """(time, tenant, status, cost_usd) as a row stores them for an entry: what the columns must
    say, written and verified by this one function."""
    tenant, status = entry.get("tenant"), entry.get("status")
    if isinstance(tenant, str):  # as the line writes it (a lone surrogate as "?"), and no NUL, which TEXT refuses
        tenant = tenant.encode("utf-8", "replace").decode("utf-8").replace("\x00", "?") or None
    else:
        tenant = None
    return (_number(entry.get("time")), tenant, status if type(status) is int else None,
            _number(entry.get("cost_usd")))


def chain_head(database: Database, replica: str) -> tuple[str, int]:
    """(`prev`, `seq`) of the replica's next entry: after its last row, or a new chain."""
    rows = database.query("SELECT entry FROM audit_entries WHERE replica = ? ORDER BY seq DESC LIMIT 1", (replica,))
    if not rows:
        return GENESIS, 0
    last = json.loads(rows[0]["entry"])
    return last["hash"], last["seq"] + 1


class StoreAuditLog:
    """`AuditLog`'s interface (record, last_hash, close) over the shared store; safe from any thread."""

    def __init__(self, database: Database, replica: str = LOCAL_REPLICA) -> None:
        self.database, self.replica = database, replica
        migrate(database, SCHEMA)
        self._prev, self._seq = chain_head(database, replica)
        self._lock = threading.Condition()
        self._queued: deque[tuple[Any, ...]] = deque()
        self._closed = False
        self._writer = threading.Thread(target=self._write_queued, name=f"audit-store-{replica}", daemon=True)
        self._writer.start()
        log.info("audit log in %s: chain %r continues at entry %d after %s", database.url.redacted, replica,
                 self._seq, self._prev)

    @property
    def last_hash(self) -> str:
        """The hash of the newest entry recorded (queued or written; GENESIS before the first)."""
        with self._lock:
            return self._prev

    @property
    def queued(self) -> int:
        """Entries recorded and not yet in the database (an outage makes this grow)."""
        with self._lock:
            return len(self._queued)

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            if self._closed:
                return
            chained = {"time": round(time.time(), 3), **entry, "replica": self.replica, "seq": self._seq,
                       "prev": self._prev}
            if not is_plain(chained):  # the columns are read from what the line says
                chained = plain_json(chained)
            digest, line = hashed_line(chained)
            self._queued.append((self.replica, self._seq, *entry_columns(chained), line.decode("utf-8")))
            self._prev, self._seq = digest, self._seq + 1
            self._lock.notify_all()

    def flush(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Wait until every recorded entry is in the database; whether it happened in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queued and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(min(left, 0.05))
            return not self._queued

    def _write_queued(self) -> None:
        delay, give_up_at, failing = RETRY_FIRST_S, None, False
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._lock.wait()
                if not self._queued:
                    return
                if self._closed and give_up_at is None:
                    give_up_at = time.monotonic() + CLOSE_WAIT_S
                rows = list(islice(self._queued, BATCH_ROWS))
            try:
                self._insert(rows)
            except Exception as error:  # any failure: the rows stay queued, in order
                if not failing:
                    log.warning("audit log in %s: %d entr(ies) queued, not written (%s): retrying",
                                self.database.url.redacted, self.queued, str(error).splitlines()[0] if str(error)
                                else type(error).__name__)
                failing = True
                if give_up_at is not None and time.monotonic() >= give_up_at:
                    self._give_up()
                    return
                with self._lock:
                    self._lock.wait(delay)  # a close wakes it: the last tries start at once
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            with self._lock:
                for _ in rows:
                    self._queued.popleft()
                self._lock.notify_all()
            if failing:
                log.warning("audit log in %s: written again (%d entr(ies) still queued)", self.database.url.redacted,
                            self.queued)
            delay, failing = RETRY_FIRST_S, False

    def _insert(self, rows: list[tuple[Any, ...]]) -> None:
        self.database.transaction(lambda session: session.executemany(INSERT, rows))

    def _give_up(self) -> None:
        with self._lock:
            lost = len(self._queued)
            first = self._queued[0][1] if lost else None
            self._queued.clear()
            self._lock.notify_all()
        log.error("audit log in %s: the store stayed unreachable for %.0f s after close: %d entr(ies) of chain %r "
                  "from entry %s were not written", self.database.url.redacted, CLOSE_WAIT_S, lost, self.replica, first)

    def close(self) -> None:
        """Stop recording, write what is queued (waiting up to CLOSE_WAIT_S on an unreachable
        store), and stop the writer. The database itself is its owner's to close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._writer.join()
        log.info("audit log in %s: chain %r ends at entry %d, hash %s", self.database.url.redacted, self.replica,
                 self._seq - 1, self._prev)


def read_store_audit_log(database: Database, since: float | None = None) -> list[dict[str, Any]]:
    """Every entry in the store (at or after `since` when given), by time, then replica and seq."""
    migrate(database, SCHEMA)
    where, args = ("WHERE time >= ? ", (since,)) if since is not None else ("", ())
    rows = database.query(f"SELECT entry FROM audit_entries {where}ORDER BY time, replica, seq", args)
    return [json.loads(row["entry"]) for row in rows]


def store_spent_since(database: Database, since: float) -> dict[str, float]:
    """USD per tenant of the answered requests (status 200) the store records at or after `since`,
    every replica's (spend_restore.py's rule: an entry without a tenant counts for `default`)."""
    migrate(database, SCHEMA)
    rows = database.query(
        f"SELECT COALESCE(tenant, '{DEFAULT_TENANT}') AS tenant, SUM(cost_usd) AS spent FROM audit_entries "
        "WHERE status = 200 AND time >= ? AND cost_usd IS NOT NULL GROUP BY 1", (since,))
    return {row["tenant"]: float(row["spent"]) for row in rows}
