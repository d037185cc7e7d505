"""The bound on server-sent event streams open at once (`server.max_concurrent_streams`).

Each open stream holds a connection, a generator and its engine work; past the bound a new
stream is refused with 429 `too_many_streams` and a Retry-After, before any engine work starts,
instead of letting open sockets grow without limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from fastapi.responses import StreamingResponse

from nowait.gateway.errors import APIError

log = logging.getLogger("nowait.gateway")

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


class StalledConsumer(Exception):
    """A client stopped reading its stream for longer than the stall timeout."""


class SlotStreamingResponse(StreamingResponse):
    """A stream that gives its slot back however it ends, even when the client left before its
    body began (then the generator never runs, so its own `finally` cannot be relied on).

    A client that stops reading makes the server's `send` wait (the socket's buffer is full);
    past `stall_timeout_s` the stream is dropped, its generator closed (which cancels its engine
    work) and its slot given back, so a stalled reader holds nothing for long."""

    def __init__(self, *args: Any, release: Callable[[], None], stall_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release, self.stall_timeout_s = release, stall_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_or_drop(message: Any) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                raise StalledConsumer(f"the client read nothing for {self.stall_timeout_s:g} s") from None

        try:
            await super().__call__(scope, receive, send_or_drop)
        except Exception as error:  # the stall may arrive inside a task group's exception group
            if not is_stall(error):
                raise
            log.warning("stream dropped: the client read nothing for %g s", self.stall_timeout_s)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:  # now, not at garbage collection: closing cancels the engine work
                with suppress(Exception):
                    await aclose()
            self.release()


def is_stall(error: BaseException) -> bool:
    return isinstance(error, StalledConsumer) or any(is_stall(e) for e in getattr(error, "exceptions", ()))
