"""What every engine takes and returns: one request shape, one Completion record.

The AR engine, the diffusion engine and remote upstreams all return `Completion`, so the router,
the gateway, the cost ledger and the benchmark read one record whatever produced it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "cancelled", "error"]
# The seeds a torch.Generator takes: a 64-bit integer, signed or not.
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (and vLLM's default max_logprobs)


class InvalidRequestError(ValueError):
    """A request an engine refuses before any work: the message names the bad parameter."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # None: no logprobs (nothing computed); k >= 0: each output token's logprob and its k most
    # likely alternatives (`TokenLogprob`), from the model's own softmax at temperature 1.
    logprobs: int | None = None

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidRequestError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability under the engine's own distribution (log-softmax of the
    logits at temperature 1, before any sampling cut or grammar mask), and the `top` most likely
    tokens of the same distribution as (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationRequest:
    """One prompt to complete. `schema` asks for JSON valid for that JSON Schema; `options`
    carries engine-specific settings (diffusion: policy, tau, block, cache). `draft_ids`: an
    answer drafted elsewhere (e.g. the diffusion engine's, on fallback) that a speculative engine
    verifies before its method's own proposals, whatever the method; the output is still the
    target's. The draft must not depend on the target's random draws (a greedy draft never does)."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    schema: dict | None = None
    options: dict = field(default_factory=dict)
    request_id: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)
    draft_ids: list[int] | None = None


@dataclass
class Timings:
    """Seconds from the request's arrival: admitted to a batch, first token out, done; plus the
    seconds of grammar-mask work inside that time."""

    queued_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0
    grammar_mask_s: float = 0.0  # time spent computing grammar token masks (constrained decoding)


@dataclass
class Completion:
    """The record every engine returns.

    `confidence` summarizes `token_confidences` into one number the router compares with its
    fallback threshold; `confidence_kind` says how (e.g. "min_token_probability": one unsure
    value is enough to make an extraction wrong, so the minimum, not the mean, is the signal).
    """

    request_id: str
    engine: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, restored from a prefix cache instead of computed
    token_confidences: list[float] = field(default_factory=list)
    confidence: float = 1.0
    confidence_kind: str = "min_token_probability"
    forwards: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_forwards: int = 0  # forwards of a speculative draft model (not counted in `forwards`)
    timings: Timings = field(default_factory=Timings)
    # The answer's length as the tokenizer writes `text`, where `token_ids` is not that: a filled
    # schema template tokenized its fixed pieces and its values apart (about 15% more ids), and
    # usage, tokens/s and $/Mtok must count what an AR engine would have written.
    text_tokens: int | None = None
    # True when the model generated an end token that ended the answer. `token_ids` and `text`
    # leave it out, but it cost a forward like any other token.
    ended_by_end_token: bool = False
    # One per `token_ids` entry when the request asked for logprobs (`SamplingParams.logprobs`), else None.
    logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        """The generated tokens, the end token included when the model generated one (as vLLM and
        llama.cpp count them; docs/gateway.md, "Token counts"): a stop string's, a grammar's or a
        length limit's end has none."""
        written = len(self.token_ids) if self.text_tokens is None else self.text_tokens
        return written + int(self.ended_by_end_token)

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / self.forwards if self.forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        if not self.draft_tokens_proposed:
            return None
        return self.draft_tokens_accepted / self.draft_tokens_proposed


@dataclass(frozen=True)
class StreamChunk:
    """Text committed since the previous chunk; the last chunk carries the Completion."""

    text: str
    token_ids: list[int]
    completion: Completion | None = None
    logprobs: list[TokenLogprob] | None = None  # of `token_ids`, when the request asked for them


@runtime_checkable
class Engine(Protocol):
    """An engine completes batches of requests and can stream one."""

    name: str
    kind: str  # "ar" | "diffusion" | "remote"

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]: ...

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]: ...
