"""The hash chain of the audit log: what one entry's hash covers, and how entries link.

    line  = canonical(entry)                     the whole line, `hash` included, then "\n"
    hash  = sha256(canonical(entry - {"hash"}))  hex, over every other field, `prev` and `seq` included
    prev  = the hash of the same replica's previous entry (GENESIS for its first)
    seq   = that replica's entry number, 0, 1, 2, ...

canonical(x) is JSON with sorted keys, no spaces (separators "," and ":"), non-ASCII written as
itself and encoded UTF-8: Python's `json.dumps(x, sort_keys=True, separators=(",", ":"),
ensure_ascii=False).encode()`. Because the line itself is canonical, any byte changed on it
changes either its hash or its canonical form, so `verify` notices every edit, even one that
leaves the parsed JSON equal (a space added, a number respelled).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

GENESIS = "0" * 64  # `prev` of a replica's first entry
LOCAL_REPLICA = "local"  # the one-process server's chain; a fleet names one chain per replica
CHAIN_FIELDS = frozenset({"replica", "seq", "prev", "hash"})  # what the writer adds to every entry


def canonical(value: Any) -> bytes:
    """The one byte string an entry is hashed and written as."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def entry_hash(entry: dict[str, Any]) -> str:
    """SHA-256 (hex) of the entry's canonical JSON without its own `hash` field."""
    return hashlib.sha256(canonical({k: v for k, v in entry.items() if k != "hash"})).hexdigest()


def plain_json(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry as JSON reads it back (tuples as lists, other objects as their str, a lone
    surrogate from a client's string as "?"), so the hash written is the hash a reader of the
    line recomputes."""
    text = json.dumps(entry, ensure_ascii=False, default=str)
    return json.loads(text.encode("utf-8", "replace").decode("utf-8"))


_LEAVES = (str, int, float, bool, type(None))


def is_plain(value: Any) -> bool:
    """Whether `value` is already what JSON reads back (string keys, JSON's scalars, lists; a
    tuple writes as the list it reads back as), so its canonical JSON is the reader's."""
    kind = type(value)
    if kind in _LEAVES:
        return True
    if kind is dict:
        return all(type(k) is str and is_plain(v) for k, v in value.items())
    if kind is list or kind is tuple:
        return all(is_plain(v) for v in value)
    return False


# Stands in for the hash while the line is written: as long as a SHA-256 in hex, and drawn per
# process, so no value a client sends can hold it (and a string holding `"hash":"` is escaped).
_PLACEHOLDER = secrets.token_hex(32)
_PLACEHOLDER_FIELD = f'"hash":"{_PLACEHOLDER}"'.encode("ascii")


def hashed_line(entry: dict[str, Any]) -> tuple[str, bytes]:
    """The hash of an entry that has no `hash` yet, and its line with that hash in place: the
    same bytes as `entry_hash` and `canonical` of the entry with the hash added, with the entry
    serialized once instead of three times (the per-request cost of the chain). The entry is
    written with a placeholder hash, which sorts where the hash goes; without that field (and
    the comma joining it to a neighbour) the line is the canonical JSON the hash covers, and
    the hash then takes the placeholder's place, byte for byte the same length."""
    if not is_plain(entry):
        entry = plain_json(entry)
    try:
        line = canonical({**entry, "hash": _PLACEHOLDER})
    except UnicodeEncodeError:  # a lone surrogate from a client's string: plain_json writes it "?"
        return hashed_line(plain_json(entry))
    at = line.index(_PLACEHOLDER_FIELD)
    end = at + len(_PLACEHOLDER_FIELD)
    if line[end:end + 1] == b",":  # fields after it
        covered = line[:at] + line[end + 1:]
    elif line[at - 1:at] == b",":  # fields only before it
        covered = line[:at - 1] + line[end:]
    else:  # no other field
        covered = b"{}"
    digest = hashlib.sha256(covered).hexdigest()
    value_at = at + len(b'"hash":"')
    return digest, line[:value_at] + digest.encode("ascii") + line[value_at + len(_PLACEHOLDER):]


def fragment_digest(fragment: bytes) -> dict[str, Any]:
    """How the entry after a torn line vouches for it: its length and SHA-256."""
    return {"bytes": len(fragment), "sha256": hashlib.sha256(fragment).hexdigest()}
