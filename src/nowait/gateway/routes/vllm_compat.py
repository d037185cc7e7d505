"""vLLM's side endpoints, so tools and probes written for a vLLM server work unchanged:

    GET  /health            200 while serving, 503 while starting or draining   (no API key needed)
    GET  /ping, POST /ping  the same answer (SageMaker's probe, as vLLM serves it) (no API key needed)
    GET  /version           {"version": nowait's version}
    POST /tokenize          {"model", "prompt"} or {"model", "messages"} -> {"count", "max_model_len", "tokens"}
    POST /detokenize        {"model", "tokens"} -> {"prompt"}

Tokenizing uses the engine's own tokenizer and prompt shape, so the count of a prompt is the
`usage.prompt_tokens` that the same prompt costs on that engine. The router model tokenizes with
its batch engine (where a request goes when nothing else decides). A remote engine's tokenizer
is not held here: asking for it is a 400.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from nowait.conventions import apply_chat_template
from nowait.gateway.domain import Call, Metadata
from nowait.gateway.errors import bad_request, unknown_model
from nowait.gateway.owned import OwnedBackend
from nowait.gateway.prompts import chat_prompt, plain_messages
from nowait.gateway.schemas import ChatMessage, OpenAIObject, OpenAIRequest
from nowait.gateway.service import Gateway, gateway_of
from nowait.router import DataClass
from nowait.tokenizer import ASSISTANT

router = APIRouter()


# --- health ---


def serving_state(request: Request) -> str:
    """starting (engines still loading), draining (shutting down) or serving."""
    state = request.app.state
    if getattr(state, "draining", False):
        return "draining"
    return "serving" if getattr(state, "gateway", None) is not None else "starting"


def health_answer(request: Request) -> Response:
    state = serving_state(request)
    if state == "serving":
        return Response(status_code=200)  # vLLM answers an empty 200
    return JSONResponse({"status": state}, status_code=503)


@router.get("/health")
async def health(request: Request) -> Response:
    return health_answer(request)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return health_answer(request)


def nowait_version() -> str:
    try:
        return version("nowait")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@router.get("/version")
async def get_version() -> dict:
    return {"version": nowait_version()}


# --- tokenize / detokenize ---


class TokenizeRequest(OpenAIRequest):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: `prompt` or `messages`."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    return_token_strs: bool = False


class TokenizeResponse(OpenAIObject):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str
    tokens: list[int] = Field(min_length=0)


def tokenizing_backend(gateway: Gateway, model: str) -> OwnedBackend:
    """The owned engine whose tokenizer `model` uses (the router model: its batch engine's)."""
    name = gateway.policy.batch_engine if model == gateway.config.server.router_model else model
    backend = gateway.backends.get(name)
    if backend is None or not backend.available:
        raise unknown_model(model, gateway.dispatcher.model_names())
    if not isinstance(backend, OwnedBackend):
        raise bad_request(f"model {model!r} is served by a remote upstream: nowait does not hold its tokenizer",
                          param="model", code="unsupported_model")
    return backend


def chat_text(backend: OwnedBackend, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The text an engine reads for a conversation, with or without the assistant's opening."""
    conventions = backend.conventions
    if conventions is None or conventions.nowait_prompt:
        text = chat_prompt(messages)
        return text if add_generation_prompt else text.removesuffix(ASSISTANT)
    try:
        return apply_chat_template(conventions, messages, add_generation_prompt=add_generation_prompt)
    except ValueError as error:
        raise bad_request(f"messages: {error}", param="messages", code="chat_template_failed") from None


def token_ids(backend: OwnedBackend, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages is empty", param="messages")
        messages = plain_messages(body.messages)
        if body.add_special_tokens is None and body.add_generation_prompt and not body.continue_final_message:
            # Exactly what a chat request with these messages feeds the engine.
            call = Call(request_id="tokenize", endpoint="chat", model=backend.name, messages=messages,
                        meta=Metadata(None, 0.0, DataClass.internal, False))
            return backend.prompt_ids(call)
        text = chat_text(backend, messages, body.add_generation_prompt and not body.continue_final_message)
        return backend.codec.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)).ids
    if body.add_special_tokens is None:  # what a completions request with this prompt feeds the engine
        return backend.prompt_ids(Call(request_id="tokenize", endpoint="completions", model=backend.name,
                                       prompt=body.prompt, meta=Metadata(None, 0.0, DataClass.internal, False)))
    return backend.codec.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    backend = tokenizing_backend(gateway_of(request), body.model)
    ids = token_ids(backend, body)
    strs = [backend.codec.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids,
                            token_strs=strs).model_dump(exclude_none=True)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    backend = tokenizing_backend(gateway_of(request), body.model)
    vocab = backend.codec.vocab_size
    for index, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"tokens[{index}] = {token} is not a token id of this model (0..{vocab - 1})",
                              param=f"tokens[{index}]", code="invalid_token")
    # Special tokens are kept, as vLLM keeps them: the text round-trips through /tokenize.
    return {"prompt": backend.codec.tokenizer.decode(body.tokens, skip_special_tokens=False)}
