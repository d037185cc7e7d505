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


def _has_keys(settings) -> bool:
    """Any key that closes the server: configured, admin, or in the key store."""
    from nowait.gateway.keys import open_key_store

    if settings.auth.keys() or settings.auth.admin():
        return True
    store = open_key_store(settings.key_database)
    try:
        return store.any_keys()
    finally:
        store.close()


def serve(
    config: Path = typer.Option(None, "--config", "-c", help="nowait.yaml (default: the bundled demo models)"),
    host: str = typer.Option(None, help="address to listen on (default: the config's, 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default: the config's, 8000)"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads (default: the config's, else torch's choice)"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve the OpenAI-compatible gateway (chat, completions, batches, metrics)."""
    import uvicorn
    from pydantic import ValidationError

    from nowait.gateway.app import create_app
    from nowait.gateway.config import ConfigError, ServerConfig, default_config, load_config

    try:
        settings = load_config(config) if config is not None else default_config()
        overrides = {k: v for k, v in {"host": host, "port": port, "torch_threads": threads}.items() if v is not None}
        # Validated as a config file's values are (a copy with updates would take --port 70000).
        server = ServerConfig.model_validate({**settings.server.model_dump(), **overrides})
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    except ValidationError as error:
        first = error.errors()[0]
        typer.echo(f"error: --{'threads' if first['loc'][0] == 'torch_threads' else first['loc'][0]}: "
                   f"{first['msg']}", err=True)
        raise typer.Exit(code=2) from None
    settings = settings.model_copy(update={"server": server})
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if not _is_loopback(server.host) and not _has_keys(settings):
        logging.getLogger("nowait.gateway").warning(
            "listening on %s with no API keys: anyone who can reach it can use it (create keys with "
            "`nowait keys create`, or set auth.api_keys or NOWAIT_API_KEYS)", server.host)
    threshold, source = settings.confidence_threshold()
    logging.getLogger("nowait.gateway").info("diffusion answers below confidence %.3g re-run on %s (from %s)",
                                             threshold, settings.routing.fallback_engine, source)
    uvicorn.run(create_app(settings), host=server.host, port=server.port, log_level=log_level)


def register(app: typer.Typer) -> None:
    """Add `serve` to the nowait CLI."""
    app.command("serve")(serve)
