"""A client that stops reading its stream: the stream is dropped after the stall timeout, its
body generator closed (its engine work is cancelled there) and its slot given back, while a
stream whose client reads runs to its end beside it."""

from __future__ import annotations

import asyncio

from nowait.gateway.stream_slots import SlotStreamingResponse, StreamSlots

STALL_S = 0.2
HANG_GUARD_S = 30  # only so a regression fails instead of hanging; never a speed bound


def test_a_stalled_reader_is_dropped_and_a_reading_one_is_not_held_up():
    slots = StreamSlots(limit=2)
    closed: list[str] = []

    def body(name: str):
        async def events():
            try:
                for i in range(50):
                    yield f"data: {name} {i}\n\n"
            finally:
                closed.append(name)
        return events()

    async def receive():
        await asyncio.sleep(3600)  # the client never disconnects on its own

    async def stalled_send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            await asyncio.sleep(3600)  # a full socket buffer: the client reads nothing

    received: list[bytes] = []

    async def reading_send(message):
        if message["type"] == "http.response.body":
            received.append(message.get("body", b""))

    async def both():
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
        stalled = SlotStreamingResponse(body("stalled"), release=slots.take(), stall_timeout_s=STALL_S)
        reading = SlotStreamingResponse(body("reading"), release=slots.take(), stall_timeout_s=STALL_S)
        await asyncio.wait_for(asyncio.gather(stalled(scope, receive, stalled_send),
                                              reading(scope, receive, reading_send)), HANG_GUARD_S)

    asyncio.run(both())
    assert b"".join(received).count(b"data: reading") == 50
    assert sorted(closed) == ["reading", "stalled"]
    assert slots.open == 0
