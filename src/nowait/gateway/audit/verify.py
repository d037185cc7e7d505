"""`nowait audit verify`: walk an audit log's chains and name the first entry that breaks one.

Each line must be canonical JSON (chain.py) whose `hash` is the SHA-256 of the rest, whose `seq`
is one more than its replica's previous entry, and whose `prev` is that entry's hash. The first
line that is not says what happened there:

    altered    its bytes are not what was hashed (an edit), or it is not JSON and no entry vouches for it
    removed    its replica's next entry is missing and appears nowhere later
    reordered  it stands where an entry that appears later was due
    inserted   it is no entry the writer wrote: no chain fields, or a number its chain already used
    torn       the last line is cut short (a crash) and no entry vouches for it yet

What a chain cannot show: entries cut from the end of the file (nothing after them names them),
or a whole chain rewritten from some entry on by someone who recomputes every hash. Recording
`last_hash` (printed here and logged when the server stops) outside the host covers both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nowait.gateway.audit.chain import CHAIN_FIELDS, GENESIS, canonical, entry_hash, fragment_digest
from nowait.gateway.audit.log import is_chained, parse_entry


@dataclass
class Break:
    """The first place the log stops being the chain the writer wrote."""

    line: int
    kind: str  # altered | removed | reordered | inserted | torn
    message: str
    replica: str | None = None
    seq: int | None = None
    request_id: str | None = None


@dataclass
class ChainState:
    entries: int = 0
    last_seq: int = -1
    last_hash: str = GENESIS
    last_line: int = 0


@dataclass
class Verdict:
    path: str
    entries: int = 0
    replicas: dict[str, ChainState] = field(default_factory=dict)
    torn_lines: list[int] = field(default_factory=list)  # crash fragments the next entry vouches for
    broken: Break | None = None

    @property
    def ok(self) -> bool:
        return self.broken is None

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "path": self.path, "entries": self.entries,
                "replicas": {name: asdict(state) for name, state in self.replicas.items()},
                "torn_lines": self.torn_lines, "broken": asdict(self.broken) if self.broken else None}


def _named(entry: dict[str, Any]) -> str:
    return f"entry {entry['seq']} of replica {entry['replica']!r} (request {entry.get('request_id')})"


class _Walk:
    """One pass over the lines; `positions` (replica, seq) -> line, read beforehand, tells a
    reordered entry (it comes later) from a removed one (it never comes)."""

    def __init__(self, lines: list[bytes], verdict: Verdict) -> None:
        self.lines, self.verdict = lines, verdict
        self.entries = [parse_entry(line) for line in lines]
        self.positions: dict[tuple[str, int], list[int]] = {}
        for number, entry in enumerate(self.entries, 1):
            if entry is not None and is_chained(entry):
                self.positions.setdefault((entry["replica"], entry["seq"]), []).append(number)

    def run(self, ends_with_newline: bool) -> Break | None:
        fragments: list[int] = []  # lines that are no JSON, waiting for the next entry's vouch
        for number, (raw, entry) in enumerate(zip(self.lines, self.entries, strict=True), 1):
            if entry is None:
                if not raw.strip():  # the writer never writes an empty line
                    return Break(number, "inserted", f"line {number} is empty: it was inserted")
                fragments.append(number)
                continue
            broken = self._check(number, raw, entry, fragments)
            if broken is not None:
                return broken
            self.verdict.torn_lines.extend(fragments)
            fragments = []
            state = self.verdict.replicas.setdefault(entry["replica"], ChainState())
            state.entries, state.last_seq, state.last_hash, state.last_line = (
                state.entries + 1, entry["seq"], entry["hash"], number)
            self.verdict.entries += 1
        if not fragments:
            return None
        first = fragments[0]
        cut = "" if ends_with_newline else ", the last with no newline"
        lines = f"line {first} is" if len(fragments) == 1 else f"lines {first} to {fragments[-1]} are"
        return Break(first, "torn", f"{lines} torn ({', '.join(str(len(self.lines[n - 1])) for n in fragments)} "
                                    f"bytes{cut}): a write cut short by a crash, or the end of an entry cut off; the "
                                    "gateway's next entry vouches for it when it restarts")

    def _unvouched(self, number: int) -> Break:
        return Break(number, "altered", f"line {number} is not a JSON entry, and the entry after it does not "
                                        "vouch for it as a torn write: it was altered")

    def _check(self, number: int, raw: bytes, entry: dict[str, Any], fragments: list[int]) -> Break | None:
        if not is_chained(entry):
            # Some chain fields but not all, as the writer writes them: an entry edited; none: a
            # line the writer never wrote.
            kind = "altered" if CHAIN_FIELDS & entry.keys() else "inserted"
            return Break(number, kind, f"line {number} is not a chained entry (the writer gives every entry a hash, "
                                       f"prev, seq and replica): it was {kind}", request_id=entry.get("request_id"))
        where = dict(replica=entry["replica"], seq=entry["seq"], request_id=entry.get("request_id"))
        if canonical(entry) != raw or entry_hash(entry) != entry["hash"]:
            return Break(number, "altered", f"line {number}, {_named(entry)}, was altered: its hash does not match "
                                            "its content", **where)
        vouched = entry.get("torn")
        if fragments and vouched != [fragment_digest(self.lines[n - 1]) for n in fragments]:
            return self._unvouched(fragments[0])
        if not fragments and vouched is not None:
            return Break(number, "removed", f"line {number}, {_named(entry)}, vouches for a torn line before it "
                                            "that is not there: that line was removed", **where)
        return self._link(number, entry, where)

    def _link(self, number: int, entry: dict[str, Any], where: dict[str, Any]) -> Break | None:
        replica, seq = entry["replica"], entry["seq"]
        state = self.verdict.replicas.get(replica, ChainState())
        due = state.last_seq + 1
        if seq == due and entry["prev"] == state.last_hash:
            return None
        if seq == due:
            after = f"entry {due - 1} at line {state.last_line}" if due else "the chain's start"
            return Break(number, "altered", f"line {number}, {_named(entry)}, does not follow {after} (its prev is "
                                            "another hash): it, or the entry before it, was replaced", **where)
        if seq < due:
            first = self.positions[(replica, seq)][0]
            return Break(number, "inserted", f"line {number} repeats {_named(entry)}, already at line {first}: "
                                             "one of them was inserted", **where)
        later = [n for n in self.positions.get((replica, due), []) if n > number]
        if later:
            return Break(number, "reordered", f"line {number} holds {_named(entry)} where entry {due} was due; "
                                              f"entry {due} is at line {later[0]}: the lines were reordered", **where)
        missing = f"entry {due} of replica {replica!r} was" if seq == due + 1 else \
            f"entries {due} to {seq - 1} of replica {replica!r} were"
        return Break(number, "removed", f"{missing} removed: line {number} holds entry {seq} (request "
                                        f"{entry.get('request_id')}) where entry {due} was due",
                     replica=replica, seq=due)


def verify_audit_log(path: str | Path) -> Verdict:
    """Check every chain of the log at `path` (FileNotFoundError when there is none)."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    ends_with_newline = data.endswith(b"\n")
    if ends_with_newline or not data:
        lines.pop()  # what follows the last newline: nothing
    verdict = Verdict(str(path))
    verdict.broken = _Walk(lines, verdict).run(ends_with_newline)
    return verdict
