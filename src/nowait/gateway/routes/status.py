"""What the server says about itself: `GET /v1/models[/{id}]` (the router model and every available
engine), and, with no API key needed, `GET /healthz`, `/readyz` and `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from nowait.gateway.errors import APIError
from nowait.gateway.schemas import ModelCard, ModelList
from nowait.gateway.service import Gateway, gateway_of
from nowait.gateway.tenants import caller_in
from nowait.router import confidence_floor

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    gateway = gateway_of(request)
    engines = {name: {"kind": b.kind, "available": b.available, "reason": b.unavailable_reason or None,
                      "running": b.running(), "waiting": b.waiting()} for name, b in gateway.backends.items()}
    for name, backend in gateway.backends.items():
        worker = getattr(backend, "worker", None)  # owned engines: steps that raised, the last error and when
        if worker is not None:
            engines[name].update(failures=worker.failures, last_failure=worker.last_failure,
                                 last_failure_at=worker.last_failure_at)
    ready = gateway.ready()
    routing = {"confidence_threshold": gateway.policy.confidence_threshold,
               "confidence_threshold_source": gateway.threshold_source,
               "fallback_engine": gateway.config.routing.fallback_engine,
               # How many requests' schemas have a calibrated threshold of their own (by hash, by kind).
               "schema_thresholds": len(gateway.policy.schema_thresholds),
               "kind_thresholds": sorted(gateway.policy.kind_thresholds),
               "low_confidence": gateway.policy.low_confidence,
               "confidence_floors": {name: confidence_floor(name, gateway.policy) for name in gateway.backends}}
    return JSONResponse({"status": "ready" if ready else "not_ready", "engines": engines, "routing": routing},
                        status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gateway = gateway_of(request)
    for backend in gateway.backends.values():
        refresh_replicas = getattr(backend, "refresh_replicas", None)  # a fleet's engine: read its replicas' totals
        if refresh_replicas is not None:
            await refresh_replicas()
    gateway.metrics.refresh(gateway.backends.values(), gateway.policy)
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def model_cards(gateway: Gateway) -> list[ModelCard]:
    """The router model, then every available engine; `max_model_len` as vLLM states it (the
    router's: the shortest of its engines', so a request that fits it fits any route)."""
    engines = [ModelCard(id=name, kind=b.kind, max_model_len=getattr(b, "max_model_len", None))
               for name, b in gateway.backends.items() if b.available]
    lengths = [card.max_model_len for card in engines if card.max_model_len is not None]
    router = ModelCard(id=gateway.config.server.router_model, kind="router", max_model_len=min(lengths, default=None))
    return [router, *engines]


def callers_cards(request: Request) -> list[ModelCard]:
    """The models the caller's key may use (as OpenAI lists a project's models)."""
    caller = caller_in(request.scope)
    return [card for card in model_cards(gateway_of(request)) if caller.may_use(card.id)]


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return ModelList(data=callers_cards(request)).model_dump()


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, request: Request) -> dict:
    for card in callers_cards(request):
        if card.id == model_id:
            return card.model_dump()
    raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
