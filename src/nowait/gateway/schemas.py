"""The OpenAI wire format as pydantic models: requests, responses, stream chunks, models, files,
batches and error objects (the shapes of OpenAI's API reference, as vLLM's server models them).

Requests accept unknown fields and ignore them, as OpenAI-compatible servers do, so a newer client
still works; fields whose meaning nowait cannot honour (tools, penalties) are refused in
`calls.py` with a message naming them, never silently dropped. The `nowait` objects are the
gateway's own additions: request metadata in, the routing explanation out.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nowait.router import DataClass


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class OpenAIObject(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


# --- request metadata (nowait's own) ---


class NowaitRequestOptions(BaseModel):
    """The body's `"nowait"` object (the openai client's extra_body)."""

    model_config = ConfigDict(extra="forbid")

    latency_budget_ms: float | None = Field(None, gt=0)
    token_value_usd_per_mtok: float | None = Field(None, ge=0)
    data_class: DataClass | None = None
    batchable: bool | None = None


# --- chat and completions requests ---


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIRequest):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TextPart(OpenAIRequest):
    type: str
    text: str | None = None


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class SamplingRequest(OpenAIRequest):
    """Fields chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # vLLM's extension; 0 = no cut
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM takes it; n > 1 adds the index
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    nowait: NowaitRequestOptions | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None  # vLLM accepts it on completions too


# --- responses ---


class PromptTokensDetails(OpenAIObject):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed


def cached_tokens(usage: dict | None) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of a server's answer (OpenAI's field, vLLM's and
    nowait's too), or 0 when it says nothing or something else."""
    details = (usage or {}).get("prompt_tokens_details")
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


class Usage(OpenAIObject):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class EngineAttempt(OpenAIObject):
    engine: str
    seconds: float
    prompt_tokens: int
    completion_tokens: int
    confidence: float | None
    cost_usd: float
    outcome: str  # the finish reason, or why the attempt did not answer
    forwards: int | None = None  # model forwards of an owned engine (None: remote, or no answer)


class NowaitInfo(OpenAIObject):
    """How the answer was produced: the engine, why, whether a fallback ran, what it cost."""

    route: str
    reason: str
    rule: str
    fallback: bool
    confidence: float | None
    cost_usd: float
    engines_tried: list[EngineAttempt]
    # True: the answer's confidence is below its engine's floor (routing.low_confidence: flag)
    low_confidence: bool = False


def now() -> int:
    return int(time.time())


class AssistantMessage(OpenAIObject):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class TopLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(OpenAIObject):
    """`choices[i].logprobs` of chat (nowait.gateway.logprobs builds it)."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(OpenAIObject):
    """`choices[i].logprobs` of legacy completions."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(OpenAIObject):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(OpenAIObject):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    nowait: NowaitInfo | None = None


class ChatDelta(OpenAIObject):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(OpenAIObject):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(OpenAIObject):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    nowait: NowaitInfo | None = None


class CompletionChoice(OpenAIObject):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class TextCompletion(OpenAIObject):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    nowait: NowaitInfo | None = None


# --- models ---


class ModelCard(OpenAIObject):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "nowait"
    kind: str | None = None  # nowait: ar, spec, diffusion, remote, router
    max_model_len: int | None = None  # vLLM's field: prompt plus output tokens the model takes (None: not known)


class ModelList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- files ---


class FileObject(OpenAIObject):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(OpenAIObject):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


# --- batches ---

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]


class BatchCreateRequest(OpenAIRequest):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class BatchError(OpenAIObject):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(OpenAIObject):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(OpenAIObject):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = BatchRequestCounts()
    metadata: dict[str, str] | None = None


class BatchList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# --- errors ---


class ErrorDetail(OpenAIObject):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIObject):
    error: ErrorDetail
