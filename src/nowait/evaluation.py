"""Extraction with the demo decoders and its evaluation on held-out documents.

Training's periodic evaluation decodes the simple, correct way: greedy AR with the KV cache,
and LLaDA's reference schedule (one token committed per forward) for diffusion; that is the
yardstick. `nowait eval` measures an engine as served: AR greedy with the KV cache, or the
diffusion engine with its policy, block, cache and (optionally) schema-template infilling,
adding forwards, tokens per forward and per-document latency to the accuracy. Every engine comes
from the engine factory (engines/factory.py), as the gateway's do.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from nowait.engines.ar import AutoregressiveEngine, greedy_decode
from nowait.engines.base import Completion, GenerationRequest, SamplingParams
from nowait.engines.config import DiffusionEngineConfig
from nowait.engines.diffusion.reference import reference_decode
from nowait.engines.diffusion.request import DiffusionOptions
from nowait.engines.factory import EngineModel, engine_from
from nowait.engines.speculative import SpeculativeEngine
from nowait.extraction.corpus import HELD_OUT_LAYOUTS, KINDS, Document, documents, schema_for
from nowait.extraction.scorer import parse_json_object, schema_valid, score_document, summarize
from nowait.model import Transformer
from nowait.tokenizer import TextCodec, document_prompt, extraction_prompt

ANSWER_WINDOW = 160  # longest answer (~130 tokens) + end, as 5 diffusion blocks of 32
DIFFUSION_BLOCK = 32
TEMPLATE_MAX_TOKENS = 512  # template mode: the window is the template (166-227 tokens here)
ENGINES = ("ar", "spec", "diffusion")


def check_engine(model: Transformer, engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    if (engine in ("ar", "spec")) != model.config.causal:
        kind = "causal (AR)" if model.config.causal else "bidirectional (diffusion)"
        raise ValueError(f"engine {engine!r} cannot run this model: it is {kind}")


def decode_prompts(model: Transformer, codec: TextCodec, prompts: list[list[int]],
                   max_new_tokens: int = ANSWER_WINDOW, block: int = DIFFUSION_BLOCK,
                   stats: dict | None = None) -> list[list[int]]:
    """Greedy AR or reference-schedule diffusion over a batch of prompt ids."""
    if model.config.causal:
        return greedy_decode(model, prompts, max_new_tokens, codec.end_id, stats=stats)
    mask_id = model.config.mask_token_id if model.config.mask_token_id is not None else codec.mask_id
    return reference_decode(model, prompts, max_new_tokens, block, mask_id, codec.end_id, stats=stats)


def decode_documents(model: Transformer, codec: TextCodec, docs: list[Document], batch_size: int = 32,
                     max_new_tokens: int = ANSWER_WINDOW, block: int = DIFFUSION_BLOCK,
                     on_batch: Callable[[int], None] | None = None) -> list[str]:
    """Decode the JSON answer of each document, `batch_size` documents per batch."""
    texts: list[str] = []
    for start in range(0, len(docs), batch_size):
        chunk = docs[start: start + batch_size]
        prompts = [codec.encode(document_prompt(d)) for d in chunk]
        outputs = decode_prompts(model, codec, prompts, max_new_tokens, block)
        texts.extend(codec.decode(ids) for ids in outputs)
        if on_batch:
            on_batch(len(chunk))
    return texts


def scored_summary(texts: list[str], docs: list[Document]) -> dict:
    """The scorer's summary of the answers (`nowait.extraction.scorer.summarize`); for documents
    of several tiers (`--tier mixed`), the same summary per tier under `per_tier`; for hard-tier
    documents, the same over their held-out layouts and over the training layouts under
    `hard_layouts` (`held_out`, `training`; a group with no document is left out)."""
    scores = [score_document(text, d.fields, d.kind) for text, d in zip(texts, docs, strict=True)]
    summary = summarize(scores)
    tiers = sorted({d.tier for d in docs})
    if len(tiers) > 1:
        summary["per_tier"] = {tier: summarize(s for s, d in zip(scores, docs, strict=True) if d.tier == tier)
                               for tier in tiers}
    groups: dict[str, list] = {}
    for score, doc in zip(scores, docs, strict=True):
        if doc.tier == "hard":
            groups.setdefault("held_out" if doc.layout in HELD_OUT_LAYOUTS else "training", []).append(score)
    if groups:
        summary["hard_layouts"] = {name: summarize(groups[name]) for name in ("held_out", "training") if name in groups}
    return summary


def evaluate_model(model: Transformer, codec: TextCodec, docs: list[Document], **decode_options) -> dict:
    """Decode and score; the summary of `nowait.extraction.scorer.summarize`."""
    model.eval()
    texts = decode_documents(model, codec, docs, **decode_options)
    return summarize(score_document(text, d.fields, d.kind) for text, d in zip(texts, docs, strict=True))


@dataclass(frozen=True)
class DecodeRecord:
    """One document as an engine served it."""

    text: str
    forwards: int
    completion_tokens: int
    latency_s: float
    confidence: float | None = None  # the engine's overall confidence (diffusion), None for greedy AR


def decode_records(model: Transformer, codec: TextCodec, engine: str, docs: list[Document], batch_size: int = 32,
                   diffusion: DiffusionOptions | None = None, structured: bool = False,
                   on_batch: Callable[[int], None] | None = None) -> list[DecodeRecord]:
    """Decode `docs` with an engine, `batch_size` at a time, keeping each one's cost.

    AR: greedy with the KV cache; every document of a batch is charged the batch's forwards and
    wall time. Diffusion: the engine with `diffusion` options, each document's own forwards and
    latency from its Completion (at batch size 1, both are that document's alone).
    """
    if structured and engine != "diffusion":
        raise ValueError("structured AR decoding runs through the AR engine (run_engine_eval)")
    records: list[DecodeRecord] = []
    diffusion_engine = (engine_from(DiffusionEngineConfig.with_options(diffusion or DiffusionOptions(), batch_size),
                                    EngineModel(model, codec))
                        if engine == "diffusion" else None)
    for start in range(0, len(docs), batch_size):
        chunk = docs[start: start + batch_size]
        prompts = [codec.encode(document_prompt(d)) for d in chunk]
        if diffusion_engine is None:
            stats: dict = {}
            started = time.perf_counter()
            outputs = greedy_decode(model, prompts, ANSWER_WINDOW, codec.end_id, stats=stats)
            elapsed = time.perf_counter() - started
            records.extend(DecodeRecord(codec.decode(ids), stats["forwards"], len(ids), elapsed) for ids in outputs)
        else:
            max_tokens = TEMPLATE_MAX_TOKENS if structured else ANSWER_WINDOW
            requests = [GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens),
                                          schema=schema_for(d.kind) if structured else None)
                        for prompt, d in zip(prompts, chunk, strict=True)]
            for completion in diffusion_engine.generate(requests):
                records.append(DecodeRecord(completion.text, completion.forwards, completion.completion_tokens,
                                            completion.timings.total_s, completion.confidence))
        if on_batch:
            on_batch(len(chunk))
    return records


def speed_summary(records: list[DecodeRecord]) -> dict[str, float]:
    """forwards_per_doc, tokens_per_forward (all answer tokens over all forwards) and the
    per-document latency percentiles."""
    forwards = sum(r.forwards for r in records)
    latencies = np.array([r.latency_s for r in records]) * 1000
    return {
        "forwards_per_doc": round(forwards / max(len(records), 1), 2),
        "tokens_per_forward": round(sum(r.completion_tokens for r in records) / max(forwards, 1), 3),
        "latency_ms_p50": round(float(np.percentile(latencies, 50)), 2) if len(records) else 0.0,
        "latency_ms_p95": round(float(np.percentile(latencies, 95)), 2) if len(records) else 0.0,
        "latency_ms_mean": round(float(latencies.mean()), 3) if len(records) else 0.0,  # total time / docs
    }


def describe_decoding(engine: str, options: DiffusionOptions | None, structured: bool) -> str:
    if engine == "ar":
        return "greedy, KV cache"
    o = options or DiffusionOptions()
    rule = {"fixed": f"fixed {'1 token' if o.steps is None else f'{o.steps} steps'} per "
                     f"{'step' if o.steps is None else 'block'} (LLaDA)",
            "threshold": f"threshold tau={o.template_tau if structured else o.tau} (Fast-dLLM)",
            "factor": f"factor {o.factor} (Fast-dLLM)"}[o.policy]
    block = o.template_block if structured else o.block
    cache = (f"{o.cache} (refresh {o.refresh}{', settled tokens cached' if o.cache_decoded else ''})"
             if o.cache == "dual" else o.cache)
    return (f"{rule}, score {o.score}, block {block or 'whole window'}, cache {cache}, "
            + ("schema template" if structured else f"free-form window {ANSWER_WINDOW}"))


def evaluate_engine(model: Transformer, codec: TextCodec, engine: str, docs: list[Document], batch_size: int = 32,
                    diffusion: DiffusionOptions | None = None, structured: bool = False,
                    on_batch: Callable[[int], None] | None = None) -> dict:
    """Accuracy (the scorer's summary) plus the speed fields, for one engine configuration."""
    check_engine(model, engine)
    model.eval()
    started = time.perf_counter()
    records = decode_records(model, codec, engine, docs, batch_size, diffusion, structured, on_batch)
    elapsed = time.perf_counter() - started
    metrics = scored_summary([r.text for r in records], docs)
    return {**metrics, **speed_summary(records), "elapsed_s": round(elapsed, 2)}


def diffusion_options(policy: str | None = None, tau: float | None = None, block: int | None = None,
                      cache: str | None = None, base: DiffusionOptions | None = None,
                      refresh: str | None = None, cache_decoded: bool | None = None) -> DiffusionOptions:
    """The engine defaults with the given settings replaced (a given block applies to both
    free-form and template mode). Raises InvalidRequestError (a ValueError) if invalid."""
    o = base or DiffusionOptions()
    changes = {k: v for k, v in {"policy": policy, "cache": cache, "refresh": refresh,
                                 "cache_decoded": cache_decoded}.items() if v is not None}
    if block is not None:
        changes.update(block=block, template_block=block)
    if tau is not None:
        changes.update(tau=tau, template_tau=tau)
    o = replace(o, **changes)
    o.validate()
    return o


def run_eval(model: Transformer, codec: TextCodec, engine: str, n: int, split: str = "test",
             seed: int | None = None, batch_size: int = 32, block: int | None = None,
             on_batch: Callable[[int], None] | None = None, policy: str | None = None,
             tau: float | None = None, cache: str | None = None, structured: bool = False,
             refresh: str | None = None, cache_decoded: bool | None = None, tier: str = "clean") -> dict:
    """`nowait eval`: metrics on n held-out documents plus the settings that produced them."""
    check_engine(model, engine)
    options = (diffusion_options(policy, tau, block, cache, refresh=refresh, cache_decoded=cache_decoded)
               if engine == "diffusion" else None)
    docs = documents(split, n, seed=seed, tier=tier)
    result = evaluate_engine(model, codec, engine, docs, batch_size, options, structured, on_batch)
    settings = {"engine": engine, "split": None if seed is not None else split, "seed": seed,
                "batch_size": batch_size, "structured": structured,
                "decoding": describe_decoding(engine, options, structured)}
    if options is not None:
        settings.update(policy=options.policy, tau=options.template_tau if structured else options.tau,
                        block=options.template_block if structured
                        else options.block, cache=options.cache, score=options.score)
        if options.cache == "dual":  # the refresh and settled-token options apply to the dual cache only
            settings.update(refresh=options.refresh, cache_decoded=options.cache_decoded)
    return {**result, "tier": tier, "settings": settings}


# --- an AR engine as served: `nowait eval --engine spec` and `--engine ar --structured` ---


def document_request(doc: Document, codec: TextCodec, structured: bool = False,
                     max_tokens: int = ANSWER_WINDOW) -> GenerationRequest:
    """Greedy extraction of one document, constrained to its kind's JSON Schema if `structured`."""
    return GenerationRequest(codec.encode(document_prompt(doc)), SamplingParams(max_tokens=max_tokens),
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
    metrics = scored_summary([c.text for c in completions], docs)
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
        "latency_ms_mean": float(latencies.mean()) if len(latencies) else 0.0,  # total time / docs
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
                    on_batch: Callable[[int], None] | None = None, tier: str = "clean") -> dict:
    """`nowait eval --engine ar|spec [--structured]`: the fields of `run_eval` plus the engine's
    cost and latency fields."""
    docs = documents(split, n, seed=seed, tier=tier)
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
    return {**completion_metrics(completions, docs), "tier": tier, "settings": settings,
            "elapsed_s": round(elapsed, 2)}


# --- one document, for `nowait extract` ---

_KIND_WORDS = {
    "letter_of_credit": ("credit", "beneficiary", "l/c", "incoterm", "shipment", "issuing bank"),
    "loan_application": ("loan", "borrower", "income", "term", "tenor", "repayment"),
    "kyc": ("kyc", "customer", "passport", "nationality", "birth", "account"),
}


def guess_kind(text: str) -> str:
    """The document kind whose telltale words occur most often (ties go to the first kind)."""
    lowered = text.lower()
    counts = {kind: sum(len(re.findall(re.escape(w), lowered)) for w in words) for kind, words in _KIND_WORDS.items()}
    return max(KINDS, key=lambda kind: counts[kind])


@dataclass
class Extraction:
    kind: str
    text: str
    value: dict | None
    schema_valid: bool
    prompt_tokens: int
    completion_tokens: int
    forwards: int
    seconds: float

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / max(self.forwards, 1)


def extract(model: Transformer, codec: TextCodec, document: str, kind: str | None = None) -> Extraction:
    """Extract one document's JSON as the engines serve it: greedy AR with the KV cache, or the
    diffusion engine's fast default (free-form)."""
    if not document.strip():
        raise ValueError("the document is empty")
    kind = kind or guess_kind(document)
    if kind not in KINDS:
        raise ValueError(f"unknown document kind {kind!r}; choose one of: {', '.join(KINDS)}")
    prompt = codec.encode(extraction_prompt(kind, document.strip()))
    limit = model.config.max_position - ANSWER_WINDOW
    if len(prompt) > limit:
        raise ValueError(f"the document is {len(prompt)} tokens; this model reads at most {limit}")
    stats: dict = {}
    started = time.perf_counter()
    if model.config.causal:
        ids = decode_prompts(model, codec, [prompt], stats=stats)[0]
    else:
        fast_default = engine_from(DiffusionEngineConfig(kind="diffusion"), EngineModel(model, codec))
        [completion] = fast_default.generate([GenerationRequest(prompt, SamplingParams(max_tokens=ANSWER_WINDOW))])
        ids, stats["forwards"] = completion.token_ids, completion.forwards
    seconds = time.perf_counter() - started
    text = codec.decode(ids)
    value = parse_json_object(text)
    return Extraction(kind=kind, text=text, value=value,
                      schema_valid=value is not None and schema_valid(value, kind),
                      prompt_tokens=len(prompt), completion_tokens=len(ids),
                      forwards=stats.get("forwards", 0), seconds=seconds)
