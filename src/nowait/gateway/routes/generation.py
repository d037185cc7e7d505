"""`POST /v1/chat/completions` and `POST /v1/completions`: JSON answers, or server-sent events with
`stream: true`; a client that hangs up cancels its work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from nowait.gateway.calls import chat_calls, completion_calls, new_id, prompts_of
from nowait.gateway.dispatch import Outcome
from nowait.gateway.domain import Call
from nowait.gateway.errors import APIError
from nowait.gateway.responses import ROUTE_HEADER, SSE_DONE, ChunkWriter, chat_completion, sse, text_completion
from nowait.gateway.schemas import ChatCompletionRequest, CompletionRequest
from nowait.gateway.service import Gateway, gateway_of
from nowait.gateway.stream_slots import SlotStreamingResponse, StreamSlots

log = logging.getLogger("nowait.gateway")
T = TypeVar("T")

DISCONNECT_POLL_S = 0.5

router = APIRouter()


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


async def stream_response(request: Request, gateway: Gateway, call: Call, endpoint: str, response_id: str,
                          model: str, include_usage: bool) -> StreamingResponse:
    # Refusals are still HTTP errors here. A held stream (a fast attempt that may fall back)
    # runs to its end before the first byte: a client that hangs up meanwhile cancels it.
    release = stream_slots_of(request).take()
    try:
        plan = await unless_disconnected(request, gateway.dispatcher.open_stream(call))
    except BaseException:
        release()
        raise
    writer = ChunkWriter(endpoint, response_id, model, include_usage)

    async def events() -> AsyncIterator[str]:
        try:
            opening = writer.opening()
            if opening:
                yield opening
            async for text in plan.deltas():
                yield writer.delta(text)
            for chunk in writer.closing(plan.outcome):
                yield chunk
        except APIError as error:  # after the first byte, an error can only be an event
            yield sse(error.body())
        except Exception as error:  # a bug must still end the stream cleanly, with an error event
            log.exception("stream %s failed", response_id)
            yield sse(APIError(500, f"internal error ({type(error).__name__})", type="server_error").body())
        finally:
            release()
            await plan.aclose()
        yield SSE_DONE

    return SlotStreamingResponse(events(), release=release, media_type="text/event-stream",
                                 stall_timeout_s=gateway.config.server.stream_stall_timeout_s,
                                 headers={ROUTE_HEADER: plan.route, "cache-control": "no-cache",
                                          "x-request-id": response_id})


async def answer(request: Request, body: ChatCompletionRequest | CompletionRequest, endpoint: str,
                 response_id: str, calls: list[Call], build: Callable[[list[Outcome]], BaseModel]) -> Response:
    """A stream of the first call, or every call's outcome in one JSON object made by `build`."""
    gateway = gateway_of(request)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(request, gateway, calls[0], endpoint, response_id, body.model, include)
    outcomes = await unless_disconnected(request, gateway.complete_all(calls))
    return JSONResponse(build(outcomes).model_dump(), headers={ROUTE_HEADER: outcomes[0].final.engine,
                                                               "x-request-id": response_id})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    response_id = new_id("chatcmpl")
    calls = chat_calls(body, request.headers, gateway_of(request).config.defaults, response_id)
    return await answer(request, body, "chat", response_id, calls,
                        lambda outcomes: chat_completion(response_id, body.model, outcomes))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    response_id = new_id("cmpl")
    calls = completion_calls(body, request.headers, gateway_of(request).config.defaults, response_id)
    return await answer(request, body, "completions", response_id, calls,
                        lambda outcomes: text_completion(response_id, body.model, outcomes, len(prompts_of(body))))
