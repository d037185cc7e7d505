"""`nowait eval --engine routed`: the real-time route as the gateway serves it, on held-out documents.

Each document is one real-time request, answered one at a time as a lone request is:

    the fast engine (diffusion, the config's engine: the fast default unless the config sets options)
    -> the gateway's fallback rule (gateway.dispatch.fallback_cause: no confidence, a confidence
       below the request's threshold (router.threshold_for: its schema's, its kind's, else the
       global one, from the config or the calibration file beside the fast engine's model), or
       JSON not valid for the requested format)
    -> the fallback engine (AR) re-runs it; both runs are paid for
    -> the answer kept is flagged low-confidence if below its engine's floor (router.below_floor)

Beside the accuracy, `low_confidence` says how well the floors catch wrong answers (flag_rates):
recall and false flags of each engine's own answers and of the answers as returned, at the
configured floors and over a sweep, from the confidences the route already decoded.

The request asks for JSON as a client would: the kind's JSON Schema with `structured` (the
diffusion engine fills the schema's template, AR decodes under its grammar), else any JSON
object (`json_object`: diffusion decodes free-form and the answer must parse). A document's
latency is the fast engine's time plus the fallback's; its cost is each engine's busy seconds at
its node's price (gateway.ledger.owned_cost_usd, as the gateway's ledger charges them).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nowait.engines.base import Completion, GenerationRequest, SamplingParams
from nowait.engines.factory import ModelCache, OwnedEngine, build_engine
from nowait.evaluation import (
    ANSWER_WINDOW,
    TEMPLATE_MAX_TOKENS,
    describe_decoding,
    scored_summary,
)
from nowait.extraction.corpus import Document, documents, schema_for
from nowait.extraction.scorer import score_document
from nowait.flag_rates import GOAL, floor_report, routed_report, sweep_floors
from nowait.gateway.config import GatewayConfig
from nowait.gateway.dispatch import fallback_cause
from nowait.gateway.domain import Attempt
from nowait.gateway.ledger import owned_cost_usd
from nowait.gateway.prompts import ANY_OBJECT
from nowait.router import RoutingPolicy, below_floor, confidence_floor, threshold_for
from nowait.tokenizer import TextCodec, document_prompt


@dataclass(frozen=True)
class RoutedEngine:
    """One engine of the route: its name in the config, the engine, its node's price."""

    name: str
    engine: OwnedEngine
    node_usd_per_hour: float
    kind: str


@dataclass(frozen=True)
class RoutedAnswer:
    """One document as the route answered it."""

    text: str  # the answer kept
    engine: str  # the engine that produced it
    fallback_cause: str | None  # None: kept on the fast engine
    fast_text: str  # the fast engine's own answer
    fast_confidence: float | None
    confidence: float | None  # the kept answer's
    threshold_source: str  # where the threshold came from: schema, kind ..., global
    latency_s: float  # fast engine's time plus the fallback's
    busy_s: dict[str, float] = field(default_factory=dict)  # engine -> seconds it worked on this document
    cost_usd: float = 0.0
    forwards: int = 0
    tokens: int = 0  # answer tokens both runs decoded (their forwards are `forwards`)
    low_confidence: bool = False  # the kept answer is below its engine's confidence floor


def _request(prompt: list[int], schema: dict | None, max_tokens: int, request_id: str,
             draft_ids: list[int] | None = None) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens), schema=schema, request_id=request_id,
                             draft_ids=draft_ids)


def _run(engine: RoutedEngine, request: GenerationRequest) -> Completion:
    [completion] = engine.engine.generate([request])
    return completion


