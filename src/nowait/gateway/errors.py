"""Every 4xx/5xx as an OpenAI error object: `{"error": {"message", "type", "param", "code"}}`.

Handlers are registered for the gateway's own `APIError`, for pydantic's request validation
(OpenAI answers 400, not FastAPI's 422), for bad JSON, for unknown routes and methods, and for
anything unexpected (500, the message kept short: tracebacks go to the server log, not the client).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nowait.gateway.schemas import ErrorDetail, ErrorResponse
from nowait.store.database import StoreUnavailable

log = logging.getLogger("nowait.gateway")


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.accounted = False  # counted in the metrics already (by the dispatcher)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


STORE_RETRY_AFTER_S = 1


def store_unavailable(why: str) -> APIError:
    return APIError(503, f"the store cannot take this request now ({why}); nothing was accepted, retry in "
                         f"{STORE_RETRY_AFTER_S} s", type="server_error", code="store_unavailable",
                    headers={"Retry-After": str(STORE_RETRY_AFTER_S)})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unknown_model(model: str, known: list[str]) -> APIError:
    return APIError(404, f"The model `{model}` does not exist; available: {', '.join(known)}", param="model",
                    code="model_not_found")


def engine_unavailable(engine: str, why: str) -> APIError:
    return APIError(503, f"engine {engine!r} is not available: {why}", type="server_error", param="model",
                    code="engine_unavailable")


def queue_full(engine: str, retry_after_s: int) -> APIError:
    return APIError(429, f"engine {engine!r} has too many requests waiting; retry in {retry_after_s} s",
                    type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after_s)})


def timed_out(engine: str, seconds: float) -> APIError:
    return APIError(504, f"engine {engine!r} did not answer within {seconds:g} s", type="timeout_error",
                    code="timeout")


def forbidden_destination(message: str) -> APIError:
    return APIError(403, message, type="permission_error", param="model", code="data_class_forbidden")


def model_not_allowed(model: str, allowed: list[str]) -> APIError:
    return APIError(403, f"This API key may not use the model `{model}`; it may use: {', '.join(allowed)}",
                    type="permission_error", param="model", code="model_not_allowed")


def _location(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return bad_request("We could not parse the JSON body of your request: "
                           f"{first.get('ctx', {}).get('error', 'invalid JSON')}", code="invalid_json")
    param = _location(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"{param + ': ' if param else ''}{message}{more}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI, on_error: Callable[[APIError], None] | None = None) -> None:
    """`on_error` sees every error answered (the metrics count them)."""
    def answer(error: APIError) -> JSONResponse:
        if on_error is not None and not error.accounted:
            on_error(error)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(_validation_error(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return answer(bad_request(f"We could not parse the JSON body of your request: {exc}", code="invalid_json"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
                405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return answer(APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {})))

    @app.exception_handler(sqlite3.OperationalError)
    async def _store_unavailable(request: Request, exc: sqlite3.OperationalError) -> JSONResponse:
        # Locked by another writer, disk full, an I/O error: the transaction was rolled back, so
        # nothing was accepted; the client may retry the same request.
        log.warning("store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return answer(store_unavailable(str(exc)))

    @app.exception_handler(StoreUnavailable)
    async def _shared_store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        # The shared database cannot be reached: no transaction committed. Chat and completions
        # do not need it; the store-backed endpoints answer this until it is back.
        log.warning("store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return answer(store_unavailable(str(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return answer(APIError(500, f"internal error ({type(exc).__name__}); see the server log", type="server_error",
                               code="internal_error"))
