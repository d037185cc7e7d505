"""Owned engines behind the gateway: one thread per engine, fed by many HTTP clients at once.

The engines are not thread-safe and their loops are synchronous (one `step` is one forward), so
each runs in a thread of its own that owns it. HTTP handlers on the event loop hand the thread
`Ticket`s and await events the thread posts back (`loop.call_soon_threadsafe`):

- AR and speculative engines are driven with `submit`/`step`: every step admits whatever arrived
  since the last one, so requests from many clients share forwards (continuous batching), and a
  cancelled request leaves at the next step boundary.
- The diffusion engine has no `submit`/`step` (see the report on engine changes); the thread runs
  it in waves of up to `max_batch` requests through `generate`, and a request alone in its wave
  streams block by block through `stream`. Requests arriving mid-wave wait for the next one.

Back-pressure is counted on the event loop: at most `capacity + max_queue` requests per engine
are accepted, and the next one gets 429 with a Retry-After estimated from recent service times.
Each step's wall time is split evenly among the sequences that held a cache row during it; that
share is what the ledger charges a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

from nowait import paths
from nowait.checkpoints import CheckpointError, LoadedModel, load_pretrained
from nowait.conventions import ModelConventions, apply_chat_template, encode_prompt
from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.ar.sequence import Sequence
from nowait.engines.base import Completion, GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.diffusion.request import DiffusionOptions
from nowait.engines.speculative import IncompatibleDraftError, SpeculativeEngine, build_drafter
from nowait.gateway.config import ArEngineConfig, DiffusionEngineConfig, SpecEngineConfig
from nowait.gateway.domain import Attempt, Call
from nowait.gateway.errors import APIError, bad_request, engine_unavailable, queue_full, timed_out
from nowait.gateway.ledger import owned_cost_usd
from nowait.gateway.metrics import EngineStats
from nowait.gateway.prompts import ANY_OBJECT, chat_prompt
from nowait.router import DataClass
from nowait.tokenizer import TextCodec

if TYPE_CHECKING:
    from nowait.engines.structured.grammar import GrammarCompiler

log = logging.getLogger("nowait.gateway")

# A diffusion engine cannot lay a template over a schema it cannot slot (nested objects, arrays):
# the dispatcher may then re-run the request on AR instead of refusing it.
SCHEMA_UNSUPPORTED = "schema_not_supported_by_engine"


@dataclass(frozen=True)
class Event:
    kind: str  # accepted | delta | done | failed
    text: str = ""
    completion: Completion | None = None
    error: BaseException | None = None


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

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def invalid(error: InvalidRequestError, where: str) -> APIError:
    message = str(error)
    if message.startswith("schema"):
        return APIError(400, message, param="response_format", code=SCHEMA_UNSUPPORTED)
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
                log.exception("engine %s failed; failing its requests", self.name)
                self._fail_everything(APIError(500, f"engine {self.name!r} failed: {error}", type="server_error",
                                               code="engine_error"))
                busy = False
            if not busy:
                self._wake.wait(0.5)
                self._wake.clear()

    def _intake(self) -> None:
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

    def _fail_everything(self, error: APIError) -> None:
        raise NotImplementedError

    def _finish(self, ticket: Ticket, completion: Completion) -> None:
        if ticket.stream:
            rest = completion.text[len(ticket.sent_text):] if completion.text.startswith(ticket.sent_text) else ""
            if rest:
                ticket.emit(Event("delta", rest))
        ticket.emit(Event("done", completion=completion))


class ArWorker(EngineWorker):
    """Drives an `AutoregressiveEngine` (or `SpeculativeEngine`) step by step."""

    engine: AutoregressiveEngine

    def __init__(self, name: str, engine: AutoregressiveEngine, codec: TextCodec, stats: EngineStats) -> None:
        super().__init__(name, engine, codec, stats)
        self._active: dict[int, Ticket] = {}

    def running(self) -> int:
        return len(self.engine.scheduler.running)

    def _intake(self) -> None:
        while self._inbox:
            ticket = self._inbox.popleft()
            if ticket.cancelled.is_set():
                continue
            try:
                ticket.seq = self.engine.submit(ticket.request)
            except Exception as error:  # one request's failure is that request's alone
                ticket.emit(Event("failed", error=self._refusal(error, ticket)))
                continue
            self._active[ticket.seq.seq_id] = ticket
            ticket.emit(Event("accepted"))

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
            ticket.emit(Event("delta", text[len(ticket.sent_text): upto]))
            ticket.sent_text = text[:upto]
        ticket.sent_tokens = len(ids)

    def _fail_everything(self, error: APIError) -> None:
        for ticket in self._active.values():
            ticket.emit(Event("failed", error=error))
            try:  # free its cache row, so the failure does not also shrink the engine
                self._abort(ticket.seq)
            except Exception:
                log.exception("engine %s: could not release a failed sequence", self.name)
        self._active.clear()


class DiffusionWorker(EngineWorker):
    """Runs a `DiffusionEngine` in waves of up to `max_batch` requests."""

    engine: DiffusionEngine

    def __init__(self, name: str, engine: DiffusionEngine, codec: TextCodec, stats: EngineStats) -> None:
        super().__init__(name, engine, codec, stats)
        self._pending: list[Ticket] = []
        self._wave: list[Ticket] = []

    def running(self) -> int:
        return len(self._wave)

    def _intake(self) -> None:
        while self._inbox:
            ticket = self._inbox.popleft()
            if ticket.cancelled.is_set():
                continue
            try:
                self.engine.plan(ticket.request)  # refuse before it joins a wave
            except Exception as error:  # one request's failure is that request's alone
                ticket.emit(Event("failed", error=self._refusal(error, ticket)))
                continue
            self._pending.append(ticket)
            ticket.emit(Event("accepted"))

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
                ticket.emit(Event("delta", chunk.text))
                ticket.sent_text += chunk.text
        return None

    def _fail_everything(self, error: APIError) -> None:
        for ticket in self._wave + self._pending:
            ticket.emit(Event("failed", error=error))
        self._wave, self._pending = [], []


class OwnedBackend:
    """An owned engine as the dispatcher sees it: prompts in, Attempts out, on the event loop."""

    owned = True
    available = True
    unavailable_reason = ""

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
                                  seed=s.seed)
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
                       cost_usd=owned_cost_usd(ticket.compute_s, self.node_usd_per_hour))

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
                    yield event.text
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


# --- building owned engines from the config ---


class ModelCache:
    """Checkpoints loaded once per (path, dtype, device): `ar` and `spec` share the target's weights."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str, str], LoadedModel] = {}

    def load(self, model: str, dtype: str, device: str) -> LoadedModel:
        path = paths.model_dir(model)
        key = (str(Path(path).resolve()), dtype, device)
        if key not in self._loaded:
            try:
                self._loaded[key] = load_pretrained(path, dtype=dtype, device=device)
            except CheckpointError as error:
                hint = f" (train it with `nowait train {model}`)" if model in paths.DEMO_MODELS else ""
                raise CheckpointError(f"{error}{hint}") from None
        return self._loaded[key]


