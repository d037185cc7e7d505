"""Outcomes -> OpenAI response objects and server-sent-event chunks.

The `model` field echoes what the client asked for (`nowait`, or an engine's name); which engine
answered is in the `x-nowait-route` header and the `nowait` object, with the reason, whether a
fallback ran, the confidence and the cost of every engine tried.
"""

from __future__ import annotations

import json

from nowait.gateway.dispatch import Outcome
from nowait.gateway.errors import APIError
from nowait.gateway.logprobs import LogprobEntry, chat_logprobs, completion_logprobs, delta_logprobs
from nowait.gateway.low_confidence import LOW_CONFIDENCE_HEADER
from nowait.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    EngineAttempt,
    NowaitInfo,
    PromptTokensDetails,
    TextCompletion,
    Usage,
)

ROUTE_HEADER = "x-nowait-route"


def answer_headers(outcomes: list[Outcome], request_id: str) -> dict[str, str]:
    """The route, the request id and, when any choice is below its engine's floor, the flag."""
    headers = {ROUTE_HEADER: outcomes[0].final.engine, "x-request-id": request_id}
    if any(o.flagged for o in outcomes):
        headers[LOW_CONFIDENCE_HEADER] = "true"
    return headers


def finish_reason(outcome: Outcome) -> str:
    reason = outcome.final.finish_reason
    return reason if reason in ("stop", "length") else "stop"


def nowait_info(outcomes: list[Outcome]) -> NowaitInfo:
    """The first choice's story, with the cost of every choice (what the request cost)."""
    first = outcomes[0]
    return NowaitInfo(
        route=first.final.engine, reason=first.reason, rule=first.decision.rule, fallback=first.fallback,
        confidence=first.final.confidence, cost_usd=sum(o.cost_usd for o in outcomes),
        low_confidence=any(o.flagged for o in outcomes),
        engines_tried=[EngineAttempt(engine=a.engine, seconds=round(a.seconds, 6), prompt_tokens=a.prompt_tokens,
                                     completion_tokens=a.completion_tokens, confidence=a.confidence,
                                     cost_usd=a.cost_usd, outcome=a.outcome, forwards=a.forwards)
                       for a in first.attempts])


def usage(outcomes: list[Outcome], prompts: int = 1) -> Usage:
    """Output tokens of every choice; prompt tokens once per prompt (choices share their prompt)."""
    per_prompt = max(1, len(outcomes) // max(1, prompts))
    prompt = sum(o.final.prompt_tokens for o in outcomes[::per_prompt])
    cached = sum(o.final.cached_prompt_tokens for o in outcomes[::per_prompt])
    completion = sum(o.final.completion_tokens for o in outcomes)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def chat_completion(response_id: str, model: str, outcomes: list[Outcome]) -> ChatCompletion:
    return ChatCompletion(
        id=response_id, model=model, usage=usage(outcomes), nowait=nowait_info(outcomes),
        choices=[ChatChoice(index=i, message=AssistantMessage(content=o.final.text), finish_reason=finish_reason(o),
                            logprobs=None if o.final.logprobs is None else chat_logprobs(o.final.logprobs))
                 for i, o in enumerate(outcomes)])


def text_completion(response_id: str, model: str, outcomes: list[Outcome], prompts: int) -> TextCompletion:
    return TextCompletion(
        id=response_id, model=model, usage=usage(outcomes, prompts), nowait=nowait_info(outcomes),
        choices=[CompletionChoice(index=i, text=o.final.text, finish_reason=finish_reason(o),
                                  logprobs=None if o.final.logprobs is None else completion_logprobs(o.final.logprobs))
                 for i, o in enumerate(outcomes)])


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkWriter:
    """The chunks of one streamed choice, chat or completions shaped."""

    def __init__(self, endpoint: str, response_id: str, model: str, include_usage: bool) -> None:
        self.endpoint, self.response_id, self.model, self.include_usage = endpoint, response_id, model, include_usage

    def _chunk(self, text: str | None, finish: str | None = None, role: bool = False,
               info: NowaitInfo | None = None, logprobs: list[LogprobEntry] | None = None) -> dict:
        if self.endpoint == "chat":
            delta = ChatDelta(role="assistant" if role else None, content=text)
            chunk = ChatCompletionChunk(id=self.response_id, model=self.model, nowait=info,
                                        choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish)])
        else:
            chunk = TextCompletion(id=self.response_id, model=self.model, nowait=info,
                                   choices=[CompletionChoice(index=0, text=text or "", finish_reason=finish)])
        out = chunk.model_dump(exclude_none=True) | ({"usage": None} if self.include_usage else {})
        if logprobs is not None:  # set after the dump, which would drop chat's "refusal": null
            shape = chat_logprobs if self.endpoint == "chat" else completion_logprobs
            out["choices"][0]["logprobs"] = shape(logprobs)
        return out

    def opening(self) -> list[str]:
        """Chat streams open with the assistant role and no content (as OpenAI's do)."""
        return [sse(self._chunk("", role=True))] if self.endpoint == "chat" else []

    def delta(self, text: str) -> str:
        """One chunk; a delta with logprobs (`TextWithLogprobs`) carries those of its tokens."""
        return sse(self._chunk(str(text), logprobs=delta_logprobs(text)))

    def closing(self, outcome: Outcome) -> list[str]:
        finish = self._chunk(None, finish=finish_reason(outcome), info=nowait_info([outcome]))
        if self.endpoint == "chat":
            finish["choices"][0]["delta"] = {}
        out = [sse(finish)]
        if self.include_usage:
            object_name = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
            out.append(sse({"id": self.response_id, "object": object_name, "created": finish["created"],
                            "model": self.model, "choices": [], "usage": usage([outcome]).model_dump()}))
        return out

    def failure(self, error: APIError) -> list[str]:
        return [sse(error.body())]

    def end(self) -> list[str]:
        """`data: [DONE]`, however the stream ended (OpenAI's clients wait for it)."""
        return [SSE_DONE]
