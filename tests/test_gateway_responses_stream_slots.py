"""A Responses API stream takes the path chat streams take (event_streams.py): while its client
reads nothing it holds a stream slot (one more stream is 429 too_many_streams), it is dropped
after `server.stream_stall_timeout_s`, and its slot is given back for the next stream.

The app is driven over ASGI in this test's own event loop: a client that stops reading is a
`send` that never returns, which a real socket would only show once megabytes sat unread."""

from __future__ import annotations

import asyncio
import json

from nowait.gateway.app import create_app
from nowait.gateway.config import parse_config
from tests.gateway_support import API_KEY, base_config, free_port, save_tiny_models

STALL_S = 3.0  # long enough for the second request to arrive while the first stalls
HANG_GUARD_S = 120  # only so a regression fails instead of hanging; never a speed bound


def http_scope(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {API_KEY}".encode()),
                        (b"content-length", str(len(body)).encode())]}


async def call(app, path: str, payload: dict, stall: asyncio.Event | None = None) -> tuple[int, bytes]:
    """One request; with `stall`, the client reads nothing once the body begins (and sets it)."""
    body = json.dumps(payload).encode()
    delivered = False
    status, chunks = 0, []

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client never hangs up on its own

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message.get("body"):
            if stall is not None:
                stall.set()
                await asyncio.sleep(3600)  # a full socket buffer
            chunks.append(message["body"])

    await app(http_scope(path, body), receive, send)
    return status, b"".join(chunks)


async def running(app):
    """The app with its lifespan started (engines loaded), stopped on exit."""
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get,
                                   outbox.put))
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started
    return inbox, outbox, task


def test_a_stalled_responses_stream_holds_a_slot_until_it_is_dropped(tmp_path, codec):
    models = save_tiny_models(tmp_path / "models", codec)
    config = base_config(models, tmp_path / "data", free_port(),
                         server={"max_concurrent_streams": 1, "stream_stall_timeout_s": STALL_S})
    config["engines"] = {name: config["engines"][name] for name in ("ar", "diffusion")}
    app = create_app(parse_config(config))
    responses = {"model": "ar", "input": "Name:", "max_output_tokens": 8, "stream": True}

    async def scenario():
        inbox, _, lifespan = await running(app)
        try:
            stalled = asyncio.Event()
            first = asyncio.create_task(call(app, "/v1/responses", responses, stall=stalled))
            await asyncio.wait_for(stalled.wait(), HANG_GUARD_S)
            refused = await call(app, "/v1/responses", responses)  # the stalled stream holds the only slot
            dropped = await asyncio.wait_for(first, HANG_GUARD_S)
            slots_after = app.state.stream_slots.open
            served = await asyncio.wait_for(call(app, "/v1/responses", responses), HANG_GUARD_S)
            return refused, dropped, slots_after, served
        finally:
            await inbox.put({"type": "lifespan.shutdown"})
            await asyncio.wait_for(lifespan, HANG_GUARD_S)

    refused, dropped, slots_after, served = asyncio.run(scenario())
    assert refused[0] == 429 and json.loads(refused[1])["error"]["code"] == "too_many_streams"
    assert dropped[0] == 200  # its events began, then the stream was dropped, not left hanging
    assert slots_after == 0
    assert served[0] == 200 and b"event: response.output_text.done" in served[1]  # read to its end
