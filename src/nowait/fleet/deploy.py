"""A config as a Ray Serve application, and the fleet's life: deploy, status, shut down.

    fleet_application(config)   the gateway ingress bound to one deployment per owned engine
    deploy(config)              serve it on the Ray cluster this process is connected to
    fleet_status()              {"engines": [{name, replicas: [...]}], "gateway_replicas", "url", "urls"}
    shut_down()                 delete the application and stop Serve

The local cluster `nowait fleet up` starts when `fleet.ray_address` is unset lives in cluster.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from nowait.engines.config import DiffusionEngineConfig, FleetEngineConfig, OwnedEngineSpec, RemoteEngineConfig
from nowait.fleet.ingress import GatewayIngress, colocated_engine_names, colocated_resources
from nowait.fleet.replica import EngineReplica
from nowait.fleet.router import NowaitRequestRouter
from nowait.gateway.config import GatewayConfig

log = logging.getLogger("nowait.fleet")

APP_NAME = "nowait"
GATEWAY = "gateway"
ROUTING_STATS_PERIOD_S = 0.5  # how stale a replica's reported load may be when the router reads it
# Ray Serve's switch for direct ingress, read when a Serve process starts (its controller, a replica).
DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
DIRECT_INGRESS_TUNING = "RAY_SERVE_DIRECT_INGRESS_"  # its port range, drain period: passed on as set here
# Ray Serve's documented switch for "high throughput" Serve, read when each Serve process starts:
# direct ingress, gRPC between deployments (not actor calls), user code and the handle's router on
# the replica's own event loop, buffered request logs, a frozen GC after start-up.
THROUGHPUT_OPTIMIZED = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class DirectIngressError(RuntimeError):
    """Direct ingress asked for, but the cluster's Serve runs without it."""


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


def engine_replica_threads(config: GatewayConfig, spec: OwnedEngineSpec) -> int:
    """torch threads of one engine replica: `server.torch_threads`, or its CPUs less
    `server.reserved_cores` (at least one). The replica's event loop takes the gateway's calls and
    sends the engine's tokens back; at Ray's OMP_NUM_THREADS (all its CPUs) each split operation
    waited for it (docs/fleet.md, "Threads of an engine replica")."""
    fleet = spec.fleet or FleetEngineConfig()
    return config.engine_threads(int(fleet.cpus_per_replica), engines=1)


def direct_ingress_env(config: GatewayConfig) -> dict[str, str] | None:
    """`fleet.direct_ingress` (or `fleet.throughput_optimized`, which includes it): the environment
    Ray Serve's controller and the gateway replicas get (through their `runtime_env`, so the
    cluster itself needs no restart); None without either."""
    if not (config.fleet.direct_ingress or config.fleet.throughput_optimized):
        return None
    tuning = {k: v for k, v in os.environ.items() if k.startswith(DIRECT_INGRESS_TUNING)}
    return {**tuning, DIRECT_INGRESS: "1", **engine_env(config)}


def engine_env(config: GatewayConfig) -> dict[str, str]:
    """`fleet.throughput_optimized`: the switch every Serve process of the application gets (the
    engine replicas too: they answer the gateway's calls over gRPC and run their code on their own
    event loop); {} without it."""
    return {THROUGHPUT_OPTIMIZED: "1"} if config.fleet.throughput_optimized else {}


def fleet_application(config: GatewayConfig) -> serve.Application:
    """The gateway ingress bound to one deployment per owned engine placed on replicas (remote
    upstreams and the engines with `fleet.placement: gateway` run in it)."""
    engines, engine_switches, colocated = {}, engine_env(config), colocated_engine_names(config)
    for name, spec in config.engines.items():
        if isinstance(spec, RemoteEngineConfig) or name in colocated:
            continue
        options = engine_options(spec)
        if engine_switches:
            options["ray_actor_options"]["runtime_env"] = {"env_vars": engine_switches}
        deployment = serve.deployment(EngineReplica, name=engine_deployment_name(name), **options)
        engines[name] = deployment.bind(name, spec, config.metrics_window_s, config.defaults.max_tokens,
                                        engine_replica_threads(config, spec))
    cpus, gpus = colocated_resources(config)
    actor_options: dict = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {})}
    env = direct_ingress_env(config)
    if env is not None:
        actor_options["runtime_env"] = {"env_vars": env}
    gateway = serve.deployment(GatewayIngress, name=GATEWAY, num_replicas=gateway_replicas(config),
                               ray_actor_options=actor_options, max_ongoing_requests=1000,
                               graceful_shutdown_timeout_s=config.server.shutdown_grace_s)
    return gateway.bind(config, engines)


def url_of(config: GatewayConfig) -> str:
    return f"http://{config.fleet.host}:{config.fleet.port}"


