"""`POST /v1/responses`: OpenAI's Responses API, answered by the chat path (responses_api.py maps
the body onto a chat request and the Outcome back); JSON, or typed server-sent events with
`stream: true`. Routed, priced and accounted exactly as the chat request it means."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nowait.gateway.calls import chat_calls
from nowait.gateway.errors import APIError
from nowait.gateway.responses import ROUTE_HEADER
from nowait.gateway.responses_api import (
    ResponseBuilder,
    ResponseEvents,
    ResponsesRequest,
    chat_request,
    new_message_id,
    new_response_id,
    renamed,
)
from nowait.gateway.routes.generation import unless_disconnected
from nowait.gateway.service import gateway_of

log = logging.getLogger("nowait.gateway")

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    response_id = new_response_id()
    builder = ResponseBuilder(body, response_id, new_message_id())
    try:
        chat = chat_request(body)
        call = chat_calls(chat, request.headers, gateway.config.defaults, response_id)[0]
        if not body.stream:
            outcome = await unless_disconnected(request, gateway.dispatcher.complete(call))
            return JSONResponse(builder.answered(outcome), headers={ROUTE_HEADER: outcome.final.engine,
                                                                    "x-request-id": response_id})
        # As on chat: a refusal before the first byte is still an HTTP error.
        plan = await unless_disconnected(request, gateway.dispatcher.open_stream(call))
    except APIError as error:
        raise renamed(error) from None
    events = ResponseEvents(builder)

    async def stream() -> AsyncIterator[str]:
        try:
            for event in events.opening():
                yield event
            async for text in plan.deltas():
                yield events.delta(text)
            for event in events.closing(plan.outcome):
                yield event
        except APIError as error:  # after the first byte, an error can only be an event
            for event in events.failure(renamed(error)):
                yield event
        except Exception as error:  # a bug must still end the stream cleanly, with an error event
            log.exception("stream %s failed", response_id)
            for event in events.failure(APIError(500, f"internal error ({type(error).__name__})",
                                                 type="server_error", code="internal_error")):
                yield event
        finally:
            await plan.aclose()

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={ROUTE_HEADER: plan.route, "cache-control": "no-cache",
                                      "x-request-id": response_id})
