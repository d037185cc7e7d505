"""Requests built from the extraction corpus: what the load bench and the demo send.

A `LoadRequest` is one document to extract, with the ground truth kept beside it (never sent),
the JSON Schema of its kind as `response_format`, and the routing metadata of the workload.
The metadata travels as `x-nowait-*` headers, not in the body: any OpenAI-compatible server
(vLLM, SGLang, an external API) ignores unknown headers, while some refuse unknown body fields.
Batch lines carry no metadata: the gateway treats batch lines as batchable by default.

The chat shape is the usual client one: a system message with the instruction and a user
message with the pasted document (the gateway folds it into the demo models' trained prompt).
A `system_prefix` (a deployment's own system prompt) goes before the instruction in every
request: the beginning prompts share, which a prefix cache serves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from nowait.extraction.corpus import KINDS, Document, documents, schema_for
from nowait.extraction.scorer import DocumentScore, score_document
from nowait.tokenizer import instruction_for

# The longest schema template of the demo corpus is 227 tokens and the longest answer about 130:
# 256 leaves room for both, and for the diffusion engine's template window.
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class RoutingMetadata:
    """The `nowait` request fields, sent as headers (docs/gateway.md, "Request metadata")."""

    latency_budget_ms: float | None = None
    token_value_usd_per_mtok: float | None = None
    data_class: str | None = None
    batchable: bool | None = None

    def headers(self) -> dict[str, str]:
        out = {}
        if self.latency_budget_ms is not None:
            out["x-nowait-latency-budget-ms"] = f"{self.latency_budget_ms:g}"
        if self.token_value_usd_per_mtok is not None:
            out["x-nowait-token-value"] = f"{self.token_value_usd_per_mtok:g}"
        if self.data_class is not None:
            out["x-nowait-data-class"] = self.data_class
        if self.batchable is not None:
            out["x-nowait-batchable"] = "true" if self.batchable else "false"
        return out


@dataclass(frozen=True)
class LoadRequest:
    """One extraction: the document (with its truth), how to ask for it, and its metadata."""

    doc: Document
    max_tokens: int = DEFAULT_MAX_TOKENS
    use_schema: bool = True
    metadata: RoutingMetadata = RoutingMetadata()
    system_prefix: str = ""

    @property
    def latency_target_s(self) -> float | None:
        budget = self.metadata.latency_budget_ms
        return None if budget is None else budget / 1000.0

    def messages(self) -> list[dict[str, str]]:
        instruction = self.doc.instruction or instruction_for(self.doc.kind)  # a hard document's own wording
        system = f"{self.system_prefix}\n{instruction}" if self.system_prefix else instruction
        return [{"role": "system", "content": system}, {"role": "user", "content": self.doc.text}]

    def body(self, model: str, stream: bool) -> dict:
        """The `/v1/chat/completions` body (greedy: extraction wants the most likely answer)."""
        body: dict = {"model": model, "messages": self.messages(), "max_tokens": self.max_tokens,
                      "temperature": 0}
        if self.use_schema:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": self.doc.kind, "schema": schema_for(self.doc.kind)}}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def batch_line(self, custom_id: str, model: str) -> dict:
        """One line of a Batch API input file."""
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": self.body(model, stream=False)}

    def score(self, text: str) -> DocumentScore:
        """The answer against the document's ground truth (docs/corpus.md's scorer)."""
        return score_document(text, self.doc.fields, self.doc.kind)


def parse_kinds(text: str | None) -> tuple[str, ...]:
    """'kyc,loan_application' -> the kinds; None or empty -> every kind. ValueError names a bad one."""
    if not text:
        return KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown document kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    return kinds


def corpus_documents(count: int, kinds: tuple[str, ...] = KINDS, split: str | None = "test",
                     seed: int | None = None, tier: str = "clean") -> list[Document]:
    """The first `count` documents of the kinds asked for, from a split or a fresh seed's stream,
    of a corpus tier (the corpus rotates kinds, so a single kind takes every third document)."""
    per_rotation = max(1, len([k for k in KINDS if k in kinds]))
    pool = documents(split, count * len(KINDS) // per_rotation + len(KINDS), seed=seed, tier=tier)
    chosen = [d for d in pool if d.kind in kinds]
    return chosen[:count]


def request_stream(docs: list[Document], max_tokens: int = DEFAULT_MAX_TOKENS, use_schema: bool = True,
                   metadata: RoutingMetadata = RoutingMetadata(), system_prefix: str = "") -> Iterator[LoadRequest]:
    """The documents as requests, cycled without end (a time-bounded run may need more)."""
    if not docs:
        raise ValueError("no documents to send")
    index = 0
    while True:
        yield LoadRequest(docs[index % len(docs)], max_tokens, use_schema, metadata, system_prefix)
        index += 1
