"""The HTTP surface: an OpenAI-compatible FastAPI app in front of the dispatcher and the batch store.

    POST /v1/chat/completions, /v1/completions   (JSON or SSE with `stream: true`)   routes/generation.py
    GET  /v1/models, /v1/models/{id}                                                 routes/status.py
    POST /v1/files, GET /v1/files[/{id}[/content]], DELETE /v1/files/{id}            routes/batch_api.py
    POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel           routes/batch_api.py
    GET  /metrics, /healthz, /readyz                   (no API key needed)           routes/status.py
    POST /admin/keys, GET /admin/keys, DELETE /admin/keys/{id}   (admin keys only)    routes/admin.py
    POST /v1/responses       (the Responses API, answered by the chat path)          routes/responses.py
    GET  /health, /ping, /version; POST /tokenize, /detokenize   (vLLM's)            routes/vllm_compat.py
    GET  /dashboard, /dashboard/data                   (the live page)               routes/dashboard.py

Handlers only translate: bodies to Calls (calls.py), Outcomes to OpenAI objects (responses.py).
Routing, fallback and accounting live in dispatch.py; the engines in engines.py (built from the
config), owned.py and workers.py (in process) and remote.py; what a running server holds in
service.py. This module puts them together: the lifespan that loads the engines, the
middleware, the error handlers and the routes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from nowait.gateway.config import GatewayConfig
from nowait.gateway.domain import Backend
from nowait.gateway.engines import build_backends
from nowait.gateway.errors import APIError, install_error_handlers
from nowait.gateway.middleware import ApiKeyMiddleware, BodyLimitMiddleware, TenantLimitMiddleware
from nowait.gateway.openapi import install_openapi
from nowait.gateway.routes import admin, batch_api, dashboard, generation, responses, status, vllm_compat
from nowait.gateway.service import Gateway, gateway_started
from nowait.gateway.tenants import Caller

log = logging.getLogger("nowait.gateway")


def lifespan_of(config: GatewayConfig, backends: dict[str, Backend] | None
                ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Engines load when the server starts (uvicorn's lifespan) and stop when it stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engines = len(config.in_process_engine_names())
        if engines:
            import torch

            cores = len(os.sched_getaffinity(0))
            threads = config.engine_threads(cores)
            torch.set_num_threads(threads)
            log.info("torch threads: %d (%s)", threads, "server.torch_threads" if config.server.torch_threads
                     else f"{cores} cores, {config.server.reserved_cores} reserved for the server, shared by "
                          f"{engines} in-process engines")
        gateway = Gateway(config, backends if backends is not None else build_backends(config))
        await gateway.start()
        app.state.gateway = gateway
        log.info("nowait gateway ready: engines %s", {n: b.available for n, b in gateway.backends.items()})
        try:
            yield
        finally:
            app.state.draining = True  # /health answers 503 from here on
            await gateway.stop()

    return lifespan


def create_app(config: GatewayConfig, backends: dict[str, Backend] | None = None) -> FastAPI:
    """The ASGI app; engines load when it starts (uvicorn's lifespan), not when it is created."""
    app = FastAPI(title="nowait gateway", lifespan=lifespan_of(config, backends), docs_url=None, redoc_url=None)

    def count_error(error: APIError) -> None:
        gateway = getattr(app.state, "gateway", None)
        if gateway is not None:
            gateway.metrics.observe_error(error.status, error.code)

    def count_tenant_refusal(error: APIError, caller: Caller, path: str) -> None:
        gateway = getattr(app.state, "gateway", None)
        if gateway is not None:
            gateway.dispatcher.refused(caller, path, error)

    install_error_handlers(app, count_error)
    app.add_middleware(BodyLimitMiddleware, limit=config.server.max_request_bytes, on_refusal=count_error)
    app.add_middleware(TenantLimitMiddleware, limits=lambda: app.state.gateway.limits,
                       on_refusal=count_tenant_refusal)
    app.add_middleware(ApiKeyMiddleware, on_refusal=count_error,  # outermost: keys first
                       authenticator=lambda: getattr(gateway_started(app), "authenticator", None))
    for routes in (status, generation, batch_api, responses, vllm_compat, dashboard, admin):
        app.include_router(routes.router)
    install_openapi(app)
    return app
