"""The gateway's documented limits, each refused with its own code: the list pages' `limit` and
`after` bounds, a batch input file's lines and bytes (OpenAI's 50,000 and 200 MB, set small
here), and the number of streams open at once. (The body limit, 413 `request_too_large`, and an
engine's full queue, 429 `rate_limit_exceeded`, are tests/test_gateway_errors.py's.)"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_FILE_LINES = 3
MAX_FILE_BYTES = 400


class HeldStreamUpstream:
    """An upstream whose chat stream sends one chunk, then holds until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.app = FastAPI()

        @self.app.post("/v1/chat/completions")
        async def chat(body: dict):
            async def events():
                chunk = {"choices": [{"index": 0, "delta": {"content": "held "}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                deadline = time.monotonic() + 20  # nothing hangs if the test fails early
                while not self.release.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def upstream():
    return HeldStreamUpstream()


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec, upstream):
    root = tmp_path_factory.mktemp("limits")
    config = base_config(save_tiny_models(root / "models", codec), root / "data", free_port(),
                         server={"max_concurrent_streams": 1},
                         batches={"max_file_lines": MAX_FILE_LINES, "max_file_bytes": MAX_FILE_BYTES})
    with live_server(config, upstream) as live:
        yield live


def error_of(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


@pytest.mark.parametrize("path,query,param", [
    ("/v1/files", {"limit": "-34324785063802611695616"}, "limit"),  # was a 500 (OverflowError in SQLite)
    ("/v1/files", {"limit": "0"}, "limit"),
    ("/v1/files", {"limit": "10001"}, "limit"),
    ("/v1/batches", {"limit": "101"}, "limit"),
    ("/v1/batches", {"limit": "99999999999999999999999"}, "limit"),
    ("/v1/batches", {"after": "b" * 65}, "after"),
])
def test_list_bounds_are_400_naming_the_parameter(server, path, query, param):
    error = error_of(httpx.get(f"{server.base_url}{path}", params=query, headers=AUTH), 400, "invalid_value")
    assert param in error["param"]


def test_list_bounds_themselves_are_accepted(server):
    for path, limit in (("/v1/files", 10000), ("/v1/files", 1), ("/v1/batches", 100), ("/v1/batches", 1)):
        assert httpx.get(f"{server.base_url}{path}", params={"limit": limit}, headers=AUTH).status_code == 200


def upload(server, content: bytes, purpose: str = "batch") -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/files", headers=AUTH, data={"purpose": purpose},
                      files={"file": ("in.jsonl", content, "application/jsonl")})


def test_a_batch_file_over_its_line_limit_is_refused_at_upload(server):
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    assert upload(server, line * MAX_FILE_LINES).status_code == 200
    error = error_of(upload(server, line * (MAX_FILE_LINES + 1)), 400, "batch_file_too_many_lines")
    assert str(MAX_FILE_LINES) in error["message"]
    assert upload(server, line * (MAX_FILE_LINES + 1), purpose="user_data").status_code == 200


def test_a_batch_file_over_its_byte_limit_is_refused_at_upload(server):
    assert upload(server, b"x" * MAX_FILE_BYTES).status_code == 200
    error = error_of(upload(server, b"x" * (MAX_FILE_BYTES + 1)), 400, "batch_file_too_large")
    assert str(MAX_FILE_BYTES) in error["message"]


def test_a_stream_past_the_open_streams_limit_is_429_and_the_slot_comes_back(server, upstream):
    body = {"model": "frontier-api", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    url = f"{server.base_url}/v1/chat/completions"
    upstream.release.clear()
    try:
        with httpx.Client(timeout=30) as first_client, first_client.stream("POST", url, json=body,
                                                                          headers=AUTH) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert "held" in next(line for line in lines if "held" in line or "DONE" in line)
            refused = httpx.post(url, json=body, headers=AUTH, timeout=30)
            upstream.release.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        upstream.release.set()
    error_of(refused, 429, "too_many_streams")
    assert int(refused.headers["retry-after"]) >= 1
    again = httpx.post(url, json=body, headers=AUTH, timeout=30)  # the first stream's slot was given back
    assert again.status_code == 200 and again.text.rstrip().endswith("data: [DONE]")
    assert server.app.state.stream_slots.open == 0
