"""The two ASGI layers in front of every route: API keys (401) and the request body limit (413).

Both run before a body is read, and both report each refusal (`on_refusal`) so the metrics
count it like any other error answered.
"""

from __future__ import annotations

import hmac
from contextlib import suppress

from nowait.gateway.errors import APIError
from nowait.gateway.tenants import DEFAULT_CALLER, set_caller


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
        if scope["type"] == "http":
            set_caller(scope, DEFAULT_CALLER)
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
