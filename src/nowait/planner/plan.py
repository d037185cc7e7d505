"""Scenario in, plan out: per workload the route (the gateway's rule) and, for each engine, the fleet.

For each engine the planner (1) finds the smallest p99 target the engine can hold at all (one
request alone, batch 1), (2) picks the largest batch cap whose full-batch latency still fits the
target, and the next one up, (3) searches the fewest nodes whose simulated p99 holds the target at
the workload's arrival rate, never planning a fleet fuller than `simulation.max_utilization`, and
(4) prices the fleet by the cost identity, folding in the diffusion fallback. The engines are built
in `fleets`, steps (1)-(4) run in `engine_plan`; this module routes each workload and gathers the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from nowait.planner import cost
from nowait.planner.capacity import Request, make_requests, poisson_arrivals
from nowait.planner.engine_plan import EnginePlan, batched_ar_cost_per_mtok, fold_fallback, p99_all_answers, plan_engine
from nowait.planner.engines import ENGINES, request_seconds
from nowait.planner.fleets import EngineFleet, build_fleets, with_shared_prefix
from nowait.planner.profile import FittedStepTime, Profile, fit_profile
from nowait.planner.scenario import Scenario, Workload
from nowait.router import Decision, RouteRequest, route

REFERENCE_API_PRICES = (0.4, 1.0, 5.0, 15.0)  # mission.md: small API model < $1/Mtok, frontier output $5-15/Mtok


@dataclass(frozen=True)
class ApiQuote:
    name: str
    usd_per_mtok: float
    allowed: bool
    frontier: bool


@dataclass
class WorkloadPlan:
    workload: Workload
    decision: Decision
    engines: dict[str, EnginePlan]
    apis: list[ApiQuote]
    mean_input_tokens: float
    mean_output_tokens: float
    sensitivity_engine: str | None = None
    sensitivity: list[cost.SensitivityRow] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list, repr=False)
    # The engines as they serve this workload (its shared prefix restored by the AR engines).
    fleets: dict[str, EngineFleet] = field(default_factory=dict, repr=False)


@dataclass
class Plan:
    scenario: Scenario
    node_usd_per_hour: float
    fleets: dict[str, EngineFleet]
    workloads: list[WorkloadPlan]
    assumptions: list[str]
    profile: Profile | None = None
    fitted: dict[str, FittedStepTime] = field(default_factory=dict)


def sample_requests(workload: Workload, count: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(workload.rate_per_s, count, rng)
    return make_requests(arrivals, workload.input_tokens.sample(count, rng), workload.output_tokens.sample(count, rng))


def at_rate(requests: list[Request], multiplier: float) -> list[Request]:
    """The same requests arriving `multiplier` times as fast (still Poisson: a rescaled Poisson process)."""
    return [replace(r, arrival_s=r.arrival_s / multiplier) for r in requests]


def plan_workload(scenario: Scenario, fleets: dict[str, EngineFleet], workload: Workload,
                  fallback_rate: float) -> WorkloadPlan:
    fleets = with_shared_prefix(fleets, workload.shared_prefix_tokens)
    sim = scenario.simulation
    requests = sample_requests(workload, sim.requests, sim.seed)
    mean_in = float(np.mean([r.input_tokens for r in requests]))
    mean_out = float(np.mean([r.output_tokens for r in requests]))
    price = scenario.node_usd_per_hour
    decision = route(RouteRequest(batchable=workload.batchable, latency_budget_ms=workload.p99_latency_s * 1000,
                                  token_value_usd_per_mtok=workload.token_value_usd_per_mtok,
                                  data_class=workload.data_class), scenario.routing_policy())
    engines = {name: plan_engine(fleets[name], requests, workload.rate_per_s, workload.p99_latency_s, price,
                                 sim.max_utilization, sim.warmup_fraction,
                                 resample=lambda count: sample_requests(workload, count, sim.seed))
               for name in ENGINES}
    # The fallback re-run: decoded from scratch on AR, or (fallback: verify) the diffusion answer
    # checked as a draft by the same target.
    mode = scenario.engines.diffusion.fallback
    rerun = fleets["verify"] if mode == "verify" else fleets["ar"]
    ar_cost = batched_ar_cost_per_mtok(rerun, mean_in, mean_out, price, sim.max_utilization)
    ar_alone = request_seconds(rerun.make(1), 1, mean_in, mean_out)
    fold_fallback(engines["diffusion"], fallback_rate, ar_cost, ar_alone, mode, workload.p99_latency_s)
    apis = [ApiQuote(api.name, cost.api_usd_per_mtok(mean_in, mean_out, api.input_usd_per_mtok,
                                                     api.output_usd_per_mtok),
                     allowed=workload.data_class in api.data_classes, frontier=api.frontier)
            for api in scenario.apis]
    plan = WorkloadPlan(workload=workload, decision=decision, engines=engines, apis=apis,
                        mean_input_tokens=mean_in, mean_output_tokens=mean_out, requests=requests, fleets=fleets)
    owned = decision.engine if decision.engine in engines and engines[decision.engine].feasible else None
    if owned is None:
        feasible = [e for e in engines.values() if e.feasible]
        owned = min(feasible, key=lambda e: e.cost_per_mtok_usd).engine if feasible else None
    if owned is not None:
        chosen = engines[owned]
        node_prices = sorted({price, *(p for p in (scenario.node.committed_usd_per_hour,
                                                    scenario.node.on_demand_usd_per_hour) if p is not None),
                              round(price * 0.75, 2), round(price * 1.25, 2)})
        api_prices = sorted({round(q.usd_per_mtok, 2) for q in apis}) or list(REFERENCE_API_PRICES)
        surcharge = (chosen.fallback_rate, ar_cost) if owned == "diffusion" else (0.0, 0.0)
        plan.sensitivity_engine = owned
        plan.sensitivity = cost.sensitivity(node_prices, chosen.tokens_per_s_per_node, chosen.utilization,
                                            api_prices, *surcharge, fallback_priced_at=price)
    return plan


def assumptions(scenario: Scenario, profile: Profile | None) -> list[str]:
    e, s, d = scenario.efficiency, scenario.engines.spec, scenario.engines.diffusion
    lines = [
        f"Efficiencies: {e.compute:.0%} of peak FLOP/s, {e.memory:.0%} of peak memory bandwidth; "
        f"{e.collective_latency_us:g} us per all-reduce; {e.forward_overhead_ms:g} ms fixed overhead per forward; "
        f"{e.memory_reserved_fraction:.0%} of accelerator memory reserved (activations, runtime).",
        f"Speculative decoding: gamma {s.gamma}, acceptance rate {s.acceptance_rate:g}, "
        + (f"draft model {s.draft_model.spec.name}." if s.draft_model else
           f"a draft forward costs {s.draft_cost_ratio:g} of a target forward (EAGLE-style head)."),
        f"Diffusion: block width {d.block_width}, {d.tokens_per_forward:g} tokens committed per forward on average "
        f"(Fast-dLLM-style confidence-threshold decoding), cache mode '{d.cache}', {d.fallback_rate:.0%} of answers "
        f"below the confidence threshold ({scenario.routing.confidence_threshold:g}) re-run on AR and paid for.",
        f"Diffusion model: {(d.model or scenario.model).spec.name} shape"
        + (" (the same shape as the AR model: an owned diffusion LM of its class)." if d.model is None else "."),
        f"Capacity: at least {scenario.simulation.requests} simulated Poisson arrivals per fleet size, more "
        f"where requests live long (latencies over the steady state only: the first "
        f"{scenario.simulation.warmup_fraction:.0%} of the arrival span, and the first and last three median "
        f"latencies, discarded), no fleet planned above "
        f"{scenario.simulation.max_utilization:.0%} utilization; p99 is end to end (arrival to last token).",
    ]
    for w in scenario.workloads:
        if w.shared_prefix_tokens:
            lines.append(f"{w.name}: the first {w.shared_prefix_tokens} prompt tokens are shared and restored by the "
                         f"AR engines' prefix cache (the prefill computes the rest); the diffusion engine computes "
                         f"them.")
    if profile is not None:
        lines.append(f"Step times measured ({profile.model or 'model'} on {profile.hardware or 'hardware'}, "
                     f"{profile.measured_at or 'undated'}), replacing the roofline for the engines they cover.")
    return lines


def make_plan(scenario: Scenario, profile: Profile | None = None) -> Plan:
    fitted = fit_profile(profile) if profile is not None else {}
    fleets = build_fleets(scenario, fitted, profile)
    fallback_rate = scenario.engines.diffusion.fallback_rate
    if profile is not None and profile.engine_parameters.diffusion.fallback_rate is not None:
        fallback_rate = profile.engine_parameters.diffusion.fallback_rate
    workloads = [plan_workload(scenario, fleets, w, fallback_rate) for w in scenario.workloads]
    return Plan(scenario=scenario, node_usd_per_hour=scenario.node_usd_per_hour, fleets=fleets, workloads=workloads,
                assumptions=assumptions(scenario, profile), profile=profile, fitted=fitted)


def nodes_at_rates(plan: Plan, workload_plan: WorkloadPlan, multipliers: list[float]) -> dict[str, list[int | None]]:
    """Nodes per engine as the arrival rate scales (the same requests, arriving faster or slower)."""
    sim = plan.scenario.simulation
    result: dict[str, list[int | None]] = {name: [] for name in ENGINES}
    workload = workload_plan.workload
    for multiplier in multipliers:
        requests = at_rate(workload_plan.requests, multiplier)

        def resample(count: int, multiplier: float = multiplier) -> list[Request]:
            return at_rate(sample_requests(workload, count, sim.seed), multiplier)

        for name in ENGINES:
            engine = plan_engine(workload_plan.fleets[name], requests, workload.rate_per_s * multiplier,
                                 workload.p99_latency_s,
                                 plan.node_usd_per_hour, sim.max_utilization, sim.warmup_fraction, resample)
            result[name].append(engine.nodes)
    return result


def to_json(plan: Plan) -> dict:
    """The `--json` object: a `workloads` list, each with `name`, `route` and `engines` keyed ar, spec, diffusion."""
    def number(value: float | None, digits: int = 4) -> float | None:
        if value is None or not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")

    s = plan.scenario
    workloads = []
    for w in plan.workloads:
        engines = {}
        for name, e in w.engines.items():
            engines[name] = {
                "single_stream_tokens_per_s": number(e.single_stream_tokens_per_s),
                "tokens_per_s_per_node": number(e.tokens_per_s_per_node),
                "nodes": e.nodes,
                "p99_latency_s": number(e.p99_latency_s),
                "utilization": number(e.utilization, 3),
                "cost_per_mtok_usd": number(e.cost_per_mtok_usd),
                "batch": e.batch,
                "feasible": e.feasible,
                "min_p99_target_s": number(e.min_p99_target_s),
                "roofline_ceiling_tokens_per_s": number(e.roofline_ceiling_tokens_per_s),
                "fallback_rate": e.fallback_rate if name == "diffusion" else None,
                "fallback_latency_s": number(e.fallback_latency_s) if name == "diffusion" else None,
                "fallback_mode": e.fallback_mode if name == "diffusion" else None,
                "p99_all_answers_s": number(p99_all_answers(e)) if name == "diffusion" else None,
                "simulated_arrivals": e.simulated_arrivals or None,
                "note": e.note,
            }
        workloads.append({
            "name": w.workload.name,
            "route": w.decision.engine,
            "reason": w.decision.reason,
            "fallback": w.decision.fallback_engine,
            "arrival_rate_per_s": number(w.workload.rate_per_s),
            "p99_target_s": w.workload.p99_latency_s,
            "mean_input_tokens": number(w.mean_input_tokens),
            "shared_prefix_tokens": w.workload.shared_prefix_tokens,
            "mean_output_tokens": number(w.mean_output_tokens),
            "engines": engines,
            "apis": [{"name": q.name, "cost_per_mtok_usd": number(q.usd_per_mtok), "allowed": q.allowed}
                     for q in w.apis],
        })
    return {
        "scenario": s.name,
        "node": {"name": s.node.name, "accelerator": s.accelerator.name, "accelerators": s.node.accelerators,
                 "usd_per_hour": plan.node_usd_per_hour},
        "model": {"name": s.model.spec.name, "parameters": s.model.spec.parameters(), "dtype": s.dtype,
                  "tensor_parallel": s.tensor_parallel},
        "workloads": workloads,
        "assumptions": plan.assumptions,
    }
