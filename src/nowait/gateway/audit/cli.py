"""`nowait audit verify` and `nowait audit spend`: the audit log read back, from the shell: the
JSONL file of an embedded gateway, or (`--store URL`, or a config whose store.url is
PostgreSQL) every replica's chain in the shared store."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer

from nowait.cli_errors import fail
from nowait.gateway.store_option import STORE_HELP, shared_database, store_errors
from nowait.store.database import Database

audit_app = typer.Typer(help="Check the audit log's hash chain; sum what each tenant spent.", no_args_is_help=True)

PATH_HELP = "audit log (default: the --config file's, else the default config's nowait-data/audit.jsonl)"
CONFIG_HELP = "nowait.yaml whose audit log to read"
STORE_OPTION = typer.Option(None, "--store", help=STORE_HELP)


class SpendBy(str, Enum):
    tenant = "tenant"
    engine = "engine"


def audit_path(path: Path | None, config: Path | None) -> Path:
    """The log named, else the one the config (or the default config) writes."""
    if path is not None:
        return path
    from nowait.gateway.config import ConfigError, default_config, load_config

    try:
        return (load_config(config) if config is not None else default_config()).audit_log_path
    except ConfigError as error:
        fail(str(error))


def audit_database(path: Path | None, config: Path | None, store: str | None) -> Database | None:
    """The shared store to read (`--store`, or the config's PostgreSQL store); None: a file."""
    if path is not None:
        if store is not None:
            fail("give an audit log path or --store, not both")
        return None
    return shared_database(store, config)


@audit_app.command()
def verify(
    path: Path = typer.Argument(None, help=PATH_HELP),
    config: Path = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    store: str = STORE_OPTION,
    as_json: bool = typer.Option(False, "--json", help="print the verdict as JSON"),
) -> None:
    """Check every entry's hash and link (every replica's chain): exit 0 with the count, or 1 naming
    the first break."""
    from nowait.gateway.audit.verify import verify_audit_log

    database = audit_database(path, config, store)
    if database is not None:
        from nowait.gateway.audit.store_verify import verify_store

        try:
            with store_errors():
                verdict = verify_store(database)
        finally:
            database.close()
        target = verdict.path
    else:
        target = audit_path(path, config)
        try:
            verdict = verify_audit_log(target)
        except FileNotFoundError:
            fail(f"no audit log at {target}")
    if as_json:
        typer.echo(json.dumps(verdict.as_json()))
    elif verdict.ok:
        chains = ", ".join(f"{name}: {state.entries} entries, last hash {state.last_hash}"
                           for name, state in verdict.replicas.items())
        torn = f"; torn writes vouched for at lines {verdict.torn_lines}" if verdict.torn_lines else ""
        typer.echo(f"{verdict.entries} entries checked in {target}: the chain is whole ({chains or 'empty'}){torn}")
    else:
        typer.echo(f"{target}: {verdict.broken.kind}: {verdict.broken.message} ({verdict.entries} entries before "
                   "it check)")
    if not verdict.ok:
        raise typer.Exit(code=1)


@audit_app.command("spend")
def spend_command(
    path: Path = typer.Argument(None, help=PATH_HELP),
    config: Path = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    store: str = STORE_OPTION,
    since: str = typer.Option(None, help="only requests ended at or after this ISO 8601 time (UTC unless it says)"),
    by: SpendBy = typer.Option(SpendBy.tenant, help="rows per tenant or per engine"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON"),
) -> None:
    """What each tenant (or engine) spent: requests, errors, tokens and dollars, from the audit log."""
    from nowait.gateway.audit.log import read_audit_log
    from nowait.gateway.audit.spend import since_timestamp, spend, spend_json, total

    try:
        start = since_timestamp(since) if since is not None else None
    except ValueError:
        fail(f"--since: not an ISO 8601 date or time: {since!r}")
    database = audit_database(path, config, store)
    if database is not None:
        from nowait.gateway.audit.store_log import read_store_audit_log

        try:
            with store_errors():
                entries = read_store_audit_log(database, start)
        finally:
            database.close()
    else:
        target = audit_path(path, config)
        if not target.exists():
            fail(f"no audit log at {target}")
        entries = read_audit_log(target)
    rows = spend(entries, by.value, start)
    if as_json:
        typer.echo(json.dumps(spend_json(rows, by.value, start)))
        return
    width = max([len(by.value), 5, *(len(name) for name in rows)])
    typer.echo(f"{by.value:<{width}}  {'requests':>8}  {'errors':>6}  {'prompt_tok':>10}  {'output_tok':>10}  "
               f"{'cost_usd':>12}")
    for name, row in [*rows.items(), ("total", total(rows))]:
        typer.echo(f"{name:<{width}}  {row.requests:>8}  {row.errors:>6}  {row.prompt_tokens:>10}  "
                   f"{row.completion_tokens:>10}  {row.cost_usd:>12.6f}")


def register(app: typer.Typer) -> None:
    """Add the `audit` group to the nowait CLI."""
    app.add_typer(audit_app, name="audit")