def deploy(config: GatewayConfig) -> str:
    """Serve `config` on the connected Ray cluster; returns once every replica is up (its URL:
    with `fleet.direct_ingress`, the first gateway replica's own)."""
    env = direct_ingress_env(config)
    controller = None if env is None else {"runtime_env": {"env_vars": env}}
    serve.start(http_options={"host": config.fleet.host, "port": config.fleet.port}, controller_options=controller)
    serve.run(fleet_application(config), name=APP_NAME, route_prefix="/", blocking=False)
    if env is None:
        return url_of(config)
    urls, deadline = direct_urls(_serve_details()), time.monotonic() + 10
    while not urls and time.monotonic() < deadline:  # the controller may list a new port on a later tick
        time.sleep(0.5)
        urls = direct_urls(_serve_details())
    if not urls:  # Serve's options apply when its controller starts; one already running keeps its own
        serve.delete(APP_NAME)
        raise DirectIngressError("fleet.direct_ingress is set but Serve on this cluster already runs without "
                                 "direct ingress (`serve shutdown` on the cluster, then `nowait fleet up` again)")
    return urls[0]


def direct_urls(details: dict) -> list[str]:
    """Each gateway replica's own URL when Serve runs with direct ingress (Ray's target groups for
    the application's ingress, not the proxy's); [] without it."""
    host = (details.get("http_options") or {}).get("host", "127.0.0.1")
    urls = []
    for group in details.get("target_groups") or []:
        group = group if isinstance(group, dict) else group.model_dump()
        if (group.get("app_name") == APP_NAME and group.get("ingress_deployment_name") == GATEWAY
                and str(getattr(group.get("protocol"), "value", group.get("protocol"))) == "HTTP"):
            # A replica listens on the proxy's host: a wildcard is reached at its node's address.
            urls += [f"http://{t['ip'] if host in WILDCARD_HOSTS else host}:{t['port']}" for t in group["targets"]]
    return sorted(urls)


def _replica_load(actor_name: str) -> dict:
    try:
        actor = ray.get_actor(actor_name, namespace="serve")
        return ray.get(actor.record_routing_stats.remote(), timeout=5) or {}
    except Exception:  # starting, stopping, or gone: no load to report
        return {}


def _serve_details() -> dict:
    from ray.serve.context import _get_global_client  # the controller's details (what Ray's dashboard shows)

    return _get_global_client().get_serve_details()


def _replica_rows(deployment: dict) -> list[dict]:
    """A deployment's replicas: id, actor, node, pid, state and, for a running one, its load report."""
    rows = []
    for r in deployment.get("replicas") or []:
        state = str(getattr(r.get("state"), "value", r.get("state")))  # RUNNING, STARTING, ...
        rows.append({"id": r["replica_id"], "actor_name": r["actor_name"], "node": r.get("node_id"),
                     "pid": r.get("pid"), "state": state,
                     "load": _replica_load(r["actor_name"]) if state == "RUNNING" else {}})
    return rows


def colocated_replicas(gateway_rows: list[dict]) -> dict[str, list[dict]]:
    """The engines with `placement: gateway`: one row per gateway replica, its load from the
    replica's report of its own engines by name (`GatewayIngress.record_routing_stats`)."""
    engines: dict[str, list[dict]] = {}
    for row in gateway_rows:
        for engine, load in row["load"].items():
            engines.setdefault(engine, []).append({**row, "load": load, "placement": "gateway"})
    return engines


def engine_replicas(details: dict | None = None) -> dict[str, list[dict]]:
    """Each engine's replicas: id, actor, node, pid, state and, for a running one, its full load
    report (`EngineReplica.load`); an engine placed in the gateway has the gateway's replicas."""
    details = details or _serve_details()
    app = (details.get("applications") or {}).get(APP_NAME) or {"deployments": {}}
    engines = {}
    for name, deployment in app["deployments"].items():
        if name == GATEWAY:
            engines.update(colocated_replicas(_replica_rows(deployment)))
        else:
            engines[name.removeprefix("engine-")] = _replica_rows(deployment)
    return engines


def fleet_status() -> dict:
    """The engines' replicas (id, node, pid, state, running, waiting, niceness), the gateway replicas and the
    URLs clients use: the proxy's, or with direct ingress each gateway replica's (`url` the first)."""
    details = _serve_details()
    app = (details.get("applications") or {}).get(APP_NAME)
    if app is None:
        return {"engines": [], "gateway_replicas": 0, "url": None, "urls": []}
    http = details.get("http_options") or {}
    gateway = app["deployments"].get(GATEWAY) or {}
    engines = [{"name": name, "placement": rows[0].get("placement", "replicas") if rows else "replicas",
                "replicas": [{"id": r["id"], "node": r["node"], "pid": r["pid"], "state": r["state"],
                              "running": r["load"].get("running", 0), "waiting": r["load"].get("waiting", 0),
                              "niceness": r["load"].get("niceness")}
                             for r in rows]}
               for name, rows in engine_replicas(details).items()]
    urls = direct_urls(details) or [f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"]
    return {"engines": engines,
            "gateway_replicas": sum(1 for r in gateway.get("replicas") or [] if r.get("state") == "RUNNING"),
            "url": urls[0], "urls": urls}


def shut_down() -> None:
    """Delete the application and stop Serve (its controller and proxies)."""
    from ray.serve.exceptions import RayServeException

    # Waits (up to 60 s) for the replicas to stop: a direct-ingress gateway replica drains for 30 s
    # first, longer than serve.shutdown waits for its controller. No Serve on the cluster: nothing to delete.
    with contextlib.suppress(RayServeException):
        serve.delete(APP_NAME)
    serve.shutdown()
