"""A SQLite store database whose rows read as PostgreSQL's do, for the fast store tests that
mutmut runs (a PostgreSQL server per run would be too slow)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from nowait.store.database import SqliteDatabase


class FoldedRow(dict):
    """A row keyed by its column names folded to lower case, as PostgreSQL returns unquoted
    names, and read only by exactly those names (psycopg's dict_row; sqlite3.Row would also
    accept `row["ID"]`, which fails on PostgreSQL); by position too, as SQLite-only code reads it."""

    def __init__(self, cursor: sqlite3.Cursor, values: tuple) -> None:
        super().__init__((d[0].lower(), v) for d, v in zip(cursor.description, values, strict=True))
        self._values = values

    def __getitem__(self, key: str | int):
        return self._values[key] if isinstance(key, int) else super().__getitem__(key)


def postgres_like_sqlite(path: str | Path) -> SqliteDatabase:
    database = SqliteDatabase(path)
    database._db.row_factory = FoldedRow
    return database
