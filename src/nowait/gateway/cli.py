"""`nowait serve`: the gateway under uvicorn."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import typer


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_store(settings) -> bool:
    """Open the config's store once before serving (a bad URL, an unreachable database, a refused
    login or a schema newer than this nowait is one line and exit 2, not a traceback from inside
    the server); whether it holds any key."""
    from nowait.gateway.stores import open_stores
    from nowait.store.url import StoreError

    try:
        stores = open_stores(settings)
    except StoreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    try:
        return stores.keys.any_keys()
    finally:
        stores.close()


def serve(
    config: Path = typer.Option(None, "--config", "-c", help="nowait.yaml (default: the bundled demo models)"),
    host: str = typer.Option(None, help="address to listen on (default: the config's, 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default: the config's, 8000)"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads (default: the config's, else the cores "
                                                  "less server.reserved_cores, shared by the engines)"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
    store: str = typer.Option(None, "--store", help="store URL (default: the config's store.url, else SQLite under "
                                                    "data_dir): sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DB"),
    replica: str = typer.Option(None, "--replica", help="this replica's name in batch leases and its audit chain "
                                                        "(default: the config's store.replica, else HOST:PORT)"),
) -> None:
    """Serve the OpenAI-compatible gateway (chat, completions, batches, metrics)."""
    import uvicorn
    from pydantic import ValidationError

    from nowait.gateway.app import create_app
    from nowait.gateway.config import ConfigError, ServerConfig, StoreConfig, default_config, load_config

    try:
        settings = load_config(config) if config is not None else default_config()
        overrides = {k: v for k, v in {"host": host, "port": port, "torch_threads": threads}.items() if v is not None}
        # Validated as a config file's values are (a copy with updates would take --port 70000).
        server = ServerConfig.model_validate({**settings.server.model_dump(), **overrides})
        store_overrides = {k: v for k, v in {"url": store, "replica": replica}.items() if v is not None}
        store_config = StoreConfig.model_validate({**settings.store.model_dump(), **store_overrides})
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    except ValidationError as error:
        first = error.errors()[0]
        where = first["loc"][0] if first["loc"] else "store"
        typer.echo(f"error: --{'threads' if where == 'torch_threads' else where}: "
                   f"{first['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(code=2) from None
    settings = settings.model_copy(update={"server": server, "store": store_config})
    has_keys = _check_store(settings)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if not _is_loopback(server.host) and not (has_keys or settings.auth.keys() or settings.auth.admin()):
        logging.getLogger("nowait.gateway").warning(
            "listening on %s with no API keys: anyone who can reach it can use it (create keys with "
            "`nowait keys create`, or set auth.api_keys or NOWAIT_API_KEYS)", server.host)
    threshold, source = settings.confidence_threshold()
    logging.getLogger("nowait.gateway").info("diffusion answers below confidence %.3g re-run on %s (from %s)",
                                             threshold, settings.routing.fallback_engine, source)
    # On SIGTERM uvicorn closes its listening sockets, lets the requests in flight finish for up
    # to the grace period, cancels what is left, then runs the lifespan's shutdown (engines and
    # the batch runner stop; a batch's unanswered lines are answered after the next start).
    uvicorn.run(create_app(settings), host=server.host, port=server.port, log_level=log_level,
                timeout_graceful_shutdown=server.shutdown_grace_s)


def register(app: typer.Typer) -> None:
    """Add `serve` to the nowait CLI."""
    app.command("serve")(serve)