def _grammar(loaded: LoadedModel) -> GrammarCompiler:
    from nowait.engines.structured.grammar import GrammarCompiler  # llguidance only when structured output is on

    return GrammarCompiler.from_codec(loaded.codec, vocab_size=loaded.model.config.vocab_size,
                                      end_id=loaded.conventions.end_id)


def build_owned(name: str, spec: ArEngineConfig | SpecEngineConfig | DiffusionEngineConfig, cache: ModelCache,
                window_s: float, default_max_tokens: int) -> OwnedBackend | UnavailableBackend:
    """Load one owned engine; a missing or unsuitable model gives an UnavailableBackend and a warning."""
    try:
        loaded = cache.load(spec.model, spec.dtype, spec.device)
        stats = EngineStats(window_s, spec.node_usd_per_hour)
        if isinstance(spec, DiffusionEngineConfig):
            engine = DiffusionEngine(loaded.model, loaded.codec, DiffusionOptions(**spec.options),
                                     max_batch=spec.max_batch, name=name, end_ids=loaded.conventions.end_ids)
            worker: EngineWorker = DiffusionWorker(name, engine, loaded.codec, stats)
            return OwnedBackend(name, spec.kind, worker, loaded.codec, loaded.model.config.max_position,
                                spec.max_batch, spec.max_queue, spec.node_usd_per_hour, default_max_tokens,
                                conventions=loaded.conventions)
        config = EngineConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                              max_model_len=spec.max_model_len, prefix_cache_tokens=spec.prefix_cache_tokens)
        grammar = _grammar(loaded) if spec.structured else None
        if isinstance(spec, SpecEngineConfig):
            engine = _speculative_engine(spec, loaded, cache, config, grammar)
        else:
            engine = AutoregressiveEngine(loaded.model, loaded.codec, config, grammar=grammar,
                                          end_ids=loaded.conventions.end_ids)
        engine.name = name
        worker = ArWorker(name, engine, loaded.codec, stats)
        return OwnedBackend(name, spec.kind, worker, loaded.codec, engine.max_model_len, spec.max_num_seqs,
                            spec.max_queue, spec.node_usd_per_hour, default_max_tokens,
                            conventions=loaded.conventions)
    except (CheckpointError, IncompatibleDraftError, ValueError) as error:
        log.warning("engine %r is not available: %s", name, error)
        return UnavailableBackend(name, spec.kind, str(error), window_s)


def _speculative_engine(spec: SpecEngineConfig, loaded: LoadedModel, cache: ModelCache, config: EngineConfig,
                        grammar: GrammarCompiler | None) -> SpeculativeEngine:
    """The target with its draft (methods hybrid and draft) or diffusion drafter (method
    diffusion). The draft's tokenizer goes in too, so a draft trained with another tokenizer of
    the same size is refused (IncompatibleDraftError) instead of proposing tokens that mean
    something else to the target: every proposal would be rejected and the engine would run
    slower than plain AR."""
    speculative = spec.speculative_config()
    draft = None
    if speculative.uses_draft or speculative.uses_drafter:
        try:
            draft = cache.load(spec.draft_model, spec.dtype, spec.device)
        except CheckpointError as error:
            raise CheckpointError(f"draft model: {error}") from None
    try:
        if speculative.uses_drafter:
            drafter = build_drafter(draft.model, draft.codec, spec.max_num_seqs, draft.conventions.end_ids)
            return SpeculativeEngine(loaded.model, loaded.codec, config, drafter=drafter, grammar=grammar,
                                     speculative=speculative, end_ids=loaded.conventions.end_ids)
        return SpeculativeEngine(loaded.model, loaded.codec, config, draft=draft.model if draft else None,
                                 draft_codec=draft.codec if draft else None, grammar=grammar,
                                 speculative=speculative, end_ids=loaded.conventions.end_ids)
    except IncompatibleDraftError as error:
        name = spec.draft_model
        hint = f" (`nowait train {name}`)" if name in paths.DEMO_MODELS else ""
        message = (f"draft {name!r} cannot serve model {spec.model!r}: {error}. Use a draft trained with the "
                   f"target's tokenizer{hint}, or method: ngram (no draft)")
        raise IncompatibleDraftError(message) from None
