"""`--store URL` of the commands that read the store (`nowait keys`, `nowait audit`): which
database they open, and how a store that cannot be used stops them (one line, exit 2).

`--store` names the database whose tables the command reads; without it, a `--config` whose
`store.url` is PostgreSQL (a shared store) names it; otherwise the command reads the embedded
gateway's files (keys.sqlite, audit.jsonl) as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nowait.cli_errors import fail
from nowait.store.database import Database, StoreUnavailable, open_database
from nowait.store.url import StoreError

STORE_HELP = ("the shared store to use, postgresql://USER:PASSWORD@HOST/DB (or sqlite:///PATH of a store "
              "database); default: the --config's store.url when it is PostgreSQL, else the gateway's files")


@contextmanager
def store_errors() -> Iterator[None]:
    """A store that cannot be used (bad URL, unreachable, refused login, newer schema): one line, exit 2."""
    try:
        yield
    except (StoreError, StoreUnavailable) as error:
        fail(str(error))


def shared_database(store: str | None, config: Path | None) -> Database | None:
    """The database `--store` names, else the config's when it is shared; None: the embedded files."""
    if store is None and config is not None:
        from nowait.gateway.config import ConfigError, load_config

        try:
            url = load_config(config).store_url
        except (ConfigError, StoreError) as error:
            fail(str(error))
        if not url.shared:
            return None
        store = url.url
    if store is None:
        return None
    with store_errors():
        return open_database(store)
