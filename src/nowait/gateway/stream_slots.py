"""The bound on server-sent event streams open at once (`server.max_concurrent_streams`).

Each open stream holds a connection, a generator and its engine work; past the bound a new
stream is refused with 429 `too_many_streams` and a Retry-After, before any engine work starts,
instead of letting open sockets grow without limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import StreamingResponse

from nowait.gateway.errors import APIError

STREAM_RETRY_AFTER_S = 1


class StreamSlots:
    """Counts open streams on the event loop (single-threaded, so no lock is needed)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.open = limit, 0

    def take(self) -> Callable[[], None]:
        """A slot, or 429; the returned release gives it back once however often it is called."""
        if self.open >= self.limit:
            raise APIError(429, f"this server has {self.open} streams open, its limit "
                                f"(server.max_concurrent_streams); retry in {STREAM_RETRY_AFTER_S} s",
                           type="rate_limit_error", code="too_many_streams",
                           headers={"Retry-After": str(STREAM_RETRY_AFTER_S)})
        self.open += 1
        held = [True]

        def release() -> None:
            if held:
                held.clear()
                self.open -= 1

        return release


class SlotStreamingResponse(StreamingResponse):
    """A stream that gives its slot back however it ends, even when the client left before its
    body began (then the generator never runs, so its own `finally` cannot be relied on)."""

    def __init__(self, *args: Any, release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
