"""`POST /v1/responses`: OpenAI's Responses API, answered by the chat path (responses_api.py maps
the body onto a chat request and the Outcome back); JSON, or typed server-sent events with
`stream: true` (event_streams.py: the same stream slots, stall timeout and cancellation as chat).
Routed, priced and accounted exactly as the chat request it means."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nowait.gateway.calls import chat_calls
from nowait.gateway.errors import APIError
from nowait.gateway.event_streams import event_stream, unless_disconnected
from nowait.gateway.responses import answer_headers
from nowait.gateway.responses_api import (
    ResponseBuilder,
    ResponseEvents,
    ResponsesRequest,
    chat_request,
    new_message_id,
    new_response_id,
    renamed,
)
from nowait.gateway.service import gateway_of

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    response_id = new_response_id()
    builder = ResponseBuilder(body, response_id, new_message_id())
    try:
        chat = chat_request(body)
        call = chat_calls(chat, request.headers, gateway.config.defaults, response_id)[0]
        if body.stream:  # as on chat: a refusal before the first byte is still an HTTP error
            return await event_stream(request, gateway, call, ResponseEvents(builder), response_id)
        outcome = await unless_disconnected(request, gateway.dispatcher.complete(call))
    except APIError as error:
        raise renamed(error) from None
    return JSONResponse(builder.answered(outcome), headers=answer_headers([outcome], response_id))
