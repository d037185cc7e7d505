"""Shared by the gateway tests: tiny checkpoints, a fake upstream, and one live server on loopback.

Every server is a real uvicorn on 127.0.0.1 with a free port, driven by the official `openai`
client; the fake upstream is mounted inside the same server (under /upstream), so a test runs one
live server at a time.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nowait.checkpoints import save_pretrained
from nowait.gateway.app import create_app
from nowait.gateway.config import parse_config
from nowait.tokenizer import TextCodec
from tests.conftest import build_model

API_KEY = "sk-test-key"
# Enum and boolean properties: a random model under a grammar or a template answers them in a few
# tokens, so the JSON is complete and valid whatever the weights.
SMALL_SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["kyc", "loan"]}, "ok": {"type": "boolean"}},
                "required": ["kind", "ok"], "additionalProperties": False}


def requests_with_a_kill(ask: Callable[[int], None], total: int, kill_after: int, kill: Callable[[], None],
                         concurrency: int = 8) -> tuple[list[int], list[str]]:
    """`ask(0..total-1)` from `concurrency` threads, `kill()` called once `kill_after` are answered
    (or at the first error): the requests answered and the errors the clients saw."""
    done: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            ask(i)
            with lock:
                done.append(i)
        except Exception as error:
            with lock:
                errors.append(repr(error))

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, i) for i in range(total)]
        while len(done) < kill_after and not errors:
            time.sleep(0.01)
        kill()
        for future in futures:
            future.result()
    assert len(done) + len(errors) == total
    return done, errors


def save_tiny_models(directory: Path, codec: TextCodec) -> dict[str, str]:
    """ar, draft (causal) and diffusion (bidirectional) checkpoints with the test tokenizer."""
    out = {}
    vocab = codec.vocab_size
    for name, model in (("ar", build_model(0, vocab_size=vocab)),
                        ("draft", build_model(1, vocab_size=vocab, num_layers=1)),
                        ("diffusion", build_model(2, vocab_size=vocab, causal=False, mask_token_id=codec.mask_id))):
        out[name] = str(save_pretrained(model, codec, directory / name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_config(models: dict[str, str], data_dir: Path, port: int, **overrides: Any) -> dict:
    """A config with the three owned engines and an external frontier API served by the fake upstream."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "request_timeout_s": 30},
        "auth": {"api_keys": [API_KEY], "api_keys_env": None},
        "data_dir": str(data_dir),
        "engines": {
            "ar": {"kind": "ar", "model": models["ar"], "node_usd_per_hour": 36.0, "max_num_seqs": 8,
                   "max_num_batched_tokens": 1024},
            "spec": {"kind": "spec", "model": models["ar"], "draft": models["draft"], "node_usd_per_hour": 36.0},
            "diffusion": {"kind": "diffusion", "model": models["diffusion"], "node_usd_per_hour": 36.0,
                          "options": {"block": 16}},
            "frontier-api": {"kind": "remote", "base_url": f"http://127.0.0.1:{port}/upstream/v1",
                             "model": "frontier-large", "data_classes": ["public", "internal"],
                             "input_usd_per_mtok": 2.0, "output_usd_per_mtok": 10.0, "timeout_s": 10},
        },
        "routing": {"high_value_usd_per_mtok": 5.0, "confidence_threshold": 0.0},
        "defaults": {"max_tokens": 24, "data_class": "internal"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


class FakeUpstream:
    """An OpenAI-compatible upstream that records every request it receives."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.fail_with: int | None = None
        self.app = FastAPI()

        @self.app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.received.append({"headers": dict(request.headers), "body": body})
            if self.fail_with is not None:
                return JSONResponse({"error": {"message": "upstream down", "type": "server_error"}},
                                    status_code=self.fail_with)
            usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
                     "prompt_tokens_details": {"cached_tokens": 8}}
            if body.get("stream"):
                def events():
                    for piece in ("from ", "the ", "frontier"):
                        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            return {"id": "up-1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "from the frontier"},
                                 "finish_reason": "stop"}], "usage": usage}


class LiveServer:
    """uvicorn in a thread on loopback; `client()` is the official openai client pointed at it."""

    def __init__(self, config: dict, upstream: FakeUpstream | None = None) -> None:
        self.config = parse_config(config)
        self.port = self.config.server.port
        self.app = create_app(self.config)
        if upstream is not None:
            self.app.mount("/upstream", upstream.app)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kwargs.pop("api_key", API_KEY),
                             max_retries=kwargs.pop("max_retries", 0), **kwargs)

    @property
    def gateway(self):
        return self.app.state.gateway


@contextmanager
def live_server(config: dict, upstream: FakeUpstream | None = None):
    server = LiveServer(config, upstream).start()
    try:
        yield server
    finally:
        server.stop()
