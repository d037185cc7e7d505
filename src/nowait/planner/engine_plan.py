"""One engine for one workload: the cheapest fleet that holds the p99 target (`plan_engine`), and
the diffusion fallback's re-runs folded into the diffusion plan's cost and latency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nowait.planner import cost
from nowait.planner.capacity import FleetSearch, Request, SimulationResult, simulate
from nowait.planner.capacity import smallest_fleet as search_fleet
from nowait.planner.engines import ServingModel, request_seconds, single_stream_tokens_per_s
from nowait.planner.engines import replica_tokens_per_s as replica_throughput
from nowait.planner.fleets import EngineFleet


@dataclass
class EnginePlan:
    engine: str
    feasible: bool
    batch: int
    nodes: int | None
    replicas_per_node: int
    single_stream_tokens_per_s: float
    roofline_ceiling_tokens_per_s: float
    tokens_per_s_per_node: float
    p50_latency_s: float | None
    p99_latency_s: float
    min_p99_target_s: float
    utilization: float | None
    cost_per_mtok_usd: float | None
    own_cost_per_mtok_usd: float | None = None
    cost_per_request_usd: float | None = None
    fallback_rate: float = 0.0
    fallback_latency_s: float | None = None
    fallback_mode: str = "decode"  # how a re-run works: decode on AR, or verify the answer as a draft
    note: str = ""
    simulated_arrivals: int = 0  # of the run that found the fleet: at least simulation.requests


def batch_ladder(max_batch: int, kv_cap: int) -> list[int]:
    top = max(1, min(max_batch, kv_cap))
    ladder = [b for b in (2**k for k in range(0, 20)) if b < top]
    return [*ladder, top]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


MAX_SIMULATED_ARRIVALS = 200_000


def plan_engine(fleet: EngineFleet, requests: list[Request], arrival_rate_per_s: float, target_p99_s: float,
                node_usd_per_hour: float, max_utilization: float, warmup_fraction: float,
                resample: Callable[[int], list[Request]] | None = None) -> EnginePlan:
    """The cheapest fleet of this engine that holds the p99 target. `resample(count)`: the same
    workload with more arrivals, asked for when the run that found the fleet was too short for
    its requests' lifetimes (`SimulationResult.steady`): four times as many, up to
    MAX_SIMULATED_ARRIVALS, and the search runs again."""
    inputs = [r.input_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    mean_in, mean_out = float(np.mean(inputs)), float(np.mean(outputs))
    offered_tokens_per_s = arrival_rate_per_s * mean_out
    alone = fleet.make(1)
    single = single_stream_tokens_per_s(alone, mean_in, mean_out)
    ceiling = single_stream_tokens_per_s(fleet.make_ideal(1), mean_in, mean_out)
    floor = _percentile([request_seconds(alone, 1, r.input_tokens, r.output_tokens) for r in requests], 99)

    def node_tokens_per_s(serving: ServingModel, cap: int) -> float:
        return fleet.replicas_per_node * replica_throughput(serving, cap, mean_in, mean_out)

    if floor > target_p99_s:
        return EnginePlan(
            engine=fleet.name, feasible=False, batch=1, nodes=None, replicas_per_node=fleet.replicas_per_node,
            single_stream_tokens_per_s=single, roofline_ceiling_tokens_per_s=ceiling,
            tokens_per_s_per_node=node_tokens_per_s(alone, 1), p50_latency_s=None, p99_latency_s=floor,
            min_p99_target_s=floor, utilization=None, cost_per_mtok_usd=None,
            note=f"infeasible: even alone a request's p99 is {floor:.2f} s > the {target_p99_s:g} s target",
        )

    kv_cap = int(alone.kv_token_budget // max(alone.kv_tokens(mean_in, mean_out), 1)) \
        if math.isfinite(alone.kv_token_budget) else fleet.max_batch
    ladder = batch_ladder(fleet.max_batch, kv_cap)
    in99, out99 = _percentile(inputs, 99), _percentile(outputs, 99)
    holding = [cap for cap in ladder if request_seconds(fleet.make(cap), cap, in99, out99) <= target_p99_s]
    largest = holding[-1] if holding else 1
    candidates = [cap for cap in ladder if cap >= largest][:2]

    best: tuple[int, int, FleetSearch, float] | None = None  # (nodes, cap, search, node tokens/s)
    for cap in candidates:
        serving = fleet.make(cap)
        throughput = node_tokens_per_s(serving, cap)
        lower = math.ceil(offered_tokens_per_s / (max_utilization * throughput) - 1e-9)

        def run(nodes: int, serving: ServingModel = serving) -> SimulationResult:
            return simulate(serving, nodes * fleet.replicas_per_node, requests, warmup_fraction)

        found = search_fleet(run, target_p99_s, lower, limit=lower * 32 + 64)
        if found.nodes is None:
            continue
        key = (found.nodes, found.result.p99_latency_s)
        if best is None or key < (best[0], best[2].result.p99_latency_s):
            best = (found.nodes, cap, found, throughput)
    if best is None:
        return EnginePlan(
            engine=fleet.name, feasible=False, batch=1, nodes=None, replicas_per_node=fleet.replicas_per_node,
            single_stream_tokens_per_s=single, roofline_ceiling_tokens_per_s=ceiling,
            tokens_per_s_per_node=node_tokens_per_s(alone, 1), p50_latency_s=None, p99_latency_s=floor,
            min_p99_target_s=floor, utilization=None, cost_per_mtok_usd=None,
            note="infeasible: no fleet within the search limit holds the target under queueing",
        )
    nodes, cap, found, throughput = best
    if not found.result.steady and resample is not None and len(requests) < MAX_SIMULATED_ARRIVALS:
        longer = resample(min(MAX_SIMULATED_ARRIVALS, 4 * len(requests)))
        return plan_engine(fleet, longer, arrival_rate_per_s, target_p99_s, node_usd_per_hour, max_utilization,
                           warmup_fraction, resample)
    used = cost.utilization(offered_tokens_per_s, nodes, throughput)
    per_mtok = cost.cost_per_mtok(node_usd_per_hour, throughput, used)
    return EnginePlan(
        engine=fleet.name, feasible=True, batch=cap, nodes=nodes, replicas_per_node=fleet.replicas_per_node,
        single_stream_tokens_per_s=single, roofline_ceiling_tokens_per_s=ceiling, tokens_per_s_per_node=throughput,
        p50_latency_s=found.result.p50_latency_s, p99_latency_s=found.result.p99_latency_s, min_p99_target_s=floor,
        utilization=used, cost_per_mtok_usd=per_mtok, own_cost_per_mtok_usd=per_mtok,
        cost_per_request_usd=per_mtok * mean_out / 1e6, simulated_arrivals=len(requests),
        note="" if found.result.steady else "the simulation stayed short of steady state at the arrival cap: "
                                            "p99 may be optimistic",
    )


def batched_ar_cost_per_mtok(fleet: EngineFleet, mean_in: float, mean_out: float, node_usd_per_hour: float,
                             max_utilization: float) -> float:
    """AR at its largest batch, as full as the plan allows: what a re-run on AR costs per Mtok."""
    alone = fleet.make(1)
    kv_cap = int(alone.kv_token_budget // max(alone.kv_tokens(mean_in, mean_out), 1)) \
        if math.isfinite(alone.kv_token_budget) else fleet.max_batch
    cap = batch_ladder(fleet.max_batch, kv_cap)[-1]
    throughput = fleet.replicas_per_node * replica_throughput(fleet.make(cap), cap, mean_in, mean_out)
    return cost.cost_per_mtok(node_usd_per_hour, throughput, max_utilization)


def p99_all_answers(diffusion: EnginePlan) -> float | None:
    """The p99 over every answer, re-runs included: once more than 1% of answers fall back, the
    slowest 1% are re-runs, so it is the re-run's latency (`p99_latency_s` covers the diffusion
    answers that stand, which is what the fleet is sized for)."""
    if diffusion.fallback_latency_s is not None and diffusion.fallback_rate > 0.01:
        return diffusion.fallback_latency_s
    return diffusion.p99_latency_s


def fold_fallback(diffusion: EnginePlan, fallback_rate: float, ar_usd_per_mtok: float, ar_seconds: float,
                  mode: str = "decode", target_p99_s: float | None = None) -> None:
    diffusion.fallback_rate = fallback_rate
    diffusion.fallback_mode = mode
    if not diffusion.feasible or diffusion.own_cost_per_mtok_usd is None:
        return
    own = diffusion.own_cost_per_mtok_usd
    diffusion.cost_per_mtok_usd = cost.with_fallback(own, fallback_rate, ar_usd_per_mtok)
    if own > 0:  # a free node (price 0) has no own cost to scale: its per-request cost stays as planned
        diffusion.cost_per_request_usd = diffusion.cost_per_mtok_usd * (diffusion.cost_per_request_usd or 0) / own
    diffusion.fallback_latency_s = diffusion.p99_latency_s + ar_seconds
    everything = p99_all_answers(diffusion)
    if target_p99_s is not None and everything is not None and everything > target_p99_s:
        note = (f"p99 over all answers, re-runs included, is {everything:.3g} s > the {target_p99_s:g} s target: "
                f"{fallback_rate:.0%} of answers are re-run")
        diffusion.note = f"{diffusion.note}; {note}" if diffusion.note else note

