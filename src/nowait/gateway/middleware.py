"""The ASGI layers in front of every route: API keys (401, auth.py), the tenants' limits (429,
limits.py) and the request body limit (413).

All run before a body is read, and all report each refusal (`on_refusal`) so the metrics
count it like any other error answered (a limit's refusal, whose caller is known, is also audited).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

from nowait.gateway.auth import Authenticator, needs_key
from nowait.gateway.errors import APIError
from nowait.gateway.limits import TenantLimits
from nowait.gateway.tenants import Caller, caller_in, set_caller


class ApiKeyMiddleware:
    """401 for /v1 and /admin requests without a key that opens them (auth.py); the caller of
    every other /v1 request recorded in the ASGI state (tenants.py). A pure ASGI layer: it runs
    before the body is read, so an unauthenticated client learns nothing about its request."""

    def __init__(self, app, authenticator: Callable[[], Authenticator | None], on_refusal=None) -> None:
        # The authenticator is the running gateway's (its key store opens with the server), so
        # it is looked up per request rather than held. None: the gateway is still starting, and
        # every route answers 503 (`service.gateway_of`) but the probes, which say so.
        self.app, self.authenticator, self.on_refusal = app, authenticator, on_refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"")
            authenticator = self.authenticator()
            if authenticator is None:
                await self.app(scope, receive, send)
                return
            try:
                caller = authenticator.authenticate(scope["path"], header)
            except APIError as error:
                if self.on_refusal is not None:
                    self.on_refusal(error)
                await error.response()(scope, receive, send)
                return
            if caller is not None:
                set_caller(scope, caller)
        await self.app(scope, receive, send)


# Requests that ask a model for an answer count against a key's limits; uploads and batch
# bookkeeping do not (a batch's lines count one by one as they run).
UNCOUNTED_PREFIXES = ("/v1/files", "/v1/batches", "/v1/models")


def counts_against_limits(method: str, path: str) -> bool:
    return method == "POST" and path.startswith("/v1/") and not path.startswith(UNCOUNTED_PREFIXES)


class TenantLimitMiddleware:
    """429 for a model request whose key is over its rate limits or its tenant's budget
    (limits.py), before the body is read; the `x-ratelimit-*` headers on every /v1 answer to a
    limited key (a model request's as of its admission, as OpenAI's are as of the request).
    Runs inside the API-key layer, which names the caller. Each refusal goes to
    `on_refusal(error, caller, path)`: it is audited and counted for the caller's tenant."""

    def __init__(self, app, limits: Callable[[], TenantLimits],
                 on_refusal: Callable[[APIError, Caller, str], None] | None = None) -> None:
        self.app, self.limits, self.on_refusal = app, limits, on_refusal

    async def __call__(self, scope, receive, send) -> None:
        caller = caller_in(scope) if scope["type"] == "http" else None
        if caller is None or not caller.limited or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        limits = self.limits()
        admitted: dict[str, str] | None = None
        if counts_against_limits(scope["method"], scope["path"]):
            try:
                admitted = limits.admit(caller)
            except APIError as error:
                if self.on_refusal is not None:
                    self.on_refusal(error, caller, scope["path"])
                await error.response()(scope, receive, send)
                return

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                shown = admitted if admitted is not None else limits.headers(caller)
                extra = [(k.encode(), v.encode()) for k, v in shown.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


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
