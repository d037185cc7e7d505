"""A config as a Ray Serve application, and the fleet's life: deploy, status, shut down.

    fleet_application(config)   the gateway ingress bound to one deployment per owned engine
    deploy(config)              serve it on the Ray cluster this process is connected to
    fleet_status()              {"engines": [{name, replicas: [...]}], "gateway_replicas", "url"}
    shut_down()                 delete the application and stop Serve

The local cluster `nowait fleet up` starts when `fleet.ray_address` is unset lives in cluster.py.
"""

from __future__ import annotations

import logging

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from nowait.engines.config import DiffusionEngineConfig, FleetEngineConfig, OwnedEngineSpec, RemoteEngineConfig
from nowait.fleet.ingress import GatewayIngress
from nowait.fleet.replica import EngineReplica
from nowait.fleet.router import NowaitRequestRouter
from nowait.gateway.config import GatewayConfig

log = logging.getLogger("nowait.fleet")

APP_NAME = "nowait"
GATEWAY = "gateway"
ROUTING_STATS_PERIOD_S = 0.5  # how stale a replica's reported load may be when the router reads it


def engine_deployment_name(engine: str) -> str:
    return f"engine-{engine}"


def gateway_replicas(config: GatewayConfig) -> int:
    """`fleet.gateway_replicas`, or one on an embedded (SQLite) store: its batches, keys and audit
    log are one process's (gateway/stores.py), so two gateways on it would each run every batch."""
    if config.store_url.shared or config.fleet.gateway_replicas == 1:
        return config.fleet.gateway_replicas
    log.warning("store.url is not PostgreSQL: the fleet runs one gateway replica, not %d (set store.url: "
                "postgresql://... for more)", config.fleet.gateway_replicas)
    return 1


def engine_options(spec: OwnedEngineSpec) -> dict:
    """The deployment options of one owned engine, from its `fleet` section (one replica without)."""
    fleet = spec.fleet or FleetEngineConfig()
    capacity = spec.max_batch if isinstance(spec, DiffusionEngineConfig) else spec.max_num_seqs
    options: dict = {
        "ray_actor_options": {"num_cpus": fleet.cpus_per_replica, "num_gpus": fleet.gpus_per_replica},
        # One more than the engine admits: the replica itself answers 429 (with its Retry-After),
        # as `nowait serve` does, instead of Ray holding the request in the handle's queue.
        "max_ongoing_requests": capacity + spec.max_queue + 1,
        "request_router_config": RequestRouterConfig(request_router_class=NowaitRequestRouter,
                                                     request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": 5.0,
    }
    if fleet.replicas.min == fleet.replicas.max:
        options["num_replicas"] = fleet.replicas.max
    else:
        options["autoscaling_config"] = {"min_replicas": fleet.replicas.min, "max_replicas": fleet.replicas.max,
                                         "target_ongoing_requests": fleet.target_ongoing_requests}
    return options


def fleet_application(config: GatewayConfig) -> serve.Application:
    """The gateway ingress bound to one deployment per owned engine (remote upstreams stay in it)."""
    engines = {}
    for name, spec in config.engines.items():
        if isinstance(spec, RemoteEngineConfig):
            continue
        deployment = serve.deployment(EngineReplica, name=engine_deployment_name(name), **engine_options(spec))
        engines[name] = deployment.bind(name, spec, config.metrics_window_s, config.defaults.max_tokens)
    gateway = serve.deployment(GatewayIngress, name=GATEWAY, num_replicas=gateway_replicas(config),
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                               graceful_shutdown_timeout_s=config.server.shutdown_grace_s)
    return gateway.bind(config, engines)


def url_of(config: GatewayConfig) -> str:
    return f"http://{config.fleet.host}:{config.fleet.port}"


def deploy(config: GatewayConfig) -> str:
    """Serve `config` on the connected Ray cluster; returns once every replica is up (its URL)."""
    serve.start(http_options={"host": config.fleet.host, "port": config.fleet.port})
    serve.run(fleet_application(config), name=APP_NAME, route_prefix="/", blocking=False)
    return url_of(config)


def _replica_load(actor_name: str) -> dict:
    try:
        actor = ray.get_actor(actor_name, namespace="serve")
        return ray.get(actor.record_routing_stats.remote(), timeout=5) or {}
    except Exception:  # starting, stopping, or gone: no load to report
        return {}


def _serve_details() -> dict:
    from ray.serve.context import _get_global_client  # the controller's details (what Ray's dashboard shows)

    return _get_global_client().get_serve_details()


def engine_replicas(details: dict | None = None) -> dict[str, list[dict]]:
    """Each engine's replicas: id, actor, node, pid, state and, for a running one, its full load
    report (`EngineReplica.load`)."""
    details = details or _serve_details()
    app = (details.get("applications") or {}).get(APP_NAME) or {"deployments": {}}
    engines = {}
    for name, deployment in app["deployments"].items():
        if name == GATEWAY:
            continue
        rows = []
        for r in deployment.get("replicas") or []:
            state = str(getattr(r.get("state"), "value", r.get("state")))  # RUNNING, STARTING, ...
            rows.append({"id": r["replica_id"], "actor_name": r["actor_name"], "node": r.get("node_id"),
                         "pid": r.get("pid"), "state": state,
                         "load": _replica_load(r["actor_name"]) if state == "RUNNING" else {}})
        engines[name.removeprefix("engine-")] = rows
    return engines


def fleet_status() -> dict:
    """The engines' replicas (id, node, pid, state, running, waiting), the gateway replicas and the URL."""
    details = _serve_details()
    app = (details.get("applications") or {}).get(APP_NAME)
    if app is None:
        return {"engines": [], "gateway_replicas": 0, "url": None}
    http = details.get("http_options") or {}
    gateway = app["deployments"].get(GATEWAY) or {}
    engines = [{"name": name, "replicas": [{"id": r["id"], "node": r["node"], "pid": r["pid"], "state": r["state"],
                                            "running": r["load"].get("running", 0),
                                            "waiting": r["load"].get("waiting", 0)} for r in rows]}
               for name, rows in engine_replicas(details).items()]
    return {"engines": engines,
            "gateway_replicas": sum(1 for r in gateway.get("replicas") or [] if r.get("state") == "RUNNING"),
            "url": f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"}


def shut_down() -> None:
    """Delete the application and stop Serve (its controller and proxies)."""
    serve.shutdown()
