"""The gateway configuration the demo serves.

Without `--config`: the gateway's own defaults (`nowait serve` with no file: engines `ar`, `spec`
and `diffusion` on the bundled demo models), with two demo choices:

- high-value work goes to `spec` (the AR model with speculative decoding: the same greedy
  answers as AR, fewer target forwards at batch 1), so each branch of the rule has its engine;
- the live gauges use a 15 s window, so utilization and cost per token move while you watch.

`--models DIR` points the engines at DIR/ar, DIR/draft and DIR/diffusion instead of the bundled
models (a missing diffusion model is served as unavailable, like the bundled one before it is
trained). With `--config FILE` the file is used as it is. In every case the demo listens on a
free loopback port and keeps its batch store and audit log in a fresh directory of its own, so
batches of an earlier run are never resumed into this one.
"""

from __future__ import annotations

from pathlib import Path

from nowait.gateway.config import (
    GatewayConfig,
    RemoteEngineConfig,
    SpecEngineConfig,
    default_config,
    load_config,
)

DEMO_METRICS_WINDOW_S = 15.0


def demo_config(config_file: Path | None, models_dir: Path | None, data_dir: Path, port: int,
                threads: int | None = None) -> GatewayConfig:
    """The config to serve (ConfigError names a bad file or field)."""
    if config_file is not None:
        config = load_config(config_file)
    else:
        config = default_config()
        engines = dict(config.engines)
        if models_dir is not None:
            for name, spec in engines.items():
                update = {"model": str(Path(models_dir) / spec.model)}
                if isinstance(spec, SpecEngineConfig):
                    update["draft"] = str(Path(models_dir) / spec.draft)
                engines[name] = spec.model_copy(update=update)
        routing = config.routing
        if "spec" in engines:
            routing = routing.model_copy(update={"owned_frontier_engine": "spec"})
        config = config.model_copy(update={"engines": engines, "routing": routing,
                                           "metrics_window_s": DEMO_METRICS_WINDOW_S})
    server = config.server.model_copy(update={"host": "127.0.0.1", "port": port,
                                              **({"torch_threads": threads} if threads else {})})
    batches = config.batches.model_copy(update={"database": None})
    return config.model_copy(update={"server": server, "data_dir": data_dir, "audit_log": None, "batches": batches})


def client_api_key(config: GatewayConfig) -> str | None:
    """A key the demo's client can send (the first configured), or None without authentication."""
    keys = sorted(config.auth.keys())
    return keys[0] if keys else None


def node_prices(config: GatewayConfig) -> dict[str, float]:
    """Each owned engine's node price per hour (the cost identity's numerator)."""
    return {name: spec.node_usd_per_hour for name, spec in config.engines.items()
            if not isinstance(spec, RemoteEngineConfig)}
