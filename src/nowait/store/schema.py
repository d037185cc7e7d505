"""Versioned schema migrations: each store component (batches, keys, audit) lists its steps, and
the table `nowait_schema` records how many of them a database has had.

Opening a database applies the steps it lacks, in one transaction (on PostgreSQL under an
advisory lock, so replicas starting together migrate once); a database at a version newer than
this nowait's steps is refused with one line, before anything is written.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nowait.store.database import Database, Session
from nowait.store.url import StoreError

# A step is SQL (statements separated by `;`) for one dialect, or a function of the session and dialect.
Step = Callable[[Session, str], None]

VERSION_TABLE = "CREATE TABLE IF NOT EXISTS nowait_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"


@dataclass(frozen=True)
class Component:
    name: str
    steps: Sequence[Step]

    @property
    def version(self) -> int:
        return len(self.steps)


def sql_step(sqlite: str, postgresql: str | None = None) -> Step:
    """A step of plain statements, the same for both dialects unless PostgreSQL's are given."""
    def run(session: Session, dialect: str) -> None:
        script = postgresql if dialect == "postgresql" and postgresql is not None else sqlite
        for statement in (s.strip() for s in script.split(";")):
            if statement:
                session.execute(statement)
    return run


def schema_version(session: Session, component: str) -> int:
    rows = session.execute("SELECT version FROM nowait_schema WHERE component = ?", (component,)).fetchall()
    return rows[0]["version"] if rows else 0


def migrate(database: Database, component: Component) -> int:
    """Bring `component`'s tables to this nowait's version; the version the database was at."""
    def work(session: Session) -> int:
        if database.dialect == "postgresql":
            session.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(b"nowait_schema"),))
        session.execute(VERSION_TABLE)
        found = schema_version(session, component.name)
        if found > component.version:
            raise StoreError(f"store {database.url.redacted}: its {component.name} schema is at version {found}, newer "
                             f"than this nowait's {component.version}: upgrade nowait (or use another store)")
        for step in component.steps[found:]:
            step(session, database.dialect)
        if found < component.version:
            session.execute("DELETE FROM nowait_schema WHERE component = ?", (component.name,))
            session.execute("INSERT INTO nowait_schema (component, version) VALUES (?, ?)",
                            (component.name, component.version))
        return found
    return database.transaction(work)
