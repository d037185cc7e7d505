"""`POST /v1/chat/completions` and `POST /v1/completions`: JSON answers, or server-sent events with
`stream: true` (event_streams.py); a client that hangs up cancels its work."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from nowait.gateway.calls import chat_calls, completion_calls, new_id, prompts_of
from nowait.gateway.dispatch import Outcome
from nowait.gateway.domain import Call
from nowait.gateway.event_streams import event_stream, unless_disconnected
from nowait.gateway.responses import ChunkWriter, answer_headers, chat_completion, text_completion
from nowait.gateway.schemas import ChatCompletionRequest, CompletionRequest
from nowait.gateway.service import gateway_of

router = APIRouter()


async def answer(request: Request, body: ChatCompletionRequest | CompletionRequest, endpoint: str,
                 response_id: str, calls: list[Call], build: Callable[[list[Outcome]], BaseModel]) -> Response:
    """A stream of the first call, or every call's outcome in one JSON object made by `build`."""
    gateway = gateway_of(request)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        writer = ChunkWriter(endpoint, response_id, body.model, include)
        return await event_stream(request, gateway, calls[0], writer, response_id)
    outcomes = await unless_disconnected(request, gateway.complete_all(calls))
    return JSONResponse(build(outcomes).model_dump(), headers=answer_headers(outcomes, response_id))


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
