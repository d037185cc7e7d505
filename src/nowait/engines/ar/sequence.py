"""One request's life inside an engine: its tokens, where its keys/values are, its counters.

A `Sequence` is what the scheduler queues and the model runner batches; the engine turns it
into a `Completion` when it finishes. It knows nothing about tensors beyond its own generator.
"""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from nowait.engines.base import Completion, FinishReason, GenerationRequest, Timings, TokenLogprob

if TYPE_CHECKING:
    from nowait.engines.ar.prompt_lookup import PromptLookup
    from nowait.engines.structured.grammar import SchemaMatcher


class SequenceStatus(Enum):
    WAITING = auto()  # queued, no cache row yet
    RUNNING = auto()  # holds a cache row: prefilling or decoding
    FINISHED = auto()


class Sequence:
    """Prompt and output ids of one request plus the bookkeeping the engine needs.

    `num_cached` counts this sequence's tokens whose keys/values sit in the target's cache.
    While `num_cached < prompt length` it is prefilling; afterwards the cache holds every token
    but the last one sampled (`last_token`), which the next forward feeds in.
    """

    def __init__(self, seq_id: int, request: GenerationRequest, stop_ids: frozenset[int], capacity: int,
                 generator: torch.Generator | None, matcher: SchemaMatcher | None = None) -> None:
        self.seq_id = seq_id
        self.request = request
        self.prompt_ids = list(request.prompt_ids)
        self.stop_ids = stop_ids
        self.max_tokens = request.sampling.max_tokens
        self.capacity = capacity  # prompt + output may not exceed this (cache row / model positions)
        self.generator = generator  # None: greedy, no randomness consumed
        self.matcher = matcher
        self.status = SequenceStatus.WAITING
        self.output_ids: list[int] = []
        self.token_confidences: list[float] = []
        self.stop_confidence: float | None = None  # the probability of the stop token, when one ended it
        # One per output token when the request asked for logprobs, else None.
        self.token_logprobs: list[TokenLogprob] | None = [] if request.sampling.logprobs is not None else None
        self.num_cached = 0
        self.cached_prompt_tokens = 0  # prompt tokens restored from the prefix cache, not computed
        self.row = -1  # cache row while RUNNING
        self.forwards = 0
        self.draft_forwards = 0
        self.draft_cached = 0  # tokens in the draft model's cache (speculative engine)
        self.draft_proposed = 0
        self.draft_accepted = 0
        self.prompt_lookup: PromptLookup | None = None  # speculative engine's n-gram index of the tokens
        # Speculative method diffusion: the drafted answer being verified, and where the output
        # stands in it (draft index minus output index).
        self.draft_answer: list[int] | None = None
        self.draft_shift = 0
        self.grammar_mask_s = 0.0
        self.finish_reason: FinishReason | None = None
        self.admitted_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.name}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}, cached={self.num_cached})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def remaining_tokens(self) -> int:
        """Tokens this sequence may still emit before `max_tokens` or its capacity."""
        return min(self.max_tokens - len(self.output_ids), self.capacity - self.num_tokens)

    def token_at(self, index: int) -> int:
        """Token `index` of prompt + output."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[index] if index < prompt else self.output_ids[index - prompt]

    def tokens_from(self, start: int) -> list[int]:
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt:]
        return self.prompt_ids[start:] + self.output_ids

    def logprobs_from(self, start: int) -> list[TokenLogprob] | None:
        """The logprobs of output tokens `start` on (None when the request did not ask)."""
        return None if self.token_logprobs is None else self.token_logprobs[start:]

    def append_token(self, token: int, confidence: float, now: float, logprob: TokenLogprob | None = None) -> bool:
        """Record one sampled token; True when the sequence is now finished.

        A stop token ends the sequence and is not part of the output (as in `greedy_decode`).
        A grammar that has closed its JSON value ends it too: only the end token could follow.
        """
        if self.first_token_time is None:
            self.first_token_time = now
        if token in self.stop_ids:
            self.stop_confidence = confidence
            self.finish("stop", now)
            return True
        self.output_ids.append(token)
        self.token_confidences.append(confidence)
        if self.token_logprobs is not None and logprob is not None:
            self.token_logprobs.append(logprob)
        if self.matcher is not None:
            self.matcher.consume(token)
            if self.matcher.is_stopped():
                self.finish("stop", now)
                return True
        if self.remaining_tokens <= 0:
            self.finish("length", now)
            return True
        return False

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter() if now is None else now

    def to_completion(self, engine: str, text: str) -> Completion:
        arrival = self.request.arrival_time
        finish = self.finish_time if self.finish_time is not None else time.perf_counter()
        admitted = self.admitted_time if self.admitted_time is not None else finish
        first = self.first_token_time if self.first_token_time is not None else finish
        confidences = list(self.token_confidences)
        # Where the answer stops is a decision too (as the diffusion engine counts its end token).
        deciding = confidences if self.stop_confidence is None else [*confidences, self.stop_confidence]
        return Completion(
            request_id=self.request.request_id or str(self.seq_id),
            engine=engine,
            token_ids=list(self.output_ids),
            text=text,
            finish_reason=self.finish_reason or "error",
            prompt_tokens=len(self.prompt_ids),
            cached_prompt_tokens=self.cached_prompt_tokens,
            token_confidences=confidences,
            confidence=min(deciding, default=1.0),
            confidence_kind="min_token_probability",
            forwards=self.forwards,
            draft_tokens_proposed=self.draft_proposed,
            draft_tokens_accepted=self.draft_accepted,
            draft_forwards=self.draft_forwards,
            ended_by_end_token=self.stop_confidence is not None,
            logprobs=None if self.token_logprobs is None else list(self.token_logprobs),
            timings=Timings(queued_s=admitted - arrival, first_token_s=first - arrival, total_s=finish - arrival,
                            grammar_mask_s=self.grammar_mask_s),
        )
