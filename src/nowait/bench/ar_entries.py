"""The AR engines on the extraction task: `nowait eval --engine ar|spec [--structured]` and the
`spec` / `ar-structured` entries of `nowait bench engines`.

Everything here drives the engines through their public `generate`, so what is measured is what
a caller gets. Latency is measured one document at a time (batch size 1, the latency-bound case
the diffusion engine competes in): each request is created just before it is submitted, so its
`timings.total_s` is its service time. Accuracy comes from the same scorer as `nowait eval`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig, greedy_decode
from nowait.engines.base import Completion, GenerationRequest, SamplingParams
from nowait.engines.speculative import (
    SPEC_METHODS,
    SPEC_SETTINGS,
    SpeculativeConfig,
    SpeculativeEngine,
    build_drafter,
)
from nowait.evaluation import ANSWER_WINDOW
from nowait.extraction.corpus import Document, documents, schema_for
from nowait.extraction.scorer import score_document, summarize
from nowait.model import Transformer
from nowait.tokenizer import TextCodec, extraction_prompt


def grammar_for(model: Transformer, codec: TextCodec):
    """A JSON Schema grammar compiler for this model's vocabulary (imports llguidance)."""
    from nowait.engines.structured.grammar import GrammarCompiler

    return GrammarCompiler.from_codec(codec, vocab_size=model.config.vocab_size)


def build_ar_engine(model: Transformer, codec: TextCodec, structured: bool = False,
                    config: EngineConfig | None = None) -> AutoregressiveEngine:
    """The AR engine, with the grammar compiler when `structured`."""
    return AutoregressiveEngine(model, codec, config, grammar=grammar_for(model, codec) if structured else None)


def build_spec_engine(model: Transformer, codec: TextCodec, method: str = "ngram", draft: Transformer | None = None,
                      gamma: int | None = 4, structured: bool = False, config: EngineConfig | None = None,
                      draft_codec: TextCodec | None = None) -> SpeculativeEngine:
    """The speculative engine with `method`'s bench settings (`SPEC_SETTINGS`), `gamma`
    overriding theirs unless None. `draft`: the causal draft (methods draft, hybrid) or the
    diffusion model (method diffusion). Give `draft_codec` (the draft checkpoint's tokenizer)
    to have a draft trained on another tokenizer of the same size refused rather than proposing
    tokens that mean something else."""
    grammar = grammar_for(model, codec) if structured else None
    settings = spec_settings(method, gamma)
    if settings.uses_drafter:
        drafter = build_drafter(draft, draft_codec or codec, settings.max_batch) if draft is not None else None
        return SpeculativeEngine(model, codec, config, grammar=grammar, speculative=settings, drafter=drafter)
    return SpeculativeEngine(model, codec, config, draft=draft, grammar=grammar, draft_codec=draft_codec,
                             speculative=settings)


def spec_settings(method: str, gamma: int | None = None) -> SpeculativeConfig:
    settings = SPEC_SETTINGS.get(method, SpeculativeConfig(method=method))
    return settings if gamma is None else replace(settings, gamma=gamma)


def document_request(doc: Document, codec: TextCodec, structured: bool = False,
                     max_tokens: int = ANSWER_WINDOW) -> GenerationRequest:
    """Greedy extraction of one document, constrained to its kind's JSON Schema if `structured`."""
    return GenerationRequest(codec.encode(extraction_prompt(doc.kind, doc.text)), SamplingParams(max_tokens=max_tokens),
                             schema=schema_for(doc.kind) if structured else None, request_id=doc.doc_id)


def decode_documents_with(engine: AutoregressiveEngine, docs: list[Document], codec: TextCodec,
                          structured: bool = False, one_at_a_time: bool = False, max_tokens: int = ANSWER_WINDOW,
                          on_batch: Callable[[int], None] | None = None) -> list[Completion]:
    """Completions for `docs`, in order. Batched through continuous batching by default (groups
    of `max_num_seqs`, so `on_batch` can report progress); `one_at_a_time` for latency."""
    completions: list[Completion] = []
    group = 1 if one_at_a_time else engine.config.max_num_seqs
    for start in range(0, len(docs), group):
        chunk = docs[start: start + group]
        completions += engine.generate([document_request(d, codec, structured, max_tokens) for d in chunk])
        if on_batch:
            on_batch(len(chunk))
    return completions