def answer_document(doc: Document, codec: TextCodec, fast: RoutedEngine, fallback: RoutedEngine,
                    policy: RoutingPolicy, structured: bool) -> RoutedAnswer:
    """One real-time request through the route (module docstring)."""
    schema = schema_for(doc.kind) if structured else ANY_OBJECT
    prompt = codec.encode(document_prompt(doc))
    # The diffusion engine fills a kind's template; "any object" has none, so it decodes free-form
    # (gateway/owned.py does the same).
    first = _run(fast, _request(prompt, schema if structured else None,
                                TEMPLATE_MAX_TOKENS if structured else ANSWER_WINDOW, doc.doc_id))
    cause = fallback_cause(Attempt(engine=fast.name, text=first.text, confidence=first.confidence),
                           schema, True, policy)
    runs = [(fast, first)]
    if cause is not None:
        # A speculative fallback verifies the answer it replaces, as the gateway's re-run does.
        draft = codec.encode(first.text) if fallback.kind == "spec" and first.text else None
        runs.append((fallback, _run(fallback, _request(prompt, schema, ANSWER_WINDOW, doc.doc_id, draft))))
    kept_engine, kept = runs[-1]
    busy: dict[str, float] = {}
    for engine, completion in runs:
        busy[engine.name] = busy.get(engine.name, 0.0) + completion.timings.total_s
    cost = sum(owned_cost_usd(completion.timings.total_s, engine.node_usd_per_hour) for engine, completion in runs)
    return RoutedAnswer(
        text=kept.text, engine=kept_engine.name, fallback_cause=cause[0] if cause else None,
        fast_text=first.text, fast_confidence=first.confidence, confidence=kept.confidence,
        threshold_source=threshold_for(schema, policy)[1],
        latency_s=sum(completion.timings.total_s for _, completion in runs), busy_s=busy, cost_usd=cost,
        forwards=sum(completion.forwards for _, completion in runs),
        tokens=sum(completion.completion_tokens for _, completion in runs),
        low_confidence=below_floor(kept_engine.name, kept.confidence, policy))


def route_documents(docs: list[Document], codec: TextCodec, fast: RoutedEngine, fallback: RoutedEngine,
                    policy: RoutingPolicy, structured: bool = False,
                    on_batch: Callable[[int], None] | None = None) -> list[RoutedAnswer]:
    answers = []
    for doc in docs:
        answers.append(answer_document(doc, codec, fast, fallback, policy, structured))
        if on_batch:
            on_batch(1)
    return answers


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else 0.0


def route_figures(answers: list[RoutedAnswer]) -> dict:
    """The route's own figures over some answers: how many stayed on the fast engine, their
    latency, their cost per request and the low-confidence flags."""
    n = len(answers)
    kept = sum(a.fallback_cause is None for a in answers)
    latencies = [a.latency_s * 1000 for a in answers]
    busy: dict[str, float] = {}
    for answer in answers:
        for engine, seconds in answer.busy_s.items():
            busy[engine] = busy.get(engine, 0.0) + seconds
    return {
        "kept_on_diffusion": round(kept / n, 4) if n else 0.0,
        "fallback_rate": round(1 - kept / n, 4) if n else 0.0,
        "fallback_causes": dict(Counter(a.fallback_cause for a in answers if a.fallback_cause).most_common()),
        "latency_ms_p50": _percentile(latencies, 50),
        "latency_ms_p95": _percentile(latencies, 95),
        "latency_ms_mean": round(float(np.mean(latencies)), 3) if n else 0.0,
        "usd_per_request": sum(a.cost_usd for a in answers) / n if n else 0.0,
        "busy_s": {engine: round(seconds, 4) for engine, seconds in busy.items()},
        "answered_by": dict(Counter(a.engine for a in answers).most_common()),
        "low_confidence_flags": sum(a.low_confidence for a in answers),
        "forwards_per_doc": round(sum(a.forwards for a in answers) / n, 2) if n else 0.0,
        "tokens_per_forward": round(sum(a.tokens for a in answers) / max(sum(a.forwards for a in answers), 1), 3),
    }


