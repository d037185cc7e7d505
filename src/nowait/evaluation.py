"""Extraction with the demo decoders and its evaluation on held-out documents.

Decoding here is the simple, correct kind: greedy AR with the KV cache, and LLaDA's reference
schedule (one token committed per forward) for diffusion. The engines make them fast; this
module is the yardstick they are checked against.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from nowait.engines.autoregressive import greedy_decode
from nowait.engines.diffusion import reference_decode
from nowait.extraction.corpus import KINDS, Document, documents
from nowait.extraction.scorer import parse_json_object, schema_valid, score_document, summarize
from nowait.model import Transformer
from nowait.tokenizer import TextCodec, extraction_prompt

ANSWER_WINDOW = 160  # longest answer (~130 tokens) + end, as 5 diffusion blocks of 32
DIFFUSION_BLOCK = 32
ENGINES = ("ar", "diffusion")


def check_engine(model: Transformer, engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    if (engine == "ar") != model.config.causal:
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
        prompts = [codec.encode(extraction_prompt(d.kind, d.text)) for d in chunk]
        outputs = decode_prompts(model, codec, prompts, max_new_tokens, block)
        texts.extend(codec.decode(ids) for ids in outputs)
        if on_batch:
            on_batch(len(chunk))
    return texts


def evaluate_model(model: Transformer, codec: TextCodec, docs: list[Document], **decode_options) -> dict:
    """Decode and score; the summary of `nowait.extraction.scorer.summarize`."""
    model.eval()
    texts = decode_documents(model, codec, docs, **decode_options)
    return summarize(score_document(text, d.fields, d.kind) for text, d in zip(texts, docs, strict=True))


def run_eval(model: Transformer, codec: TextCodec, engine: str, n: int, split: str = "test",
             seed: int | None = None, batch_size: int = 32, block: int = DIFFUSION_BLOCK,
             on_batch: Callable[[int], None] | None = None) -> dict:
    """`nowait eval`: metrics on n held-out documents plus the settings that produced them."""
    check_engine(model, engine)
    docs = documents(split, n, seed=seed)
    started = time.perf_counter()
    metrics = evaluate_model(model, codec, docs, batch_size=batch_size, block=block, on_batch=on_batch)
    elapsed = time.perf_counter() - started
    settings = {"engine": engine, "split": None if seed is not None else split, "seed": seed,
                "batch_size": batch_size,
                "decoding": "greedy, KV cache" if engine == "ar" else
                            f"LLaDA reference schedule, 1 token per forward, block {block}, window {ANSWER_WINDOW}"}
    return {**metrics, "settings": settings, "elapsed_s": round(elapsed, 2)}


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
    """Extract one document's JSON with the model's own decoder (AR or diffusion)."""
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
    ids = decode_prompts(model, codec, [prompt], stats=stats)[0]
    seconds = time.perf_counter() - started
    text = codec.decode(ids)
    value = parse_json_object(text)
    return Extraction(kind=kind, text=text, value=value,
                      schema_valid=value is not None and schema_valid(value, kind),
                      prompt_tokens=len(prompt), completion_tokens=len(ids),
                      forwards=stats.get("forwards", 0), seconds=seconds)
