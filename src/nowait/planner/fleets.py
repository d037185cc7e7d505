"""The owned engines as serving models at any batch cap: timed by the roofline or by a measured
profile, with the KV-cache budget of the replica they share (`build_fleets`), and as they serve a
workload whose prompts share a prefix (`with_shared_prefix`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from nowait.planner.engines import AutoregressiveServing, DiffusionServing, ServingModel, SpeculativeServing
from nowait.planner.profile import FittedStepTime, Profile
from nowait.planner.roofline import Deployment, ForwardTimer, RooflineTimer, ScaledTimer, check_fits
from nowait.planner.scenario import Scenario, ScenarioError


@dataclass(frozen=True)
class EngineFleet:
    """How to build one engine at a given batch cap, with its roofline-ideal twin for the ceiling."""

    name: str
    make: Callable[[int], ServingModel]
    make_ideal: Callable[[int], ServingModel]
    replicas_per_node: int
    max_batch: int
    deployment: Deployment


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
