"""SIGTERM to a real `nowait serve` process (`python -m nowait.gateway`): it stops accepting, lets
a running request finish within `server.shutdown_grace_s`, cancels what outlives the grace and
stops; a batch interrupted that way is answered after the next start, each line once.

The requests run on an upstream (a remote engine) served by this test, which holds each answer
until the test lets it go: so a request is surely running when the signal arrives."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from nowait.bench.soak import GatewayProcess
from tests.gateway_support import API_KEY, base_config, free_port, save_tiny_models

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HANG_GUARD_S = 90  # only so a regression fails instead of hanging; never a speed bound
HOLD_S = 300  # an upstream answer held this long outlives every guard of the test


class HeldUpstream:
    """An OpenAI-compatible upstream whose answers wait for `release`, counting arrivals."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.arrived = 0
        self.app = FastAPI()

        @self.app.post("/v1/chat/completions")
        async def chat(body: dict):
            import asyncio

            self.arrived += 1
            deadline = time.monotonic() + HOLD_S
            while not self.release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return {"id": "up", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "from upstream"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


@pytest.fixture
def upstream():
    held = HeldUpstream()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(held.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    held.port = port
    yield held
    held.release.set()
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec):
    return save_tiny_models(tmp_path_factory.mktemp("shutdown-models"), codec)


def gateway(tmp_path, name: str, models, upstream, grace_s: float) -> GatewayProcess:
    # request_timeout_s past the hold: only the grace period may cut a held request short.
    config = base_config(models, tmp_path / "data", free_port(),
                         server={"shutdown_grace_s": grace_s, "request_timeout_s": HOLD_S},
                         batches={"max_concurrent_lines": 2})
    config["engines"] = {name: config["engines"][name] for name in ("ar", "diffusion", "frontier-api")}
    config["engines"]["frontier-api"] |= {"base_url": f"http://127.0.0.1:{upstream.port}/v1", "timeout_s": HOLD_S}
    work = tmp_path / name
    work.mkdir()
    process = GatewayProcess(config, work)
    process.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        assert process.process.poll() is None, process.log_tail()
        try:
            if httpx.get(f"http://127.0.0.1:{process.port}/readyz", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.2)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def in_background(send) -> dict:
    """Run `send()` in a thread; the dict gets its response (or error) when it returns."""
    result: dict = {}

    def run() -> None:
        try:
            result["response"] = send()
        except httpx.HTTPError as error:
            result["error"] = error

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def chat(process: GatewayProcess) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{process.port}/v1/chat/completions", headers=AUTH, timeout=HOLD_S,
                      json={"model": "frontier-api", "messages": [{"role": "user", "content": "hi"}]})


def refuses_connections(process: GatewayProcess) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{process.port}/healthz", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_sigterm_lets_a_running_request_finish_and_accepts_no_new_ones(tmp_path, models, upstream):
    process = gateway(tmp_path, "drain", models, upstream, grace_s=HANG_GUARD_S)
    try:
        running = in_background(lambda: chat(process))
        wait_for(lambda: upstream.arrived == 1, "the request reached the upstream")
        process.process.send_signal(signal.SIGTERM)
        wait_for(lambda: refuses_connections(process), "the server stopped accepting connections")
        assert process.process.poll() is None  # still draining: the request runs on
        upstream.release.set()
        running["thread"].join(HANG_GUARD_S)
        assert process.process.wait(HANG_GUARD_S) is not None
    finally:
        process.stop()
    answer = running.get("response")
    assert answer is not None and answer.status_code == 200, running
    assert answer.json()["choices"][0]["message"]["content"] == "from upstream"


def test_sigterm_past_the_grace_period_cancels_what_runs_and_stops(tmp_path, models, upstream):
    process = gateway(tmp_path, "grace", models, upstream, grace_s=1.0)
    try:
        running = in_background(lambda: chat(process))
        wait_for(lambda: upstream.arrived == 1, "the request reached the upstream")
        process.process.send_signal(signal.SIGTERM)
        try:  # the held answer would keep a server without a grace period up for HOLD_S
            process.process.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the server outlived its grace period with a request running")
        running["thread"].join(HANG_GUARD_S)
    finally:
        process.stop()
    answer = running.get("response")
    assert answer is None or answer.status_code != 200, answer.text  # cut off, not answered


def test_a_batch_interrupted_by_sigterm_resumes_after_restart_each_line_once(tmp_path, models, upstream):
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "frontier-api", "messages": [{"role": "user", "content": f"hi {i}"}]}}
             for i in range(5)]
    first = gateway(tmp_path, "before", models, upstream, grace_s=1.0)
    try:
        base = f"http://127.0.0.1:{first.port}/v1"
        uploaded = httpx.post(f"{base}/files", headers=AUTH, data={"purpose": "batch"},
                              files={"file": ("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines))})
        batch = httpx.post(f"{base}/batches", headers=AUTH, json={"input_file_id": uploaded.json()["id"],
                                                                 "endpoint": "/v1/chat/completions",
                                                                 "completion_window": "24h"}).json()
        wait_for(lambda: upstream.arrived == 2, "two lines reached the upstream")  # max_concurrent_lines
        interrupted = httpx.get(f"{base}/batches/{batch['id']}", headers=AUTH).json()
        first.process.send_signal(signal.SIGTERM)
        first.process.wait(HANG_GUARD_S)
    finally:
        first.stop()
    assert interrupted["status"] == "in_progress" and interrupted["request_counts"]["completed"] == 0
    upstream.release.set()
    second = gateway(tmp_path, "after", models, upstream, grace_s=1.0)
    try:
        base = f"http://127.0.0.1:{second.port}/v1"

        def ended() -> bool:
            return httpx.get(f"{base}/batches/{batch['id']}", headers=AUTH).json()["status"] == "completed"

        wait_for(ended, "the batch completed after the restart")
        done = httpx.get(f"{base}/batches/{batch['id']}", headers=AUTH).json()
        output = httpx.get(f"{base}/files/{done['output_file_id']}/content", headers=AUTH).text
    finally:
        second.stop()
    answered = [json.loads(line) for line in output.splitlines() if line.strip()]
    assert sorted(a["custom_id"] for a in answered) == [line["custom_id"] for line in lines]
    assert all(a["response"]["status_code"] == 200 for a in answered)
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
