"""Whether any connection may have committed to a SQLite database in WAL mode, asked without a
statement: the wal-index header at the start of its `-shm` file, which every commit rewrites
(its change counter, last frame, checksums; a checkpoint that restarts the log changes its
salts). The format: sqlite.org/walformat.html, "The WAL-Index Header".

Why: the key store asks on every request whether another process (`nowait keys revoke`) wrote
the store since it last read a key. `PRAGMA data_version` answers that, but it opens a read
transaction, whose locks on the `-shm` file are several system calls, and between two requests
the engine has run, so each system call starts cold. SQLite maps the `-shm` file shared into
every connection's memory and commits by writing the header there; mapping it here too makes
the question a 96-byte compare in memory, with no system call at all. The header is only ever
a hint that nothing changed: a header that differs from the one seen at the last
`data_version` check, or one that cannot be read, sends the caller to `PRAGMA data_version`,
which decides. It never says "unchanged" after a commit: every commit rewrites the header, and
both copies (SQLite writes two, one after the other) are compared.

The mapping is safe to read while the store's own connection is open: SQLite truncates a
`-shm` file only when no connection, in any process, has it open, and it is mapped only after
that connection has opened it (at least the header's size). A non-POSIX system, or a file that
cannot be mapped, reads None: every check then asks `data_version`.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

HEADER_BYTES = 96  # the wal-index header and its copy


class WalHeader:
    """The wal-index header of one SQLite database, mapped read-only; `read()` is None where
    it could not be mapped."""

    def __init__(self, database_path: str | Path) -> None:
        self._map: mmap.mmap | None = None
        try:
            with open(f"{database_path}-shm", "rb") as handle:
                if os.fstat(handle.fileno()).st_size >= HEADER_BYTES:
                    self._map = mmap.mmap(handle.fileno(), HEADER_BYTES, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # no -shm file (not WAL), or no mmap here
            self._map = None

    def read(self) -> bytes | None:
        return self._map[:HEADER_BYTES] if self._map is not None else None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
