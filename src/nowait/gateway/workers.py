"""The threads that own the gateway's in-process engines, fed by many HTTP clients at once.

The engines are not thread-safe and their loops are synchronous (one `step` is one forward), so
each runs in a thread of its own that owns it. HTTP handlers on the event loop hand the thread
`Ticket`s and await events the thread posts back (`loop.call_soon_threadsafe`):

- AR and speculative engines are driven with `submit`/`step`: every step admits whatever arrived
  since the last one, so requests from many clients share forwards (continuous batching), and a
  cancelled request leaves at the next step boundary.
- The diffusion engine has no `submit`/`step` (see the report on engine changes); the thread runs
  it in waves of up to `max_batch` requests through `generate`, and a request alone in its wave
  streams block by block through `stream`. Requests arriving mid-wave wait for the next one.

Each step's wall time is split evenly among the sequences that held a cache row during it; that
share is what the ledger charges a request. The event-loop side (back-pressure, timeouts,
Attempts) is owned.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from nowait.engines.ar import AutoregressiveEngine
from nowait.engines.ar.sequence import Sequence
from nowait.engines.base import Completion, GenerationRequest, InvalidRequestError
from nowait.engines.diffusion import DiffusionEngine
from nowait.gateway.engine_stats import EngineStats
from nowait.gateway.errors import APIError, bad_request
from nowait.gateway.logprobs import LogprobEntry, StreamLogprobs
from nowait.tokenizer import TextCodec

log = logging.getLogger("nowait.gateway")

# A diffusion engine cannot lay a template over a schema it cannot slot (nested objects, arrays):
# the dispatcher may then re-run the request on AR instead of refusing it.
SCHEMA_UNSUPPORTED = "schema_not_supported_by_engine"
# An engine route that cannot give the logprobs asked for (a diffusion template's fixed pieces, a
# remote upstream): a routed request may re-run on the fallback engine, a pinned one gets the 400.
LOGPROBS_UNSUPPORTED = "logprobs_unsupported"


@dataclass(frozen=True)
class Event:
    kind: str  # accepted | delta | done | failed
    text: str = ""
    completion: Completion | None = None
    error: BaseException | None = None
    logprobs: list[LogprobEntry] | None = None  # a delta's tokens', when the request asked


class Ticket:
    """One request inside an engine thread, bridged to the event loop that awaits it."""

    def __init__(self, request: GenerationRequest, stream: bool, stop: tuple[str, ...],
                 loop: asyncio.AbstractEventLoop, where: str = "messages") -> None:
        self.request, self.stream, self.stop = request, stream, stop
        self.where = where  # the request field a refusal names (messages or prompt)
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.released = False  # its place in the engine's queue was given back (event loop only)
        # Worker-thread state.
        self.seq: Sequence | None = None
        self.compute_s = 0.0
        self.tokens_seen = 0
        self.sent_tokens = 0
        self.checked_tokens = 0
        self.sent_text = ""
        self.holdback = max((len(s) for s in stop), default=1) - 1  # a stop string may be half-written
        self.logprobs: StreamLogprobs | None = None  # set for a stream that asked for logprobs
        self.streamed_logprobs: list = []  # a diffusion stream's token logprobs so far

    def delta_logprobs(self, items: list | None, final: bool = False) -> list[LogprobEntry] | None:
        """The logprob entries the delta just added to `sent_text` carries (None: not asked)."""
        return None if self.logprobs is None else self.logprobs.take(items, len(self.sent_text), final)

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def invalid(error: InvalidRequestError, where: str) -> APIError:
    message = str(error)
    if message.startswith("schema"):
        return APIError(400, message, param="response_format", code=SCHEMA_UNSUPPORTED)
    if message.startswith("logprobs"):
        return APIError(400, message, param="logprobs", code=LOGPROBS_UNSUPPORTED)
    return bad_request(message, param=where)


def apply_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


class EngineWorker:
    """The thread that owns one engine; subclasses say how requests enter it and how it advances."""

    def __init__(self, name: str, engine, codec: TextCodec, stats: EngineStats) -> None:
        self.name, self.engine, self.codec, self.stats = name, engine, codec, stats
        self._inbox: deque[Ticket] = deque()
        self._wake = threading.Event()
        self._stopping = False
        # Steps that raised, the last one's error and when (unix seconds), for /readyz: the
        # thread keeps serving.
        self.failures = 0
        self.last_failure: str | None = None
        self.last_failure_at: int | None = None
        self._thread = threading.Thread(target=self._loop, name=f"nowait-engine-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    def put(self, ticket: Ticket) -> None:
        self._inbox.append(ticket)
        self._wake.set()

    def poke(self) -> None:
        """Wake the thread (a ticket was cancelled)."""
        self._wake.set()

    def alive(self) -> bool:
        """The thread runs: a fleet replica whose thread died fails its health check, and Ray
        replaces it (nothing else would ever answer its requests)."""
        return self._thread.is_alive()

    def running(self) -> int:
        raise NotImplementedError

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread; the engines never need it
        while not self._stopping:
            try:
                self._intake()
                self._drop_cancelled()
                busy = self._advance()
            except Exception as error:  # a bug must not leave clients waiting forever
                log.exception("engine %s failed a step; failing the requests in it", self.name)
                self.failures += 1
                self.last_failure = f"{type(error).__name__}: {error}"
                self.last_failure_at = int(time.time())
                self._fail_step(APIError(500, f"engine {self.name!r} failed: {error}", type="server_error",
                                         code="engine_error"))
                busy = False
            if not busy:
                self._wake.wait(0.5)
                self._wake.clear()

    def _intake(self) -> None:
        """Take every ticket that arrived: each is admitted, or refused alone."""
        while self._inbox:
            ticket = self._inbox.popleft()
            if ticket.cancelled.is_set():
                continue
            try:
                self._admit(ticket)
            except Exception as error:  # one request's failure is that request's alone
                ticket.emit(Event("failed", error=self._refusal(error, ticket)))
                continue
            ticket.emit(Event("accepted"))

    def _admit(self, ticket: Ticket) -> None:
        """Hand one ticket to the engine, or raise why it cannot take it."""
        raise NotImplementedError

    def _refusal(self, error: Exception, ticket: Ticket) -> APIError:
        """What a request refused at intake is told: the engine's reason for a bad request; for
        anything else a 500 that names the error, failing that request and no other."""
        if isinstance(error, InvalidRequestError):
            return invalid(error, ticket.where)
        log.exception("engine %s could not take a request", self.name)
        return APIError(500, f"engine {self.name!r} could not take the request: {error}", type="server_error",
                        code="engine_error")

    def _drop_cancelled(self) -> None:
        raise NotImplementedError

    def _advance(self) -> bool:
        """Do one unit of work; False when there was none."""
        raise NotImplementedError

    def _fail_step(self, error: APIError) -> None:
        """Fail the requests the step that raised was running; those still waiting for one keep
        their place (the engine's state for them was not touched). A step that raised before it
        ran any request fails every request the worker holds: the fault is nobody's in
        particular, and a fault that repeats must not leave the queue waiting for its timeout."""
        raise NotImplementedError

    def _finish(self, ticket: Ticket, completion: Completion) -> None:
        if ticket.stream:
            rest = completion.text[len(ticket.sent_text):] if completion.text.startswith(ticket.sent_text) else ""
            ticket.sent_text += rest
            entries = ticket.delta_logprobs(completion.logprobs, final=True)
            if rest or entries:
                ticket.emit(Event("delta", rest, logprobs=entries))
        ticket.emit(Event("done", completion=completion))


class ArWorker(EngineWorker):
    """Drives an `AutoregressiveEngine` (or `SpeculativeEngine`) step by step."""

    engine: AutoregressiveEngine

    def __init__(self, name: str, engine: AutoregressiveEngine, codec: TextCodec, stats: EngineStats) -> None:
        super().__init__(name, engine, codec, stats)
        self._active: dict[int, Ticket] = {}

    def running(self) -> int:
        return len(self.engine.scheduler.running)

    def _admit(self, ticket: Ticket) -> None:
        ticket.seq = self.engine.submit(ticket.request)
        self._active[ticket.seq.seq_id] = ticket

    def _drop_cancelled(self) -> None:
        for seq_id, ticket in list(self._active.items()):
            if ticket.cancelled.is_set():
                del self._active[seq_id]
                self._abort(ticket.seq)

    # The engine has no public way to end a sequence early or to collect a finished one outside
    # `generate`/`stream`; these two helpers are the only places that reach inside it.
    def _abort(self, seq: Sequence, reason: str = "cancelled") -> Completion | None:
        engine = self.engine
        if seq.is_finished:
            return engine._completed.pop(seq.seq_id, None)
        if engine.scheduler.abort_waiting(seq):
            seq.finish(reason)
            return seq.to_completion(self.name, self.codec.decode(seq.output_ids))
        seq.finish(reason)
        if seq.row < 0:  # admitted, but its step failed before it got a cache row: nothing to free
            engine.scheduler.retire([seq])
            return None
        engine._retire([seq])
        return engine._completed.pop(seq.seq_id, None)

    def _collect(self, seq: Sequence) -> Completion:
        return self.engine._completed.pop(seq.seq_id)

    def _advance(self) -> bool:
        engine = self.engine
        if not engine.has_unfinished():
            return False
        before = {s.seq_id for s in engine.scheduler.running}
        started = time.perf_counter()
        finished = engine.step()
        elapsed = time.perf_counter() - started
        held = before | {s.seq_id for s in engine.scheduler.running} | {s.seq_id for s in finished}
        share = elapsed / max(1, len(held))
        new_tokens = 0
        for seq_id in held:
            ticket = self._active.get(seq_id)
            if ticket is None:
                continue
            ticket.compute_s += share
            produced = len(ticket.seq.output_ids)
            new_tokens += produced - ticket.tokens_seen
            ticket.tokens_seen = produced
        self.stats.record(busy_s=elapsed, tokens=new_tokens)
        for seq in finished:
            ticket = self._active.pop(seq.seq_id, None)
            completion = self._collect(seq)
            if ticket is not None:
                self._finish(ticket, self._cut_at_stop(ticket, completion))
        for seq_id, ticket in list(self._active.items()):
            if ticket.stop and self._stop_reached(ticket):
                del self._active[seq_id]
            elif ticket.stream:
                self._send_progress(ticket)
        return True

    def _cut_at_stop(self, ticket: Ticket, completion: Completion) -> Completion:
        cut = apply_stop(completion.text, ticket.stop) if ticket.stop else None
        return completion if cut is None else replace(completion, text=completion.text[:cut], finish_reason="stop")

    def _stop_reached(self, ticket: Ticket) -> bool:
        """Stop strings: the engine knows only stop token ids, so the text is checked after each
        step and the sequence ended as soon as one appears."""
        seq = ticket.seq
        if len(seq.output_ids) == ticket.checked_tokens:
            return False
        ticket.checked_tokens = len(seq.output_ids)
        text = self.codec.decode(seq.output_ids)
        cut = apply_stop(text, ticket.stop)
        if cut is None:
            if ticket.stream:
                self._send_progress(ticket, text)
            return False
        completion = self._abort(seq, "stop")
        if completion is not None:
            self._finish(ticket, replace(completion, text=text[:cut], finish_reason="stop"))
        return True

    def _send_progress(self, ticket: Ticket, text: str | None = None) -> None:
        ids = ticket.seq.output_ids
        if len(ids) == ticket.sent_tokens:
            return
        text = self.codec.decode(ids) if text is None else text
        if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
            return
        upto = len(text) - ticket.holdback
        if upto > len(ticket.sent_text) and text.startswith(ticket.sent_text):
            piece, ticket.sent_text = text[len(ticket.sent_text): upto], text[:upto]
            ticket.emit(Event("delta", piece, logprobs=ticket.delta_logprobs(ticket.seq.token_logprobs)))
        ticket.sent_tokens = len(ids)

    def _fail_step(self, error: APIError) -> None:
        # The sequences holding a row were in the step (a prefill admits from the queue before
        # it runs); those still queued were not.
        held = {s.seq_id for s in self.engine.scheduler.running}
        in_step = {i for i, t in self._active.items() if i in held or t.seq.is_finished} or set(self._active)
        for seq_id, ticket in list(self._active.items()):
            if seq_id not in in_step:
                continue
            del self._active[seq_id]
            ticket.emit(Event("failed", error=error))
            try:  # free its cache row, so the failure does not also shrink the engine
                self._abort(ticket.seq)
            except Exception:
                log.exception("engine %s: could not release a failed sequence", self.name)


class DiffusionWorker(EngineWorker):
    """Runs a `DiffusionEngine` in waves of up to `max_batch` requests."""

    engine: DiffusionEngine

    def __init__(self, name: str, engine: DiffusionEngine, codec: TextCodec, stats: EngineStats) -> None:
        super().__init__(name, engine, codec, stats)
        self._pending: list[Ticket] = []
        self._wave: list[Ticket] = []

    def running(self) -> int:
        return len(self._wave)

    def _admit(self, ticket: Ticket) -> None:
        self.engine.plan(ticket.request)  # refuse before it joins a wave
        self._pending.append(ticket)

    def _drop_cancelled(self) -> None:
        self._pending = [t for t in self._pending if not t.cancelled.is_set()]

    def _advance(self) -> bool:
        if not self._pending:
            return False
        wave = self._pending[: self.engine.max_batch]
        del self._pending[: len(wave)]
        self._wave = wave
        started = time.perf_counter()
        if len(wave) == 1 and wave[0].stream and not wave[0].stop:
            completions = [self._stream_one(wave[0])]
        else:
            completions = self.engine.generate([t.request for t in wave])
        self._wave = []
        elapsed = time.perf_counter() - started
        self.stats.record(busy_s=elapsed, tokens=sum(c.completion_tokens for c in completions if c is not None))
        for ticket, completion in zip(wave, completions, strict=True):
            ticket.compute_s = elapsed / len(wave)
            if completion is None or ticket.cancelled.is_set():
                continue
            cut = apply_stop(completion.text, ticket.stop) if ticket.stop else None
            if cut is not None:
                completion = replace(completion, text=completion.text[:cut], finish_reason="stop")
            self._finish(ticket, completion)
        return True

    def _stream_one(self, ticket: Ticket) -> Completion | None:
        for chunk in self.engine.stream(ticket.request):
            if ticket.cancelled.is_set():
                return None
            if chunk.completion is not None:
                return chunk.completion
            if chunk.text:
                ticket.sent_text += chunk.text
                ticket.streamed_logprobs += chunk.logprobs or []
                ticket.emit(Event("delta", chunk.text, logprobs=ticket.delta_logprobs(ticket.streamed_logprobs)))
        return None

    def _fail_step(self, error: APIError) -> None:
        failed = self._wave or self._pending  # the pending ones run in the next wave
        for ticket in failed:
            ticket.emit(Event("failed", error=error))
        if failed is self._wave:
            self._wave = []
        else:
            self._pending = []
