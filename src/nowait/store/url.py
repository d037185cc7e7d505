"""`store.url`: which database holds the gateway's files, batches, keys and audit log.

`sqlite:///PATH` (SQLAlchemy's convention: `sqlite:///relative/path`, `sqlite:////absolute/path`)
is the embedded default, one process's; `postgresql://user:password@host:port/db` (also
`postgres://`) is the shared store that several gateway replicas use at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


class StoreError(RuntimeError):
    """The store cannot be used: a bad URL, an unreachable server, a refused login, a schema newer
    than this nowait. The message is one line, fit to print, and never holds a password."""


@dataclass(frozen=True)
class StoreURL:
    kind: str  # "sqlite" or "postgresql"
    url: str  # as given (may hold a password: print `redacted`)
    path: Path | None = None  # sqlite only

    @property
    def redacted(self) -> str:
        return redact(self.url)

    @property
    def shared(self) -> bool:
        return self.kind == "postgresql"


def redact(url: str) -> str:
    """The URL with its password replaced by `***`, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


# A URL's user:password@ anywhere in a text, and a conninfo's password=VALUE (libpq's key=value
# form, quoted or not): what a driver's error message may echo back.
URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s@]*@", re.IGNORECASE)
CONNINFO_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact_text(text: str) -> str:
    """`text` with every password in it replaced by `***`: in URLs (wherever they stand in the
    line) and in `password=...` settings. For driver errors, which may quote the connection."""
    return CONNINFO_PASSWORD.sub(r"\1***", URL_PASSWORD.sub(r"\1***@", text))


def parse_store_url(url: str) -> StoreURL:
    url = url.strip()
    if url.startswith("sqlite://"):
        rest = url.removeprefix("sqlite://")
        if not rest.startswith("/") or rest == "/":
            raise StoreError(f"store URL {url!r}: a SQLite URL is sqlite:///PATH (relative) or sqlite:////PATH "
                             "(absolute)")
        return StoreURL("sqlite", url, Path(rest[1:]))
    scheme = re.match(r"^([a-z0-9+]+)://", url)
    if scheme and scheme.group(1) in ("postgresql", "postgres", "postgresql+psycopg"):
        parts = urlsplit(url)
        if not parts.hostname and "host=" not in parts.query:
            raise StoreError(f"store URL {redact(url)!r}: no host (postgresql://USER:PASSWORD@HOST:PORT/DATABASE)")
        plain = "postgresql://" + url.split("://", 1)[1]
        return StoreURL("postgresql", plain)
    raise StoreError(f"store URL {redact(url)!r}: expected sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DATABASE")
