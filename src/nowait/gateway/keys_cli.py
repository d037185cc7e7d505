"""`nowait keys create | list | revoke`: the tenants' API keys, in the store the gateway reads
(the config's `auth.database`, by default keys.sqlite beside the batch store; a shared store
with `--store URL` or a config whose store.url is PostgreSQL). A running server honours a new
key or a revoke from its next request on (every replica of a shared store within a second)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import typer

from nowait.cli_errors import fail
from nowait.gateway.store_option import STORE_HELP, shared_database, store_errors

keys_app = typer.Typer(help="API keys of the tenants: create (the secret is shown once), list, revoke.",
                       no_args_is_help=True)

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="nowait.yaml of the gateway (default: its defaults)")
STORE_OPTION = typer.Option(None, "--store", help=STORE_HELP)


def _store(config: Path | None, store: str | None = None):
    from nowait.gateway.config import ConfigError, default_config, load_config
    from nowait.gateway.keys import SqlKeyStore, open_key_store

    database = shared_database(store, config)
    if database is not None:
        try:
            with store_errors():
                return SqlKeyStore(database, owns_database=True)
        except BaseException:
            database.close()
            raise
    try:
        settings = load_config(config) if config is not None else default_config()
    except ConfigError as error:
        fail(str(error))
    return open_key_store(settings.key_database)


def _when(moment: int | None) -> str:
    return datetime.fromtimestamp(moment, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if moment else "-"


def _limits(record) -> str:
    parts = [f"{name} {value:g}" for name, value in (("rpm", record.requests_per_minute),
                                                    ("tpm", record.tokens_per_minute),
                                                    ("$/day", record.budget_usd_per_day)) if value is not None]
    return ", ".join(parts) or "-"


@keys_app.command("create")
def create(
    tenant: str = typer.Option(..., help="the team the key belongs to; its files and batches are its own"),
    models: str = typer.Option(None, help="comma-separated router model and engine names it may use (default: all)"),
    data_class_floor: str = typer.Option(None, help="every request is treated as at least this class "
                                                    "(public, internal, restricted)"),
    rpm: int = typer.Option(None, min=1, help="requests per minute"),
    tpm: int = typer.Option(None, min=1, help="prompt + completion tokens per minute"),
    budget_usd_per_day: float = typer.Option(None, help="the tenant's spend per UTC day, owned compute included"),
    expires_in_days: float = typer.Option(None, help="the key stops working after this many days"),
    config: Path = CONFIG_OPTION,
    store: str = STORE_OPTION,
    as_json: bool = typer.Option(False, "--json", help="one JSON object: key, id, tenant and the settings"),
) -> None:
    """Create a key and print its secret: this once, never again (only its hash is stored)."""
    from nowait.gateway.keys import KeySettings
    from nowait.router import DataClass

    try:
        floor = DataClass(data_class_floor.lower()) if data_class_floor else None
    except ValueError:
        fail(f"--data-class-floor must be one of {', '.join(c.value for c in DataClass)}, got {data_class_floor!r}")
    names = tuple(n.strip() for n in models.split(",") if n.strip()) if models else None
    try:
        settings = KeySettings(tenant=tenant, models=names or None, data_class_floor=floor, requests_per_minute=rpm,
                               tokens_per_minute=tpm, budget_usd_per_day=budget_usd_per_day,
                               expires_in_days=expires_in_days)
    except ValueError as error:
        fail(str(error))
    keys = _store(config, store)
    try:
        with store_errors():
            secret, record = keys.create(settings)
    finally:
        keys.close()
    if as_json:
        typer.echo(json.dumps({"key": secret, **record.public()}))
        return
    typer.echo(f"{record.id} (tenant {record.tenant}; models {', '.join(record.models or ('all',))}; "
               f"floor {record.data_class_floor.value if record.data_class_floor else '-'}; limits "
               f"{_limits(record)}; expires {_when(record.expires_at)})")
    typer.echo(secret)
    typer.echo("Store this key now: it is not shown again (the gateway keeps only its hash).", err=True)


@keys_app.command("list")
def list_keys(
    tenant: str = typer.Option(None, help="only this tenant's keys"),
    config: Path = CONFIG_OPTION,
    store: str = STORE_OPTION,
    as_json: bool = typer.Option(False, "--json", help="a JSON list of the records"),
) -> None:
    """The keys' records (ids, tenants, times, scopes, limits); never a secret."""
    keys = _store(config, store)
    try:
        with store_errors():
            records = keys.list(tenant)
    finally:
        keys.close()
    if as_json:
        typer.echo(json.dumps([r.public() for r in records]))
        return
    if not records:
        typer.echo("no keys" + (f" for tenant {tenant}" if tenant else ""))
        return
    for r in records:
        state = f"revoked {_when(r.revoked_at)}" if r.revoked_at else f"expires {_when(r.expires_at)}"
        typer.echo(f"{r.id}  {r.tenant}  created {_when(r.created_at)}  {state}  models "
                   f"{','.join(r.models) if r.models else 'all'}  floor "
                   f"{r.data_class_floor.value if r.data_class_floor else '-'}  limits {_limits(r)}")


@keys_app.command("revoke")
def revoke(
    key_id: str = typer.Argument(..., help="the key's id (key_...), as `nowait keys list` shows it"),
    config: Path = CONFIG_OPTION,
    store: str = STORE_OPTION,
) -> None:
    """Revoke a key: a running gateway refuses it (401) from its next request on (within a second on
    every replica of a shared store)."""
    keys = _store(config, store)
    try:
        with store_errors():
            record = keys.revoke(key_id)
    finally:
        keys.close()
    if record is None:
        fail(f"no key {key_id!r} (see `nowait keys list`)")
    typer.echo(f"revoked {record.id} (tenant {record.tenant}) at {_when(record.revoked_at)}")
