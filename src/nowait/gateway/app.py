"""The HTTP surface: an OpenAI-compatible FastAPI app in front of the dispatcher and the batch store.

    POST /v1/chat/completions, /v1/completions   (JSON or SSE with `stream: true`)
    GET  /v1/models, /v1/models/{id}
    POST /v1/files, GET /v1/files[/{id}[/content]], DELETE /v1/files/{id}
    POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel
    GET  /metrics, /healthz, /readyz                   (no API key needed)

Handlers only translate: bodies to Calls (calls.py), Outcomes to OpenAI objects (responses.py).
Routing, fallback and accounting live in dispatch.py; the engines in engines.py and remote.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from typing import TypeVar

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from nowait.gateway.batches import BATCH_ENDPOINTS, COMPLETION_WINDOWS, BatchRunner, BatchStore
from nowait.gateway.calls import chat_calls, completion_calls, new_id, prompts_of
from nowait.gateway.config import GatewayConfig, RemoteEngineConfig
from nowait.gateway.dispatch import Dispatcher, Outcome
from nowait.gateway.domain import Backend, Call
from nowait.gateway.engines import ModelCache, UnavailableBackend, build_owned
from nowait.gateway.errors import APIError, bad_request, install_error_handlers
from nowait.gateway.ledger import AuditLog
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.remote import RemoteBackend
from nowait.gateway.responses import (
    ROUTE_HEADER,
    SSE_DONE,
    ChunkWriter,
    chat_completion,
    sse,
    text_completion,
)
from nowait.gateway.schemas import (
    Batch,
    BatchCreateRequest,
    BatchList,
    ChatCompletionRequest,
    CompletionRequest,
    FileDeleted,
    FileList,
    FileObject,
    ModelCard,
    ModelList,
)
from nowait.router import restrict_to_available

log = logging.getLogger("nowait.gateway")
T = TypeVar("T")

FILE_PURPOSES = ("batch", "batch_output", "user_data", "assistants", "fine-tune", "vision")
DISCONNECT_POLL_S = 0.5


def build_backends(config: GatewayConfig) -> dict[str, Backend]:
    """Every configured engine; one that cannot serve is kept as unavailable, with a warning."""
    cache = ModelCache()
    backends: dict[str, Backend] = {}
    for name, spec in config.engines.items():
        if isinstance(spec, RemoteEngineConfig):
            remote = RemoteBackend(name, spec, config.metrics_window_s)
            if not remote.available:
                log.warning("engine %r is not available: %s", name, remote.unavailable_reason)
                backends[name] = UnavailableBackend(name, "remote", remote.unavailable_reason,
                                                    config.metrics_window_s, owned=spec.on_premises)
            else:
                backends[name] = remote
        else:
            backends[name] = build_owned(name, spec, cache, config.metrics_window_s, config.defaults.max_tokens)
    return backends


class Gateway:
    """Everything a running server holds: config, engines, dispatcher, metrics, ledger, batches."""

    def __init__(self, config: GatewayConfig, backends: dict[str, Backend]) -> None:
        self.config = config
        self.backends = backends
        available = {name for name, backend in backends.items() if backend.available}
        self.policy = restrict_to_available(config.routing_policy(), available)
        # Where the fallback threshold came from (config, calibration file, default), read once.
        self.threshold_source = config.confidence_threshold()[1]
        if config.routing.fast_engine and self.policy.fast_engine is None:
            log.warning("fast engine %r is not available: latency-bound requests go to %r",
                        config.routing.fast_engine, self.policy.batch_engine)
        self.metrics = GatewayMetrics()
        self.audit = AuditLog(config.audit_log_path)
        self.dispatcher = Dispatcher(backends, self.policy, config.server.router_model, self.metrics, self.audit,
                                     config.server.request_timeout_s)
        self.store = BatchStore(config.batch_database)
        self.runner = BatchRunner(self.store, self.execute, config.batches.max_concurrent_lines)
        self.api_keys = config.auth.keys()

    async def start(self) -> None:
        for backend in self.backends.values():
            await backend.start()
        await self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        for backend in self.backends.values():
            await backend.stop()
        self.store.close()
        self.audit.close()

    def ready(self) -> bool:
        batch = self.backends.get(self.policy.batch_engine)
        return batch is not None and batch.available

    def calls_at_once(self, model: str) -> int:
        """The most calls of one request that `model` takes at once: what its engine admits; for
        the router, what the smallest available engine admits (it may send them anywhere)."""
        named = self.backends.get(model)
        engines = [named] if named is not None else [b for b in self.backends.values() if b.available]
        return max(1, min((b.admits for b in engines), default=1))

    async def complete_all(self, calls: list[Call]) -> list[Outcome]:
        """The choices of one request (n x prompts), at most `calls_at_once` at a time: a
        request is never refused for asking more of an engine than it can ever hold, only for
        what others hold (429, which a batch line waits out)."""
        if len(calls) == 1:
            return [await self.dispatcher.complete(calls[0])]
        gate = asyncio.Semaphore(self.calls_at_once(calls[0].model))

        async def complete(call: Call) -> Outcome:
            async with gate:
                return await self.dispatcher.complete(call)

        results = await asyncio.gather(*(complete(c) for c in calls), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    async def execute(self, endpoint: str, body: dict, request_id: str) -> tuple[int, dict, float | None]:
        """One batch line, through the same path as an HTTP request (batchable by default)."""
        defaults, data_class = self.config.defaults, self.config.batches.data_class
        try:
            if endpoint == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(body)
                if chat.stream:
                    raise bad_request("stream is not supported in a batch", param="stream")
                outcomes = await self.complete_all(chat_calls(chat, {}, defaults, request_id, True, data_class))
                return 200, chat_completion(request_id, chat.model, outcomes).model_dump(), None
            text = CompletionRequest.model_validate(body)
            if text.stream:
                raise bad_request("stream is not supported in a batch", param="stream")
            outcomes = await self.complete_all(completion_calls(text, {}, defaults, request_id, True, data_class))
            return 200, text_completion(request_id, text.model, outcomes, len(prompts_of(text))).model_dump(), None
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            return 400, bad_request(f"{param}: {first['msg']}", param=param, code="invalid_value").body(), None
        except APIError as error:
            retry = error.headers.get("Retry-After")
            return error.status, error.body(), float(retry) if retry else None
        except Exception as error:  # one bad line must not stop the batch
            log.exception("batch line %s failed", request_id)
            return 500, APIError(500, f"internal error ({type(error).__name__})", type="server_error").body(), None


class ApiKeyMiddleware:
    """401 for /v1 requests without one of the configured keys (a pure ASGI layer: it runs before
    the body is read, so an unauthenticated client learns nothing about its request)."""

    def __init__(self, app, keys: set[str], on_refusal=None) -> None:
        self.app, self.keys, self.on_refusal = app, [k.encode() for k in keys], on_refusal

    async def __call__(self, scope, receive, send) -> None:
        if self.keys and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not any(hmac.compare_digest(token.strip(), k) for k in self.keys):
                error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with a key "
                                      "from the gateway's configuration", code="invalid_api_key")
                if self.on_refusal is not None:
                    self.on_refusal(error)
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body went past the server's limit while being read."""


