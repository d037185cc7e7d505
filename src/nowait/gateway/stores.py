"""The stores a gateway opens from its config: files and batches, keys, and the audit log with
today's spend read back from it.

Embedded (`store.url` unset or `sqlite:///PATH`): batches.sqlite, keys.sqlite beside it and the
JSONL audit log, as one process's. Shared (`postgresql://...`): all of them in one PostgreSQL
database, one connection pool, which several replicas use at once (docs/gateway.md, "Several
replicas").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nowait.gateway.audit.log import AuditLog
from nowait.gateway.batch_store import BatchStore
from nowait.gateway.config import GatewayConfig
from nowait.gateway.keys import KeyStore, open_key_store
from nowait.gateway.spend_restore import spent_since
from nowait.store.database import Database, PostgresDatabase


@dataclass
class Stores:
    batches: BatchStore
    keys: KeyStore
    audit: AuditLog  # or the shared store's StoreAuditLog: the same record / last_hash / close
    spent_since: Callable[[float], dict[str, float]]  # USD per tenant answered since a moment
    database: Database | None = None  # the shared database, when there is one

    def close(self) -> None:
        self.batches.close()
        self.keys.close()
        self.audit.close()
        if self.database is not None:
            self.database.close()


def open_stores(config: GatewayConfig) -> Stores:
    """The config's stores, migrated and ready; `StoreError` (one line) when they cannot be opened."""
    url = config.store_url
    if not url.shared:
        audit_path = config.audit_log_path
        return Stores(BatchStore(config.batch_database), open_key_store(config.key_database),
                      AuditLog(audit_path),
                      lambda since: spent_since(audit_path, since))
    database = PostgresDatabase(url, max_connections=config.store.pool_size)
    try:
        return shared_stores(database, config.replica_name)
    except BaseException:
        database.close()
        raise


def shared_stores(database: Database, replica: str) -> Stores:
    """Batches, keys and the audit log in one shared database."""
    from nowait.gateway.audit.store_log import StoreAuditLog, store_spent_since
    from nowait.gateway.keys import SqlKeyStore

    return Stores(BatchStore(database), SqlKeyStore(database), StoreAuditLog(database, replica),
                  lambda since: store_spent_since(database, since), database)
