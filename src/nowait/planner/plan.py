"""Scenario in, plan out: per workload the route (the gateway's rule) and, for each engine, the fleet.

For each engine the planner (1) finds the smallest p99 target the engine can hold at all (one
request alone, batch 1), (2) picks the largest batch cap whose full-batch latency still fits the
target, and the next one up, (3) searches the fewest nodes whose simulated p99 holds the target at
the workload's arrival rate, never planning a fleet fuller than `simulation.max_utilization`, and
(4) prices the fleet by the cost identity, folding in the diffusion fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from nowait.planner import cost
from nowait.planner.capacity import FleetSearch, Request, SimulationResult, make_requests, poisson_arrivals, simulate
from nowait.planner.capacity import smallest_fleet as search_fleet
from nowait.planner.engines import (
    ENGINES,
    AutoregressiveServing,
    DiffusionServing,
    ServingModel,
    SpeculativeServing,
    request_seconds,
    single_stream_tokens_per_s,
)
from nowait.planner.engines import replica_tokens_per_s as replica_throughput
from nowait.planner.profile import FittedStepTime, Profile, fit_profile
from nowait.planner.roofline import Deployment, ForwardTimer, RooflineTimer, ScaledTimer, check_fits
from nowait.planner.scenario import Scenario, ScenarioError, Workload
from nowait.router import Decision, RouteRequest, route

REFERENCE_API_PRICES = (0.4, 1.0, 5.0, 15.0)  # mission.md: small API model < $1/Mtok, frontier output $5-15/Mtok


@dataclass(frozen=True)
class EngineFleet:
    """How to build one engine at a given batch cap, with its roofline-ideal twin for the ceiling."""

    name: str
    make: Callable[[int], ServingModel]
    make_ideal: Callable[[int], ServingModel]
    replicas_per_node: int
    max_batch: int
    deployment: Deployment


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


# --- building the engines --------------------------------------------------------------------------------


def _deployment(scenario: Scenario, model_ref, field_name: str) -> Deployment:
    deployment = Deployment(model=model_ref.spec, accelerator=scenario.accelerator, node=scenario.node,
                            dtype=scenario.dtype, tensor_parallel=scenario.tensor_parallel,
                            efficiency=scenario.efficiency.to_efficiency())
    problem = check_fits(deployment)
    if problem:
        raise ScenarioError(f"{field_name}: {problem}: raise tensor_parallel, use a smaller dtype or a larger node")
    return deployment


def build_fleets(scenario: Scenario, fitted: dict[str, FittedStepTime] | None = None,
                 profile: Profile | None = None) -> dict[str, EngineFleet]:
    """The three owned engines, timed by the roofline or, where the profile has them, by measurements."""
    fitted = fitted or {}
    settings = scenario.engines
    target = _deployment(scenario, scenario.model, "model")
    diffusion_model = settings.diffusion.model or scenario.model
    diffusion = _deployment(scenario, diffusion_model, "engines.diffusion.model")
    draft = (_deployment(scenario, settings.spec.draft_model, "engines.spec.draft_model")
             if settings.spec.draft_model else None)

    def timer(name: str, deployment: Deployment) -> ForwardTimer:
        return fitted.get(name) or RooflineTimer(deployment)

    def draft_timer(target_timer: ForwardTimer, ideal: bool) -> ForwardTimer:
        if draft is not None:
            return RooflineTimer(draft.ideal()) if ideal else timer("draft", draft)
        if "draft" in fitted and not ideal:
            return fitted["draft"]
        return ScaledTimer(target_timer, settings.spec.draft_cost_ratio)

    spec_parameters = settings.spec.model_copy()
    diffusion_parameters = settings.diffusion.model_copy()
    if profile is not None:  # measured engine parameters win over the scenario's assumptions
        measured = profile.engine_parameters
        for key in ("acceptance_rate", "gamma"):
            if getattr(measured.spec, key) is not None:
                setattr(spec_parameters, key, getattr(measured.spec, key))
        for key in ("tokens_per_forward", "fallback_rate"):
            if getattr(measured.diffusion, key) is not None:
                setattr(diffusion_parameters, key, getattr(measured.diffusion, key))

    target_budget = target.kv_token_budget()
    spec_budget = target_budget
    if draft is not None:  # both models share the replica's memory
        free = target.usable_memory_bytes() - target.model.weight_bytes(target.dtype_bytes) \
            - draft.model.weight_bytes(draft.dtype_bytes)
        spec_budget = free / (target.model.kv_bytes_per_token(target.dtype_bytes)
                              + draft.model.kv_bytes_per_token(draft.dtype_bytes))
    diffusion_budget = diffusion.kv_token_budget()

    def ar(cap: int, ideal: bool = False) -> ServingModel:
        t = RooflineTimer(target.ideal()) if ideal else timer("ar", target)
        return AutoregressiveServing(target=t, max_batch=cap, kv_token_budget=target_budget)

    def spec(cap: int, ideal: bool = False) -> ServingModel:
        t = RooflineTimer(target.ideal()) if ideal else timer("ar", target)
        return SpeculativeServing(target=t, draft=draft_timer(t, ideal), gamma=spec_parameters.gamma,
                                  acceptance_rate=spec_parameters.acceptance_rate, max_batch=cap,
                                  kv_token_budget=spec_budget)

    def diff(cap: int, ideal: bool = False) -> ServingModel:
        t = RooflineTimer(diffusion.ideal()) if ideal else timer("diffusion", diffusion)
        p = diffusion_parameters
        return DiffusionServing(model=t, block_width=p.block_width, tokens_per_forward=p.tokens_per_forward,
                                cache=p.cache, max_batch=cap, kv_token_budget=diffusion_budget)

    def verify(cap: int, ideal: bool = False) -> ServingModel:
        # A fallback that verifies the doubted diffusion answer: a speculative target whose draft
        # is free (the answer exists already), checking verify_gamma tokens per forward.
        t = RooflineTimer(target.ideal()) if ideal else timer("ar", target)
        p = diffusion_parameters
        return SpeculativeServing(target=t, draft=ScaledTimer(t, 0.0), gamma=p.verify_gamma,
                                  acceptance_rate=p.verify_acceptance, max_batch=cap, kv_token_budget=target_budget,
                                  name="verify")

    builders = {"ar": (ar, target, settings.ar.max_batch), "spec": (spec, target, spec_parameters.max_batch),
                "diffusion": (diff, diffusion, diffusion_parameters.max_batch),
                "verify": (verify, target, settings.ar.max_batch)}
    return {name: EngineFleet(name=name, make=build, make_ideal=lambda cap, build=build: build(cap, True),
                              replicas_per_node=deployment.replicas_per_node, max_batch=max_batch,
                              deployment=deployment)
            for name, (build, deployment, max_batch) in builders.items()}


# --- planning one engine for one workload ----------------------------------------------------------------


def sample_requests(workload: Workload, count: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(workload.rate_per_s, count, rng)
    return make_requests(arrivals, workload.input_tokens.sample(count, rng), workload.output_tokens.sample(count, rng))


def at_rate(requests: list[Request], multiplier: float) -> list[Request]:
    """The same requests arriving `multiplier` times as fast (still Poisson: a rescaled Poisson process)."""
    return [replace(r, arrival_s=r.arrival_s / multiplier) for r in requests]


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


# --- the whole scenario ----------------------------------------------------------------------------------


def with_shared_prefix(fleets: dict[str, EngineFleet], tokens: float) -> dict[str, EngineFleet]:
    """The fleets as they serve a workload whose prompts share their first `tokens`: the AR
    engines (ar, spec, and the verify re-run on the same target) restore them from the prefix
    cache; the diffusion engine reads its prompt both ways and has no prefix to share."""
    if not tokens:
        return fleets

    def sharing(build: Callable[[int], ServingModel]) -> Callable[[int], ServingModel]:
        return lambda cap: replace(build(cap), shared_prefix_tokens=tokens)

    return {name: replace(fleet, make=sharing(fleet.make), make_ideal=sharing(fleet.make_ideal))
            if name in ("ar", "spec", "verify") else fleet for name, fleet in fleets.items()}


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