class BodyLimitMiddleware:
    """413 for a request body over `limit` bytes: at once when its Content-Length says so (the
    `openai` client always sends one), else as soon as the bytes read pass the limit, so an
    over-large body is never held in memory whole."""

    def __init__(self, app, limit: int, on_refusal=None) -> None:
        self.app, self.limit, self.on_refusal = app, limit, on_refusal

    def _refusal(self) -> APIError:
        error = APIError(413, f"The request body is larger than this server accepts ({self.limit} bytes; "
                              "server.max_request_bytes)", code="request_too_large")
        if self.on_refusal is not None:
            self.on_refusal(error)
        return error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refusal().response()(scope, receive, send)
            return
        seen, over, answered = 0, False, False

        async def counted_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise BodyTooLarge
            return message

        async def refuse() -> None:
            nonlocal answered
            if not answered:
                answered = True
                await self._refusal().response()(scope, receive, send)

        async def watched_send(message) -> None:
            # Whatever the app answers a body it could not finish reading (FastAPI: 400), the
            # client is told the real reason.
            if over:
                await refuse()
                return
            await send(message)

        with suppress(BodyTooLarge):
            await self.app(scope, counted_receive, watched_send)
        if over:
            await refuse()


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


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


def create_app(config: GatewayConfig, backends: dict[str, Backend] | None = None) -> FastAPI:
    """The ASGI app; engines load when it starts (uvicorn's lifespan), not when it is created."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if config.server.torch_threads:
            import torch

            torch.set_num_threads(config.server.torch_threads)
        gateway = Gateway(config, backends if backends is not None else build_backends(config))
        await gateway.start()
        app.state.gateway = gateway
        log.info("nowait gateway ready: engines %s", {n: b.available for n, b in gateway.backends.items()})
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="nowait gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    def count_error(error: APIError) -> None:
        gateway = getattr(app.state, "gateway", None)
        if gateway is not None:
            gateway.metrics.observe_error(error.status, error.code)

    install_error_handlers(app, count_error)
    app.add_middleware(BodyLimitMiddleware, limit=config.server.max_request_bytes, on_refusal=count_error)
    app.add_middleware(ApiKeyMiddleware, keys=config.auth.keys(), on_refusal=count_error)  # outermost: keys first

    # --- health and metrics ---

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        gateway = gateway_of(request)
        engines = {name: {"kind": b.kind, "available": b.available, "reason": b.unavailable_reason or None,
                          "running": b.running(), "waiting": b.waiting()} for name, b in gateway.backends.items()}
        ready = gateway.ready()
        routing = {"confidence_threshold": gateway.policy.confidence_threshold,
                   "confidence_threshold_source": gateway.threshold_source,
                   "fallback_engine": gateway.config.routing.fallback_engine}
        return JSONResponse({"status": "ready" if ready else "not_ready", "engines": engines, "routing": routing},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway = gateway_of(request)
        gateway.metrics.refresh(gateway.backends.values(), gateway.policy)
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- models ---

    def model_cards(gateway: Gateway) -> list[ModelCard]:
        cards = [ModelCard(id=gateway.config.server.router_model, kind="router")]
        return cards + [ModelCard(id=name, kind=b.kind) for name, b in gateway.backends.items() if b.available]

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        return ModelList(data=model_cards(gateway_of(request))).model_dump()

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str, request: Request) -> dict:
        for card in model_cards(gateway_of(request)):
            if card.id == model_id:
                return card.model_dump()
        raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")

    # --- generation ---

    async def stream_response(request: Request, gateway: Gateway, call: Call, endpoint: str, response_id: str,
                              model: str, include_usage: bool) -> StreamingResponse:
        # Refusals are still HTTP errors here. A held stream (a fast attempt that may fall back)
        # runs to its end before the first byte: a client that hangs up meanwhile cancels it.
        plan = await unless_disconnected(request, gateway.dispatcher.open_stream(call))
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
                await plan.aclose()
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={ROUTE_HEADER: plan.route, "cache-control": "no-cache",
                                          "x-request-id": response_id})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gateway = gateway_of(request)
        response_id = new_id("chatcmpl")
        calls = chat_calls(body, request.headers, gateway.config.defaults, response_id)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_response(request, gateway, calls[0], "chat", response_id, body.model, include)
        outcomes = await unless_disconnected(request, gateway.complete_all(calls))
        result = chat_completion(response_id, body.model, outcomes)
        return JSONResponse(result.model_dump(), headers={ROUTE_HEADER: outcomes[0].final.engine,
                                                          "x-request-id": response_id})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gateway = gateway_of(request)
        response_id = new_id("cmpl")
        calls = completion_calls(body, request.headers, gateway.config.defaults, response_id)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_response(request, gateway, calls[0], "completions", response_id, body.model, include)
        outcomes = await unless_disconnected(request, gateway.complete_all(calls))
        result = text_completion(response_id, body.model, outcomes, len(prompts_of(body)))
        return JSONResponse(result.model_dump(), headers={ROUTE_HEADER: outcomes[0].final.engine,
                                                          "x-request-id": response_id})

    # --- files ---

    @app.post("/v1/files")
    async def upload_file(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict:
        if purpose not in FILE_PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}", param="purpose")
        content = await file.read()
        store = gateway_of(request).store
        created = await asyncio.to_thread(store.create_file, file.filename or "upload.jsonl", purpose, content)
        return created.model_dump()

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10000) -> dict:
        files = await asyncio.to_thread(gateway_of(request).store.list_files, purpose, limit)
        return FileList(data=files).model_dump()

    async def existing_file(request: Request, file_id: str) -> FileObject:
        found = await asyncio.to_thread(gateway_of(request).store.get_file, file_id)
        if found is None:
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
        return found

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> dict:
        return (await existing_file(request, file_id)).model_dump()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        await existing_file(request, file_id)
        content = await asyncio.to_thread(gateway_of(request).store.file_content, file_id)
        return Response(content, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> dict:
        await existing_file(request, file_id)
        deleted = await asyncio.to_thread(gateway_of(request).store.delete_file, file_id)
        return FileDeleted(id=file_id, deleted=deleted).model_dump()

    # --- batches ---

    @app.post("/v1/batches")
    async def create_batch(body: BatchCreateRequest, request: Request) -> dict:
        gateway = gateway_of(request)
        if body.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}",
                              param="endpoint", code="unsupported_endpoint")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                              param="completion_window")
        found = await asyncio.to_thread(gateway.store.get_file, body.input_file_id)
        if found is None:
            raise bad_request(f"input_file_id {body.input_file_id!r}: no such file", param="input_file_id",
                              code="invalid_input_file")
        if found.purpose != "batch":
            raise bad_request(f"input_file_id {body.input_file_id!r} was uploaded with purpose {found.purpose!r}; "
                              "a batch needs purpose 'batch'", param="input_file_id", code="invalid_input_file")
        # Committed before we answer: an accepted batch is on disk (batches.py, rule 1).
        batch = await asyncio.to_thread(gateway.store.create_batch, body.input_file_id, body.endpoint,
                                        body.completion_window, body.metadata)
        gateway.runner.wake()
        return batch.model_dump()

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
        store = gateway_of(request).store
        batches = await asyncio.to_thread(store.list_batches, limit + 1, after)
        page = batches[:limit]
        return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                         has_more=len(batches) > limit).model_dump()

    async def existing_batch(request: Request, batch_id: str) -> Batch:
        found = await asyncio.to_thread(gateway_of(request).store.get_batch, batch_id)
        if found is None:
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return found

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> dict:
        return (await existing_batch(request, batch_id)).model_dump()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> dict:
        gateway = gateway_of(request)
        batch = await existing_batch(request, batch_id)
        if batch.status in ("cancelling", "cancelled"):
            return batch.model_dump()
        if not await asyncio.to_thread(gateway.store.request_cancel, batch_id):
            raise APIError(409, f"batch {batch_id} is {batch.status}; only a validating or in-progress batch can "
                                "be cancelled", param="batch_id", code="batch_not_cancellable")
        gateway.runner.wake()
        return (await existing_batch(request, batch_id)).model_dump()

    return app
