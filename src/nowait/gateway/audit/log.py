"""The audit log writer: one chained JSONL entry per request, appended and flushed as it ends.

At start the writer reads the end of the file for its replica's last entry and continues that
chain (`prev` = its hash, `seq` = its number + 1), so a restart does not break it. A crash can
leave the last line torn (a write cut short). The writer then ends that fragment with a newline
and its next entry vouches for it (`torn`: each fragment's length and SHA-256), so `verify`
accepts the fragments the writer found and nothing else: an unvouched fragment is reported.

One process writes a file; several replicas keep one chain each (`replica`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import IO, Any

from nowait.gateway.audit.chain import GENESIS, LOCAL_REPLICA, fragment_digest, hashed_line

log = logging.getLogger("nowait.gateway")
TAIL_BLOCK = 1 << 16


def parse_entry(line: bytes) -> dict[str, Any] | None:
    """The JSON object on one line, or None for anything else (a torn write, an edit)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def is_chained(entry: dict[str, Any]) -> bool:
    """Whether the entry carries the chain fields with the types the writer gives them."""
    return (isinstance(entry.get("hash"), str) and isinstance(entry.get("prev"), str)
            and isinstance(entry.get("replica"), str) and type(entry.get("seq")) is int)


def lines_from_end(handle: IO[bytes]) -> Iterator[bytes]:
    """A binary file's lines, last first, read in blocks from the end: the first one yielded is
    whatever follows the last newline (empty when the file ends with one)."""
    handle.seek(0, os.SEEK_END)
    position, rest = handle.tell(), b""
    while position > 0:
        size = min(TAIL_BLOCK, position)
        position -= size
        handle.seek(position)
        pieces = (handle.read(size) + rest).split(b"\n")
        rest = pieces[0]
        yield from reversed(pieces[1:])
    yield rest


@dataclass
class ChainHead:
    """Where a replica's chain stands in a file: the next entry's `prev` and `seq`, and the torn
    lines after the last entry (their bytes, in file order) that the next entry must vouch for."""

    prev: str = GENESIS
    seq: int = 0
    torn: list[bytes] = field(default_factory=list)
    ends_without_newline: bool = False


def read_head(path: Path, replica: str) -> ChainHead:
    """The chain head of `replica` at the end of the file (a new chain when it has no entry)."""
    head = ChainHead()
    if not path.exists():
        return head
    with path.open("rb") as handle:
        lines = lines_from_end(handle)
        last = next(lines, b"")
        head.ends_without_newline = bool(last)
        fragments_end = True  # still among the lines after the file's last entry
        for line in chain([last], lines) if last else lines:
            entry = parse_entry(line)
            if entry is None:
                # A crash tears the line being written; a restart ends it with a newline and a
                # crash during the next write tears another: each, after the last entry, is vouched for.
                if fragments_end and line:
                    head.torn.insert(0, line)
                else:
                    fragments_end = False
                continue
            fragments_end = False
            if is_chained(entry) and entry["replica"] == replica:
                head.prev, head.seq = entry["hash"], entry["seq"] + 1
                break
    return head


class AuditLog:
    """Append-only, hash-chained JSONL file of decisions; safe to call from any thread."""

    def __init__(self, path: str | Path, replica: str = LOCAL_REPLICA) -> None:
        self.path, self.replica = Path(path), replica
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        head = read_head(self.path, replica)
        self._prev, self._seq = head.prev, head.seq
        self._torn = [fragment_digest(line) for line in head.torn] or None
        self._file = self.path.open("ab")
        if head.ends_without_newline:
            self._file.write(b"\n")  # the next entry starts on a line of its own
            self._file.flush()
        if head.torn:
            log.warning("audit log %s ends with %d torn line(s) (%s bytes: a write cut short): the next entry "
                        "vouches for them", self.path, len(head.torn), ", ".join(str(len(t)) for t in head.torn))
        log.info("audit log %s: chain %r continues at entry %d after %s", self.path, replica, self._seq, self._prev)

    @property
    def last_hash(self) -> str:
        """The hash of the newest entry (GENESIS before the first): what to record elsewhere to
        make truncating the log's end detectable."""
        with self._lock:
            return self._prev

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            if self._file.closed:
                return
            chained = {"time": round(time.time(), 3), **entry, "replica": self.replica, "seq": self._seq,
                       "prev": self._prev}
            if self._torn is not None:
                chained["torn"] = self._torn
            digest, line = hashed_line(chained)
            self._file.write(line + b"\n")
            self._file.flush()
            self._prev, self._seq, self._torn = digest, self._seq + 1, None

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
                log.info("audit log %s: chain %r ends at entry %d, hash %s", self.path, self.replica,
                         self._seq - 1, self._prev)


def read_audit_log(path: str | Path) -> list[dict[str, Any]]:
    """Every whole entry of an audit log, in file order (a torn line is left out)."""
    path = Path(path)
    if not path.exists():
        return []
    entries = (parse_entry(line) for line in path.read_bytes().splitlines() if line.strip())
    return [entry for entry in entries if entry is not None]
