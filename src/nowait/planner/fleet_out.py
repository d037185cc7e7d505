"""`nowait plan PLAN.yaml --fleet-out fleet.yaml`: the plan's answer as the engines' `fleet`
sections of a gateway config, so `nowait fleet up` deploys what the planner sized (docs/fleet.md).

For each engine some workload routes to (or falls back to): replicas = the nodes the plan gives it,
summed over those workloads, times its replicas per node; GPUs per replica = the tensor-parallel
group; target ongoing requests = the largest planned batch cap (the batch its p99 was simulated
at). The engine's `max_num_seqs` (or `max_batch`) is that cap too. `model` is left for the
operator: the scenario names a model family, not a checkpoint path.
"""

from __future__ import annotations

from nowait.planner.plan import Plan


def planned_engines(plan: Plan) -> dict[str, dict]:
    """engine -> {nodes, replicas_per_node, batch} over the workloads it serves in the plan."""
    engines: dict[str, dict] = {}
    for w in plan.workloads:
        for name in filter(None, (w.decision.engine, w.decision.fallback_engine)):
            e = w.engines.get(name)
            if e is None or not e.feasible or e.nodes is None:
                continue  # a remote API, or an engine that cannot hold the target
            entry = engines.setdefault(name, {"nodes": 0, "replicas_per_node": e.replicas_per_node, "batch": 1})
            entry["nodes"] += e.nodes
            entry["batch"] = max(entry["batch"], e.batch)
    return engines


def fleet_config(plan: Plan, command: str) -> tuple[dict, str]:
    """(the config mapping, its header comment) for --fleet-out."""
    tensor_parallel = plan.scenario.tensor_parallel
    engines = {}
    for name, e in planned_engines(plan).items():
        replicas = e["nodes"] * e["replicas_per_node"]
        capacity = "max_batch" if name == "diffusion" else "max_num_seqs"
        engines[name] = {"kind": name, capacity: e["batch"], "device": "cuda",
                         "fleet": {"replicas": {"min": replicas, "max": replicas},
                                   "gpus_per_replica": tensor_parallel, "cpus_per_replica": 1,
                                   "target_ongoing_requests": e["batch"]}}
    config: dict = {"engines": engines, "fleet": {"gateway_replicas": 2}}
    if "diffusion" not in engines:
        config["routing"] = {"fast_engine": None}
    s = plan.scenario
    header = (f"# {command}\n# scenario {s.name}: {s.node.name} nodes ({s.node.accelerators} x {s.accelerator.name}), "
              f"{s.model.spec.name}. Set each engine's `model` to its checkpoint, and store.url to PostgreSQL\n"
              f"# (two gateway replicas share batches and keys through it); then `nowait fleet up`.\n")
    return config, header
