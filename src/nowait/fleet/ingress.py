"""The gateway of a fleet: the ingress deployment, serving the same FastAPI app as `nowait serve`
(gateway/app.py). An owned engine with `fleet.placement: replicas` (the default) is reached through
its deployment (FleetBackend); one with `placement: gateway` runs in this replica's own process,
as in `nowait serve`, with no hop between them. Remote upstreams are reached from here as in
`nowait serve`. Each gateway replica names itself in batch leases and its audit chain, so several
share one PostgreSQL store.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from nowait.engines.config import OwnedEngineSpec
from nowait.engines.factory import ModelCache
from nowait.fleet.backend import FleetBackend
from nowait.fleet.replica import check_worker, engine_load, process_facts, replica_id, serving
from nowait.gateway.app import create_app
from nowait.gateway.config import GatewayConfig
from nowait.gateway.domain import Backend
from nowait.gateway.engines import build_backends, build_owned
from nowait.gateway.owned import OwnedBackend
from nowait.host_memory import keep_freed_memory


def colocated_engine_names(config: GatewayConfig) -> list[str]:
    """Owned engines with `fleet.placement: gateway`: each gateway replica runs them itself."""
    return [name for name in config.in_process_engine_names()
            if (spec := config.engines[name]).fleet is not None and spec.fleet.placement == "gateway"]


def colocated_resources(config: GatewayConfig) -> tuple[float, float]:
    """The CPUs and GPUs one gateway replica holds: those of the engines it runs itself."""
    fleets = [config.engines[name].fleet for name in colocated_engine_names(config)]
    return sum(f.cpus_per_replica for f in fleets), sum(f.gpus_per_replica for f in fleets)


def colocated_torch_threads(config: GatewayConfig) -> int | None:
    """`server.torch_threads` for a gateway replica that runs engines: its CPUs (less
    `server.reserved_cores`) shared out among them, at least one each, as `nowait serve` shares
    the machine's cores; None when set or none run."""
    engines = colocated_engine_names(config)
    if config.server.torch_threads or not engines:
        return None
    return config.engine_threads(int(colocated_resources(config)[0]), len(engines))


@serve.ingress()
class GatewayIngress:
    """One gateway replica; `engines`: the deployment handle of each owned engine placed on
    replicas of its own, by engine name (the others run here)."""

    def __init__(self, config: GatewayConfig, engines: dict[str, DeploymentHandle]) -> None:
        keep_freed_memory()  # the engines placed here run in this Ray worker's process
        store = config.store.model_copy(update={"replica": config.store.replica or f"gateway-{replica_id()}"})
        server = config.server.model_copy(update={"torch_threads": colocated_torch_threads(config)
                                                  or config.server.torch_threads})
        self.config = config.model_copy(update={"store": store, "server": server})
        self.engines = engines
        self.colocated: dict[str, OwnedBackend] = {}  # the engines this replica runs itself
        self.models = ModelCache()  # shared by them, as in `nowait serve` (ar and spec hold one copy)

    def owned_backend(self, name: str, spec: OwnedEngineSpec) -> Backend:
        if name in self.engines:
            return FleetBackend(name, spec, self.engines[name], self.config.metrics_window_s)
        backend = serving(name, build_owned(name, spec, self.models, self.config.metrics_window_s,
                                            self.config.defaults.max_tokens))
        self.colocated[name] = backend
        return backend

    def record_routing_stats(self) -> dict:
        """The load of the engines this replica runs, by name (`fleet status` reads it)."""
        return {name: {**engine_load(backend), **process_facts()} for name, backend in self.colocated.items()}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; an engine of this replica whose worker thread has
        stopped marks the replica unhealthy, and Ray replaces it (as an engine replica's check)."""
        for backend in self.colocated.values():
            check_worker(backend)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve calls this once the constructor has run; the app's lifespan then starts it."""
        return create_app(self.config, build_backends(self.config, owned=self.owned_backend))
