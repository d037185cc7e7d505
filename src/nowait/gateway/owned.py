"""Owned engines as the dispatcher sees them (`OwnedBackend`): prompts in, Attempts out, on the
event loop, with an engine worker thread (workers.py) behind each; and `UnavailableBackend`, a
configured engine that cannot serve.

Back-pressure is counted on the event loop: at most `capacity + max_queue` requests per engine
are accepted, and the next one gets 429 with a Retry-After estimated from recent service times.
A run past its timeout, or whose client went away, is cancelled in its worker.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import NoReturn

from nowait.conventions import ModelConventions, apply_chat_template, encode_prompt
from nowait.engines.base import Completion, GenerationRequest, SamplingParams
from nowait.gateway.domain import Attempt, Call
from nowait.gateway.engine_stats import EngineStats
from nowait.gateway.errors import APIError, bad_request, engine_unavailable, queue_full, timed_out
from nowait.gateway.ledger import owned_cost_usd
from nowait.gateway.logprobs import StreamLogprobs, TextWithLogprobs, TokenTexts, answer_entries
from nowait.gateway.prompts import ANY_OBJECT, chat_prompt
from nowait.gateway.workers import EngineWorker, Event, Ticket
from nowait.router import DataClass
from nowait.tokenizer import TextCodec


class OwnedBackend:
    """An owned engine as the dispatcher sees it: prompts in, Attempts out, on the event loop."""

    owned = True
    available = True
    unavailable_reason = ""
    logprobs = True  # the engines compute them (`nowait.engines.logprobs`)

    def __init__(self, name: str, kind: str, worker: EngineWorker, codec: TextCodec, max_model_len: int,
                 capacity: int, max_queue: int, node_usd_per_hour: float, default_max_tokens: int,
                 conventions: ModelConventions | None = None) -> None:
        """`conventions`: the checkpoint's (chat template, end ids); None or a demo checkpoint's:
        prompts take the demo models' trained shape (`nowait.gateway.prompts.chat_prompt`)."""
        self.name, self.kind, self.worker, self.codec = name, kind, worker, codec
        self.conventions = conventions
        self.max_model_len, self.capacity, self.max_queue = max_model_len, capacity, max_queue
        self.node_usd_per_hour = node_usd_per_hour
        self.default_max_tokens = default_max_tokens
        self.stats = worker.stats
        self.in_flight = 0  # accepted and not yet answered (event loop only)
        self.token_texts = TokenTexts(codec)

    def may_receive(self, data_class: DataClass) -> bool:
        return True  # inside the building

    def running(self) -> int:
        return min(self.worker.running(), self.in_flight)

    def waiting(self) -> int:
        return max(0, self.in_flight - self.running())

    async def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.worker.stop)

    # --- requests in ---

    def prompt_ids(self, call: Call) -> list[int]:
        if isinstance(call.prompt, list):
            return list(call.prompt)
        conventions = self.conventions
        if conventions is None or conventions.nowait_prompt:
            text = chat_prompt(call.messages) if call.endpoint == "chat" else call.prompt or ""
            return self.codec.encode(text)
        if call.endpoint != "chat":
            return encode_prompt(self.codec, call.prompt or "", templated=False)
        try:  # a real checkpoint: its own chat template, as its model was fine-tuned on
            text = apply_chat_template(conventions, call.messages)
        except ValueError as error:
            raise bad_request(f"messages: {error}", param="messages", code="chat_template_failed") from None
        return encode_prompt(self.codec, text, templated=True)

    def generation_request(self, call: Call) -> GenerationRequest:
        """Tokenize and check a call against this engine's context, or raise a 400 naming the field."""
        where = "messages" if call.endpoint == "chat" else "prompt"
        ids = self.prompt_ids(call)
        if not ids:
            raise bad_request(f"{where} is empty: the model needs at least one token to continue", param=where)
        room = self.max_model_len - len(ids)
        limit = call.sampling.max_tokens
        if room <= 0 or (limit is not None and limit > room):
            wanted = f" plus {limit} output tokens" if limit is not None else ""
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your {where} resulted in {len(ids)} tokens{wanted}. Please reduce the length of "
                                f"the {where}{' or max_tokens' if limit is not None else ''}.",
                           param="max_tokens" if room > 0 else where, code="context_length_exceeded")
        s = call.sampling
        # The engine stops on every end id of the checkpoint itself (built with its end_ids).
        sampling = SamplingParams(max_tokens=limit if limit is not None else min(self.default_max_tokens, room),
                                  temperature=s.temperature or 0.0, top_p=s.top_p or 1.0, top_k=s.top_k or 0,
                                  seed=s.seed, logprobs=call.logprobs)
        schema = call.schema
        if self.kind == "diffusion" and schema == ANY_OBJECT:
            schema = None  # no template for "any object": decode free-form, the dispatcher checks the JSON
        draft = self.codec.encode(call.draft_text) if call.draft_text and self.kind == "spec" else None
        return GenerationRequest(ids, sampling, schema=schema, request_id=call.request_id, draft_ids=draft)

    @property
    def admits(self) -> int:
        return self.capacity + self.max_queue

    def _reserve(self) -> None:
        if self.in_flight >= self.admits:
            per_request = self.stats.mean_request_s or 1.0
            retry = math.ceil(per_request * max(1, self.waiting()) / self.capacity)
            raise queue_full(self.name, min(60, max(1, retry)))
        self.in_flight += 1

    def _release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self.in_flight -= 1

    def _cancel(self, ticket: Ticket) -> None:
        ticket.cancelled.set()
        self.worker.poke()
        self._release(ticket)

    def _submit(self, call: Call, stream: bool) -> Ticket:
        request = self.generation_request(call)
        self._reserve()
        ticket = Ticket(request, stream, call.sampling.stop, asyncio.get_running_loop(),
                        "messages" if call.endpoint == "chat" else "prompt")
        if stream and call.logprobs is not None:
            ticket.logprobs = StreamLogprobs(self.token_texts)
        self.worker.put(ticket)
        return ticket

    def attempt(self, ticket: Ticket, completion: Completion) -> Attempt:
        t = completion.timings
        self.stats.record_request(t.total_s)
        return Attempt(engine=self.name, text=completion.text, finish_reason=completion.finish_reason,
                       prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
                       cached_prompt_tokens=completion.cached_prompt_tokens,
                       confidence=completion.confidence, seconds=t.total_s, queued_s=t.queued_s,
                       first_token_s=t.first_token_s if completion.completion_tokens else None,
                       compute_s=ticket.compute_s, forwards=completion.forwards,
                       cost_usd=owned_cost_usd(ticket.compute_s, self.node_usd_per_hour),
                       logprobs=answer_entries(self.token_texts, completion.logprobs, completion.text))

    # --- the two ways to run ---

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        ticket = self._submit(call, stream=False)
        try:
            return await asyncio.wait_for(self._until_done(ticket), timeout_s)
        except asyncio.TimeoutError:
            self._cancel(ticket)
            raise timed_out(self.name, timeout_s) from None
        except BaseException:  # the client went away (CancelledError) or the engine refused
            self._cancel(ticket)
            raise
        finally:
            self._release(ticket)

    async def _until_done(self, ticket: Ticket) -> Attempt:
        while True:
            event = await ticket.events.get()
            if event.kind == "failed":
                raise event.error
            if event.kind == "done":
                return self.attempt(ticket, event.completion)

    async def open_stream(self, call: Call, timeout_s: float) -> OwnedStream:
        """Returns once the engine accepted the request, so a refusal is still an HTTP error."""
        ticket = self._submit(call, stream=True)
        deadline = time.monotonic() + timeout_s
        try:
            event = await asyncio.wait_for(ticket.events.get(), timeout_s)
        except asyncio.TimeoutError:
            self._cancel(ticket)
            raise timed_out(self.name, timeout_s) from None
        except BaseException:
            self._cancel(ticket)
            raise
        if event.kind == "failed":
            self._release(ticket)
            raise event.error
        return OwnedStream(self, ticket, deadline, timeout_s, first=event)