def routed_metrics(answers: list[RoutedAnswer], docs: list[Document]) -> dict:
    """The scorer's summary of the answers kept, with the route's figures beside it, per kind
    and (documents of several tiers) per tier; plus the fast engine's accuracy on its own."""
    summary = scored_summary([a.text for a in answers], docs)

    def add(target: dict, chosen: list[int]) -> None:
        target.update(route_figures([answers[i] for i in chosen]))
        for kind, entry in target.get("per_kind", {}).items():
            entry.update(route_figures([answers[i] for i in chosen if docs[i].kind == kind]))

    add(summary, list(range(len(docs))))
    for tier, entry in summary.get("per_tier", {}).items():
        add(entry, [i for i, d in enumerate(docs) if d.tier == tier])
    alone = scored_summary([a.fast_text for a in answers], docs)
    summary["diffusion_field_accuracy"] = alone["field_accuracy"]
    summary["threshold_sources"] = dict(Counter(a.threshold_source for a in answers).most_common())
    return summary


def _has_wrong_field(text: str, doc: Document) -> bool:
    score = score_document(text, doc.fields, doc.kind)
    return score.fields_correct < score.fields_total


def low_confidence_figures(answers: list[RoutedAnswer], docs: list[Document], fast_engine: str,
                           floors: dict[str, float]) -> dict:
    """Recall (answers with a wrong field below the floor) against false flags (fully correct
    answers below it): the fast engine's answers (every document), the fallback's (the documents
    it re-ran), and the answers kept, as the gateway returns and flags them; each at its
    engine's floor (`floors`: engine -> floor) and over the sweep (flag_rates)."""
    sweep = sweep_floors(list(floors.values()))
    pairs = list(zip(answers, docs, strict=True))
    engines = {fast_engine: floor_report([a.fast_confidence for a in answers],
                                         [_has_wrong_field(a.fast_text, d) for a, d in pairs],
                                         floors[fast_engine], sweep)}
    for name, floor in floors.items():
        if name != fast_engine:
            rerun = [(a, d) for a, d in pairs if a.fallback_cause is not None and a.engine == name]
            engines[name] = floor_report([a.confidence for a, _ in rerun],
                                         [_has_wrong_field(a.text, d) for a, d in rerun], floor, sweep)
    kept = routed_report([a.confidence for a in answers], [_has_wrong_field(a.text, d) for a, d in pairs],
                         [a.engine for a in answers], floors, sweep)
    return {"goal": GOAL, "floors": sweep, "engines": engines, "routed": kept}


def routed_config(config: GatewayConfig, fast_model: str | None = None, fallback_model: str | None = None,
                  device: str | None = None) -> GatewayConfig:
    """The config with its fast and fallback engines pointed at other checkpoints, or another
    device (when given)."""
    engines = dict(config.engines)
    r = config.routing
    for name, model in ((r.fast_engine, fast_model), (r.fallback_engine, fallback_model)):
        if name in engines and model is not None:
            engines[name] = engines[name].model_copy(update={"model": model})
    moved = config.model_copy(update={"engines": engines})
    return moved if device is None else moved.on_device([n for n in (r.fast_engine, r.fallback_engine) if n], device)


def routed_engines(config: GatewayConfig, models: ModelCache) -> tuple[RoutedEngine, RoutedEngine, TextCodec]:
    """The config's fast and fallback engines, built by the engine factory as `nowait serve`
    builds them. Raises ValueError (EngineConfigError, CheckpointError) naming the problem."""
    r = config.routing
    if r.fast_engine is None:
        raise ValueError("the config routes no fast engine (routing.fast_engine): nothing to fall back from")
    built = {}
    for name in (r.fast_engine, r.fallback_engine):
        spec = config.engines[name]
        engine = build_engine(spec, models, name=name)
        built[name] = (RoutedEngine(name, engine.engine, spec.node_usd_per_hour, spec.kind), engine.codec)
    (fast, codec), (fallback, fallback_codec) = built[r.fast_engine], built[r.fallback_engine]
    if fast.kind != "diffusion":
        raise ValueError(f"routing.fast_engine {fast.name!r} is a {fast.kind} engine; the route's fast engine is "
                         "a diffusion one")
    if not fallback_codec.same_ids_as(codec):
        raise ValueError(f"engines {fast.name!r} and {fallback.name!r} have different tokenizers")
    return fast, fallback, codec


