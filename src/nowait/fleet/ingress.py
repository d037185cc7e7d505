"""The gateway of a fleet: the ingress deployment, serving the same FastAPI app as `nowait serve`
(gateway/app.py), its owned engines reached through their deployments (FleetBackend), its remote
upstreams from here as in `nowait serve`. Each gateway replica names itself in batch leases and
its audit chain, so several share one PostgreSQL store.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from nowait.engines.config import OwnedEngineSpec
from nowait.fleet.backend import FleetBackend
from nowait.fleet.replica import replica_id
from nowait.gateway.app import create_app
from nowait.gateway.config import GatewayConfig
from nowait.gateway.domain import Backend
from nowait.gateway.engines import build_backends


@serve.ingress()
class GatewayIngress:
    """One gateway replica; `engines`: each owned engine's deployment handle, by engine name."""

    def __init__(self, config: GatewayConfig, engines: dict[str, DeploymentHandle]) -> None:
        store = config.store.model_copy(update={"replica": config.store.replica or f"gateway-{replica_id()}"})
        self.config = config.model_copy(update={"store": store})
        self.engines = engines

    def fleet_backend(self, name: str, spec: OwnedEngineSpec) -> Backend:
        return FleetBackend(name, spec, self.engines[name], self.config.metrics_window_s)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this once the constructor has run; the app's lifespan then starts it."""
        return create_app(self.config, build_backends(self.config, owned=self.fleet_backend))
