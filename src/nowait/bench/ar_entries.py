"""The AR engines' entries of `nowait bench engines`: `spec` (every speculative method against
plain AR), `ar-structured` (the grammar's cost) and `fallback` (a diffusion answer re-run on AR).

Every engine comes from the engine factory (engines/factory.py) with a config like the gateway's
(one sequence at a time, no grammar unless measured), and is driven through its public
`generate`, so what is measured is what a caller gets. Latency is measured one document at a time
(batch size 1, the latency-bound case the diffusion engine competes in): each request is created
just before it is submitted, so its `timings.total_s` is its service time. Accuracy comes from
the same scorer as `nowait eval`.
"""

from __future__ import annotations

import time

import numpy as np

from nowait.engines.ar import AutoregressiveEngine, greedy_decode
from nowait.engines.base import Completion
from nowait.engines.config import ArEngineConfig, DiffusionEngineConfig, OwnedEngineSpec, SpecEngineConfig
from nowait.engines.factory import EngineModel, OwnedEngine, engine_from
from nowait.engines.speculative import SPEC_METHODS, SPEC_SETTINGS, SpeculativeEngine
from nowait.evaluation import completion_metrics, decode_documents_with, document_request
from nowait.extraction.corpus import Document
from nowait.model import Transformer
from nowait.tokenizer import TextCodec

# One sequence at a time: the latency-bound case these entries measure.
ONE_AT_A_TIME = ArEngineConfig(kind="ar", max_num_seqs=1, structured=False)


def spec_config(method: str, gamma: int | None = None) -> SpecEngineConfig:
    """A one-sequence spec engine with `method`'s tuned settings, `gamma` overriding theirs unless None."""
    return SpecEngineConfig(kind="spec", method=method, gamma=gamma, max_num_seqs=1, structured=False)


def bench_engine(config: OwnedEngineSpec, model: Transformer, codec: TextCodec, draft: Transformer | None = None,
                 draft_codec: TextCodec | None = None) -> OwnedEngine:
    """The factory's engine on models in memory. `draft`: the causal draft or the diffusion
    drafter; `draft_codec` (default: the target's) its tokenizer, so that a draft trained on
    another tokenizer of the same size is refused rather than proposing tokens that mean something
    else."""
    helper = EngineModel(draft, draft_codec or codec) if draft is not None else None
    return engine_from(config, EngineModel(model, codec), helper)


def _identical(a: list[Completion], b: list[Completion]) -> bool:
    return all(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))


def spec_entry(model: Transformer, codec: TextCodec, docs: list[Document], draft: Transformer | None = None,
               methods: tuple[str, ...] = SPEC_METHODS, gamma: int | None = None,
               draft_codec: TextCodec | None = None, drafter: Transformer | None = None,
               drafter_codec: TextCodec | None = None) -> dict:
    """`nowait bench engines` entry `spec`: AR + the best speculative method at batch size 1.

    Plain AR (`greedy_decode`, and the AR engine) and each method (`SPEC_SETTINGS`, `gamma`
    overriding theirs; `draft` is the causal draft model, `drafter` the diffusion model; a
    method whose model is missing is left out) decode the same documents one at a time, taking turns on each document
    so that a shared machine's changing load hits them alike. The entry carries the best
    method's eval fields (lowest p50 latency), its speed-up over plain AR, whether every
    method's greedy output equals plain AR's, and the other methods beside it.
    """
    engines: dict[str, AutoregressiveEngine] = {"ar": bench_engine(ONE_AT_A_TIME, model, codec)}
    for method in methods:
        settings = SPEC_SETTINGS[method]
        if settings.uses_drafter:
            if drafter is not None:
                engines[method] = bench_engine(spec_config(method, gamma), model, codec, drafter, drafter_codec)
        elif not settings.uses_draft or draft is not None:
            engines[method] = bench_engine(spec_config(method, gamma), model, codec, draft, draft_codec)
    if len(engines) == 1:
        raise ValueError("no speculative method to run (methods 'draft' and 'hybrid' need a draft model, "
                         "'diffusion' a diffusion model)")
    completions: dict[str, list[Completion]] = {name: [] for name in engines}
    greedy_ms, greedy_ids = [], []
    for doc in docs:
        request = document_request(doc, codec)
        started = time.perf_counter()
        greedy_ids.append(greedy_decode(model, [request.prompt_ids], request.sampling.max_tokens, codec.end_id)[0])
        greedy_ms.append((time.perf_counter() - started) * 1000)
        for name, engine in engines.items():
            completions[name] += engine.generate([document_request(doc, codec)])
    baseline = completions.pop("ar")
    plain = {**completion_metrics(baseline, docs), "greedy_decode_latency_ms_p50": float(np.percentile(greedy_ms, 50)),
             "identical_to_greedy_decode": [c.token_ids for c in baseline] == greedy_ids}
    results: dict[str, dict] = {}
    for method, decoded in completions.items():
        metrics = completion_metrics(decoded, docs)
        settings = engines[method].speculative
        p50 = max(metrics["latency_ms_p50"], 1e-9)
        results[method] = {
            **metrics, "gamma": settings.gamma, "draft_confidence": settings.draft_confidence,
            "lookup_gamma": settings.lookup_gamma, "drafter_tau": settings.drafter_tau,
            "greedy_identical_to_ar": _identical(decoded, baseline),
            "speedup_p50_vs_ar": plain["latency_ms_p50"] / p50,
            "speedup_p50_vs_greedy_decode": plain["greedy_decode_latency_ms_p50"] / p50,
        }
    best = min(results, key=lambda m: results[m]["latency_ms_p50"])
    return {**results[best], "engine": "spec", "method": best, "batch_size": 1,
            "methods": results, "ar": plain, "n": len(docs)}