def routing_policy(config: GatewayConfig, threshold: float | None = None) -> RoutingPolicy:
    """The gateway's policy for the config; a given `threshold` holds for every request (the
    calibrated per-schema and per-kind ones are then not used, as when the config sets one;
    above 1: every answer falls back)."""
    policy = config.routing_policy()
    if threshold is None:
        return policy
    return policy.model_copy(update={"confidence_threshold": threshold, "schema_thresholds": {},
                                     "kind_thresholds": {}})


def evaluate_route(config: GatewayConfig, docs: list[Document], tier: str = "clean", structured: bool = False,
                   threshold: float | None = None, models: ModelCache | None = None,
                   on_batch: Callable[[int], None] | None = None) -> dict:
    """The route's metrics on `docs` (of corpus tier `tier`), and its settings: what
    `nowait eval --engine routed` and `bench engines`' `routed` entry report. `models`: where the
    config's checkpoints are loaded (a bench shares its entries' weights through it)."""
    fast, fallback, codec = routed_engines(config, models or ModelCache())
    policy = routing_policy(config, threshold)
    started = time.perf_counter()
    answers = route_documents(docs, codec, fast, fallback, policy, structured, on_batch)
    result = routed_metrics(answers, docs)
    floors = {name: confidence_floor(name, policy) for name in (fast.name, fallback.name)}
    result["low_confidence"] = low_confidence_figures(answers, docs, fast.name, floors)
    for name, entry in result.get("per_tier", {}).items():
        mine = [i for i, d in enumerate(docs) if d.tier == name]
        entry["low_confidence"] = low_confidence_figures([answers[i] for i in mine], [docs[i] for i in mine],
                                                         fast.name, floors)
    result["tier"], result["elapsed_s"] = tier, round(time.perf_counter() - started, 2)
    threshold_source = ("--threshold" if threshold is not None else config.confidence_threshold()[1])
    diffusion_options = getattr(fast.engine, "options", None)
    result["settings"] = {
        "engine": "routed", "batch_size": 1, "structured": structured, "fast_engine": fast.name,
        "fallback_engine": fallback.name,
        "confidence_threshold": policy.confidence_threshold, "confidence_threshold_source": threshold_source,
        "per_schema_thresholds": len(policy.schema_thresholds), "per_kind_thresholds": len(policy.kind_thresholds),
        "low_confidence": policy.low_confidence,
        "confidence_floors": floors,
        "node_usd_per_hour": {fast.name: fast.node_usd_per_hour, fallback.name: fallback.node_usd_per_hour},
        "decoding": f"{fast.name}: {describe_decoding('diffusion', diffusion_options, structured)}; below the "
                    f"threshold or not valid JSON: {fallback.name} ({fallback.kind}), "
                    + ("JSON Schema grammar" if structured else "any-JSON-object grammar"),
    }
    return result


def run_routed_eval(config: GatewayConfig, n: int, split: str = "test", seed: int | None = None,
                    tier: str = "clean", structured: bool = False, threshold: float | None = None,
                    models: ModelCache | None = None, on_batch: Callable[[int], None] | None = None) -> dict:
    """`nowait eval --engine routed`: the route's metrics on n held-out documents, and its settings."""
    docs = documents(split, n, seed=seed, tier=tier)
    result = evaluate_route(config, docs, tier, structured, threshold, models, on_batch)
    result["settings"] = {"engine": "routed", "split": None if seed is not None else split, "seed": seed,
                          **result["settings"]}
    return result
