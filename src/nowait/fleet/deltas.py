"""A replica's stream deltas in groups: each item a replica yields is one Ray object to the
gateway (and the gateway's SSE event one more to the Serve proxy), and each costs both processes
a few CPU milliseconds on a busy machine, more than a decode step of a small model. So the first
delta goes at once (time to first token is untouched), and later ones are held up to
`GROUP_WINDOW_S` after the previous send and sent as one text; the end of the stream sends what
is held at once (the last token is not delayed either).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

# Text a client reads this much later is not seen later (a screen refresh is 16 ms); at batch 1
# a small model's decode step is 5-20 ms, so most objects carry two to four tokens.
GROUP_WINDOW_S = 0.025


async def grouped(deltas: AsyncIterator[str], window_s: float = GROUP_WINDOW_S) -> AsyncIterator[tuple[str, bool]]:
    """(text, last) pairs: the deltas of `deltas` joined, at most one pair per `window_s` after the
    first; `last` is True on the pair sent when `deltas` ended (its text may be ''). An error of
    `deltas` is raised after the text that came before it."""
    loop = asyncio.get_running_loop()
    held: list[str] = []
    arrived = asyncio.Event()

    async def pump() -> None:
        try:
            async for text in deltas:
                held.append(text)
                arrived.set()
        finally:
            arrived.set()

    task = asyncio.create_task(pump())
    sent_at = -math.inf
    try:
        while True:
            await arrived.wait()
            hold = sent_at + window_s - loop.time()
            if hold > 0 and not task.done():
                await asyncio.wait({task}, timeout=hold)  # until the window closes or the stream ends
            arrived.clear()
            ended = task.done()
            text, held[:] = "".join(held), []
            if ended:
                if task.exception() is not None:  # the stream's own error, after the text before it
                    if text:
                        yield text, False
                    task.result()
                yield text, True
                return
            if text:
                sent_at = loop.time()
                yield text, False
    finally:
        task.cancel()  # the caller went away: so does the engine's stream (its own finally releases it)
