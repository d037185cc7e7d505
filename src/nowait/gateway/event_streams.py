"""A generation streamed as server-sent events: the one path every streaming route takes
(`/v1/chat/completions`, `/v1/completions`, `/v1/responses`), so each holds a stream slot
(`server.max_concurrent_streams`), is dropped when its client stops reading
(`server.stream_stall_timeout_s`) and cancels its engine work when its client hangs up, the same
way. What differs between routes is only the shape of the events, an `EventEncoder`'s job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import suppress
from typing import Protocol, TypeVar

from fastapi import Request

from nowait.gateway.dispatch import Outcome
from nowait.gateway.domain import Call
from nowait.gateway.errors import APIError
from nowait.gateway.low_confidence import LOW_CONFIDENCE_HEADER
from nowait.gateway.responses import ROUTE_HEADER
from nowait.gateway.service import Gateway, gateway_of
from nowait.gateway.stream_slots import SlotStreamingResponse, StreamSlots

log = logging.getLogger("nowait.gateway")
T = TypeVar("T")

DISCONNECT_POLL_S = 0.5


class EventEncoder(Protocol):
    """The events of one streamed answer, in the shape of one API."""

    def opening(self) -> Iterable[str]: ...

    def delta(self, text: str) -> str: ...

    def closing(self, outcome: Outcome) -> Iterable[str]: ...

    def failure(self, error: APIError) -> Iterable[str]: ...

    def end(self) -> Iterable[str]: ...


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client hangs up first, cancel it (its engine work stops at the next step)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with suppress(asyncio.CancelledError, APIError):
                await task
            gone = APIError(499, "client closed the request", code="cancelled")
            gone.accounted = True  # the dispatcher logged and counted the cancellation
            raise gone


def stream_slots_of(request: Request) -> StreamSlots:
    """The app's one StreamSlots, made on first use from the server's config."""
    state = request.app.state
    if getattr(state, "stream_slots", None) is None:
        state.stream_slots = StreamSlots(gateway_of(request).config.server.max_concurrent_streams)
    return state.stream_slots


async def event_stream(request: Request, gateway: Gateway, call: Call, encoder: EventEncoder,
                       response_id: str) -> SlotStreamingResponse:
    """The call's answer as a stream of `encoder`'s events. A refusal (no slot, a bad request, a
    full queue) is still an HTTP error here; a held stream (a fast attempt that may fall back)
    runs to its end before the first byte, and a client that hangs up meanwhile cancels it."""
    release = stream_slots_of(request).take()
    try:
        plan = await unless_disconnected(request, gateway.dispatcher.open_stream(call))
    except BaseException:
        release()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for event in encoder.opening():
                yield event
            async for text in plan.deltas():
                yield encoder.delta(text)
            for event in encoder.closing(plan.outcome):
                yield event
        except APIError as error:  # after the first byte, an error can only be an event
            for event in encoder.failure(error):
                yield event
        except Exception as error:  # a bug must still end the stream cleanly, with an error event
            log.exception("stream %s failed", response_id)
            for event in encoder.failure(APIError(500, f"internal error ({type(error).__name__})",
                                                  type="server_error", code="internal_error")):
                yield event
        finally:
            release()
            await plan.aclose()
        for event in encoder.end():
            yield event

    headers = {ROUTE_HEADER: plan.route, "cache-control": "no-cache", "x-request-id": response_id}
    if plan.outcome.flagged:  # a held stream, answered before its first byte (a relayed one: its final chunk)
        headers[LOW_CONFIDENCE_HEADER] = "true"
    return SlotStreamingResponse(events(), release=release, media_type="text/event-stream",
                                 stall_timeout_s=gateway.config.server.stream_stall_timeout_s, headers=headers)