def ar_structured_entry(model: Transformer, codec: TextCodec, docs: list[Document]) -> dict:
    """`nowait bench engines` entry `ar-structured`: greedy AR constrained to each document
    kind's JSON Schema, one document at a time; `grammar_mask_us_per_token` is the mask's cost."""
    engine = bench_engine(ArEngineConfig(kind="ar", max_num_seqs=1, structured=True), model, codec)
    completions = decode_documents_with(engine, docs, codec, structured=True, one_at_a_time=True)
    return {**completion_metrics(completions, docs), "engine": "ar-structured", "batch_size": 1, "n": len(docs)}


def fallback_entry(model: Transformer, codec: TextCodec, docs: list[Document], drafter: Transformer,
                   drafter_codec: TextCodec | None = None, draft: Transformer | None = None,
                   draft_codec: TextCodec | None = None) -> dict:
    """`nowait bench engines` entry `fallback`: what re-running a diffusion answer on AR costs.

    Each document is answered by the diffusion engine (its fast default) first; then, taking
    turns, the AR engine decodes it from scratch (the gateway's plain `ar` fallback) and
    speculative engines verify the diffusion answer as their draft (`draft_ids`, what a
    `kind: spec` fallback engine receives, verified `answer_gamma` tokens per forward): an engine
    with method diffusion's settings and, given a draft model, one with hybrid's (its proposer
    takes over where the answer stops matching). Latency is the re-run's alone: the diffusion answer
    was already paid for. The entry's fields are the fastest verifier's; each one's speed-up
    over the AR engine and whether its greedy output equals AR's are beside them.
    """
    answers = bench_engine(DiffusionEngineConfig(kind="diffusion", max_batch=1), drafter, drafter_codec or codec)
    verifiers: dict[str, SpeculativeEngine] = {
        "diffusion": bench_engine(spec_config("diffusion"), model, codec, drafter, drafter_codec)}
    if draft is not None:
        verifiers["hybrid"] = bench_engine(spec_config("hybrid"), model, codec, draft, draft_codec)
    plain = bench_engine(ONE_AT_A_TIME, model, codec)
    reruns: dict[str, list[Completion]] = {"ar": [], **{name: [] for name in verifiers}}
    for doc in docs:
        [answer] = answers.generate([document_request(doc, drafter_codec or codec)])
        reruns["ar"] += plain.generate([document_request(doc, codec)])
        for name, engine in verifiers.items():
            request = document_request(doc, codec)
            request.draft_ids = answer.token_ids
            reruns[name] += engine.generate([request])
    baseline = reruns.pop("ar")
    ar = completion_metrics(baseline, docs)
    results = {}
    for name, completions in reruns.items():
        metrics = completion_metrics(completions, docs)
        results[name] = {**metrics, "answer_gamma": verifiers[name].speculative.answer_gamma,
                         "greedy_identical_to_ar": _identical(completions, baseline),
                         "speedup_p50_vs_ar": ar["latency_ms_p50"] / max(metrics["latency_ms_p50"], 1e-9)}
    best = min(results, key=lambda name: results[name]["latency_ms_p50"])
    return {**results[best], "engine": "fallback", "verifier": best, "batch_size": 1, "verifiers": results,
            "ar": ar, "n": len(docs)}
