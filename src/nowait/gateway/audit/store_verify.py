"""`nowait audit verify --store`: every replica's chain in the shared store, checked by the file
verifier's walk (verify.py) over the rows in (replica, seq) order, then each row's columns
against its entry.

A row is one line of that walk, so the breaks are the file's: an entry edited (`altered`), a
row deleted (`removed`), rows whose seq were swapped or renumbered (`reordered`: an entry stands
where another was due, and that one comes later), a row added (`inserted`). A column that no
longer says what its entry says (a cost lowered, a tenant renamed: what spend reads) is
`altered` too. Each break names its row by position and by its (replica, seq) key. As with the
file, rows cut from the end of a chain are seen only against a `last_hash` recorded elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from nowait.gateway.audit.log import parse_entry
from nowait.gateway.audit.store_log import SCHEMA, entry_columns
from nowait.gateway.audit.verify import Break, Verdict, _Walk
from nowait.store.database import Database
from nowait.store.schema import migrate


def _in_rows(broken: Break, rows: list[Any]) -> Break:
    """The walk's break, in rows: `line N` read as `row N`, and the row's key added."""
    message = re.sub(r"\bline(s?) (\d+)", r"row\1 \2", broken.message).replace("the lines", "the rows")
    if broken.kind == "torn":  # the store has no torn writes: a row that is not JSON was edited
        message = f"row {broken.line} is not a JSON entry: it was altered"
        broken = replace(broken, kind="altered")
    row = rows[broken.line - 1]
    return replace(broken, message=f"{message} [row {broken.line}: replica {row['replica']!r}, seq {row['seq']}]")


def _column_break(number: int, row: Any) -> Break | None:
    entry = parse_entry(row["entry"].encode("utf-8"))
    assert entry is not None  # the walk accepted it
    where = f"[row {number}: replica {row['replica']!r}, seq {row['seq']}]"
    named = dict(replica=entry["replica"], seq=entry["seq"], request_id=entry.get("request_id"))
    if (row["replica"], row["seq"]) != (entry["replica"], entry["seq"]):
        return Break(number, "altered", f"row {number}'s key is not its entry's (replica {entry['replica']!r}, seq "
                                        f"{entry['seq']}): it was altered {where}", **named)
    stored = (row["time"], row["tenant"], row["status"], row["cost_usd"])
    if stored != entry_columns(entry):
        names = [name for name, have, due in zip(("time", "tenant", "status", "cost_usd"), stored,
                                                 entry_columns(entry), strict=True) if have != due]
        return Break(number, "altered", f"row {number}'s {', '.join(names)} column(s) do not say what its entry says: "
                                        f"they were altered {where}", **named)
    return None


def verify_store(database: Database) -> Verdict:
    """Check every chain in the store's audit table (`StoreError` for a newer schema)."""
    migrate(database, SCHEMA)
    rows = database.query("SELECT replica, seq, time, tenant, status, cost_usd, entry FROM audit_entries "
                          "ORDER BY replica, seq")
    verdict = Verdict(database.url.redacted)
    broken = _Walk([row["entry"].encode("utf-8") for row in rows], verdict).run(ends_with_newline=True)
    if broken is not None:
        verdict.broken = _in_rows(broken, rows)
        return verdict
    for number, row in enumerate(rows, 1):
        if (broken := _column_break(number, row)) is not None:
            verdict.broken = broken
            return verdict
    return verdict
