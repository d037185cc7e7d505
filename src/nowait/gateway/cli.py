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


def serve(
    config: Path = typer.Option(None, "--config", "-c", help="nowait.yaml (default: the bundled demo models)"),
    host: str = typer.Option(None, help="address to listen on (default: the config's, 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default: the config's, 8000)"),
    threads: int = typer.Option(None, help="torch CPU threads (default: the config's, else torch's choice)"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve the OpenAI-compatible gateway (chat, completions, batches, metrics)."""
    import uvicorn

    from nowait.gateway.app import create_app
    from nowait.gateway.config import ConfigError, default_config, load_config

    try:
        settings = load_config(config) if config is not None else default_config()
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    server = settings.server.model_copy(update={k: v for k, v in {"host": host, "port": port,
                                                                  "torch_threads": threads}.items() if v is not None})
    settings = settings.model_copy(update={"server": server})
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if not settings.auth.keys() and not _is_loopback(server.host):
        logging.getLogger("nowait.gateway").warning(
            "listening on %s with no API keys: anyone who can reach it can use it (set auth.api_keys or "
            "NOWAIT_API_KEYS)", server.host)
    threshold, source = settings.confidence_threshold()
    logging.getLogger("nowait.gateway").info("diffusion answers below confidence %.3g re-run on %s (from %s)",
                                             threshold, settings.routing.fallback_engine, source)
    uvicorn.run(create_app(settings), host=server.host, port=server.port, log_level=log_level)


def register(app: typer.Typer) -> None:
    """Add `serve` to the nowait CLI."""
    app.command("serve")(serve)