def completion_metrics(completions: list[Completion], docs: list[Document]) -> dict:
    """The eval fields every engine reports (the scorer's, plus cost and latency)."""
    metrics = summarize(score_document(c.text, d.fields, d.kind) for c, d in zip(completions, docs, strict=True))
    tokens = sum(c.completion_tokens for c in completions)
    forwards = sum(c.forwards for c in completions)
    latencies = np.array([c.timings.total_s for c in completions]) * 1000
    proposed = sum(c.draft_tokens_proposed for c in completions)
    mask_s = sum(c.timings.grammar_mask_s for c in completions)
    metrics.update({
        "forwards_per_doc": forwards / max(len(completions), 1),
        "tokens_per_forward": tokens / max(forwards, 1),
        "latency_ms_p50": float(np.percentile(latencies, 50)) if len(latencies) else 0.0,
        "latency_ms_p95": float(np.percentile(latencies, 95)) if len(latencies) else 0.0,
        "tokens_per_doc": tokens / max(len(completions), 1),
        "finished_by_length": sum(c.finish_reason == "length" for c in completions),
        "mean_confidence": float(np.mean([c.confidence for c in completions])) if completions else 0.0,
    })
    if proposed:
        metrics["acceptance_rate"] = sum(c.draft_tokens_accepted for c in completions) / proposed
        metrics["draft_forwards_per_doc"] = sum(c.draft_forwards for c in completions) / len(completions)
    if mask_s:
        metrics["grammar_mask_us_per_token"] = mask_s / max(tokens, 1) * 1e6
    return metrics


def run_engine_eval(engine: AutoregressiveEngine, codec: TextCodec, n: int, split: str = "test",
                    seed: int | None = None, structured: bool = False, one_at_a_time: bool = False,
                    on_batch: Callable[[int], None] | None = None) -> dict:
    """`nowait eval --engine ar|spec [--structured]`: the fields of `evaluation.run_eval` plus
    the engine's cost and latency fields."""
    docs = documents(split, n, seed=seed)
    started = time.perf_counter()
    completions = decode_documents_with(engine, docs, codec, structured, one_at_a_time, on_batch=on_batch)
    elapsed = time.perf_counter() - started
    decoding = "greedy, KV cache, continuous batching"
    if isinstance(engine, SpeculativeEngine):
        spec = engine.speculative
        tuning = "".join(f", {name} {value}" for name, value in
                         (("draft_confidence", spec.draft_confidence), ("lookup_gamma", spec.lookup_gamma)) if value)
        decoding += f", speculative ({spec.method}, gamma {spec.gamma}{tuning}, at most {spec.max_batch} sequences)"
    if structured:
        decoding += ", JSON Schema grammar (llguidance)"
    settings = {"engine": engine.name, "split": None if seed is not None else split, "seed": seed,
                "structured": structured, "batch_size": 1 if one_at_a_time else engine.config.max_num_seqs,
                "decoding": decoding}
    return {**completion_metrics(completions, docs), "settings": settings, "elapsed_s": round(elapsed, 2)}


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
    config = EngineConfig(max_num_seqs=1)
    engines: dict[str, AutoregressiveEngine] = {"ar": AutoregressiveEngine(model, codec, config)}
    for method in methods:
        settings = spec_settings(method)
        if settings.uses_drafter:
            if drafter is not None:
                engines[method] = build_spec_engine(model, codec, method, drafter, gamma, config=config,
                                                    draft_codec=drafter_codec)
        elif not settings.uses_draft or draft is not None:
            engines[method] = build_spec_engine(model, codec, method, draft, gamma, config=config,
                                                draft_codec=draft_codec)
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
    engine = build_ar_engine(model, codec, structured=True, config=EngineConfig(max_num_seqs=1))
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
    config = EngineConfig(max_num_seqs=1)
    answers = build_drafter(drafter, drafter_codec or codec, max_batch=1)
    verifiers: dict[str, SpeculativeEngine] = {
        "diffusion": build_spec_engine(model, codec, "diffusion", drafter, None, config=config,
                                       draft_codec=drafter_codec)}
    if draft is not None:
        verifiers["hybrid"] = build_spec_engine(model, codec, "hybrid", draft, None, config=config,
                                                draft_codec=draft_codec)
    plain = AutoregressiveEngine(model, codec, config)
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