class OwnedStream:
    """The text deltas of one owned-engine request; closing it early cancels the request."""

    def __init__(self, backend: OwnedBackend, ticket: Ticket, deadline: float, timeout_s: float,
                 first: Event) -> None:
        self.backend, self.ticket, self.deadline, self.timeout_s = backend, ticket, deadline, timeout_s
        self._first: Event | None = first if first.kind != "accepted" else None
        self.attempt: Attempt | None = None

    async def deltas(self) -> AsyncIterator[str]:
        try:
            while True:
                if self._first is not None:
                    event, self._first = self._first, None
                else:
                    remaining = self.deadline - time.monotonic()
                    try:
                        event = await asyncio.wait_for(self.ticket.events.get(), max(0.0, remaining))
                    except asyncio.TimeoutError:
                        raise timed_out(self.backend.name, self.timeout_s) from None
                if event.kind == "delta":
                    yield event.text if event.logprobs is None else TextWithLogprobs(event.text, event.logprobs)
                elif event.kind == "done":
                    self.attempt = self.backend.attempt(self.ticket, event.completion)
                    return
                elif event.kind == "failed":
                    raise event.error
        finally:
            if self.attempt is None:
                self.backend._cancel(self.ticket)
            self.backend._release(self.ticket)

    async def aclose(self) -> None:
        if self.attempt is None:
            self.backend._cancel(self.ticket)


class UnavailableBackend:
    """A configured engine that cannot serve (its model is missing, its API key is not set):
    the gateway starts without it and answers requests for it with a clear 503."""

    owned = True
    available = False
    admits = 1  # nothing: every request gets 503

    def __init__(self, name: str, kind: str, reason: str, window_s: float, owned: bool = True) -> None:
        self.name, self.kind, self.unavailable_reason, self.owned = name, kind, reason, owned
        self.stats = EngineStats(window_s)

    def may_receive(self, data_class: DataClass) -> bool:
        return self.owned

    def running(self) -> int:
        return 0

    def waiting(self) -> int:
        return 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def run(self, call: Call, timeout_s: float) -> NoReturn:
        raise engine_unavailable(self.name, self.unavailable_reason)

    async def open_stream(self, call: Call, timeout_s: float) -> NoReturn:
        raise engine_unavailable(self.name, self.unavailable_reason)
