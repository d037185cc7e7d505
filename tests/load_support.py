"""Shared by the load-bench and demo tests: a fake OpenAI-compatible server, tiny checkpoints that
fit the extraction corpus, and a Typer app with the commands registered as cli.py registers them.

The fake server is what a vLLM or SGLang server looks like to the bench: `/v1/models` without
engine kinds, chat completions streamed with a usage chunk, no `nowait` fields; its answers come
at a known pace (a first-token delay and a gap per token) so timings can be checked roughly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nowait.checkpoints import save_pretrained
from nowait.tokenizer import TextCodec
from tests.conftest import build_model
from tests.gateway_support import free_port

ANSWER = '{"full_name": "Ada Lovelace", "nationality": null}'


def fake_openai_app(first_token_s: float = 0.01, token_gap_s: float = 0.002, tokens: int = 6) -> FastAPI:
    app = FastAPI()
    app.state.received = []

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        # The client port tells one kept-alive connection from a new one per request.
        app.state.received.append({"headers": dict(request.headers), "body": body,
                                   "client_port": request.client.port if request.client else None})
        if body.get("model") != "fake-model":
            error = {"message": f"no model {body.get('model')}", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=404)
        pieces = [ANSWER[i::tokens] for i in range(tokens)]  # any split: the bench only times it
        usage = {"prompt_tokens": 40, "completion_tokens": tokens, "total_tokens": 40 + tokens}
        if not body.get("stream"):
            await asyncio.sleep(first_token_s + token_gap_s * (tokens - 1))
            return {"id": "x", "object": "chat.completion", "created": 0, "model": "fake-model",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER},
                                 "finish_reason": "stop"}], "usage": usage}

        async def events():
            await asyncio.sleep(first_token_s)
            for index, piece in enumerate(pieces):
                if index:
                    await asyncio.sleep(token_gap_s)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def serve(app: FastAPI):
    """`app` under uvicorn on a free loopback port, for the length of the block; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def save_corpus_models(directory: Path, codec: TextCodec, diffusion: bool = True) -> Path:
    """Tiny random ar, draft and diffusion checkpoints with room for corpus prompts (1024 positions:
    the test tokenizer makes prompts of up to ~330 tokens, plus a 256-token answer window)."""
    vocab = codec.vocab_size
    models = [("ar", build_model(0, vocab_size=vocab, max_position=1024)),
              ("draft", build_model(1, vocab_size=vocab, num_layers=1, max_position=1024))]
    if diffusion:
        models.append(("diffusion", build_model(2, vocab_size=vocab, causal=False, mask_token_id=codec.mask_id,
                                                max_position=1024)))
    for name, model in models:
        save_pretrained(model, codec, directory / name)
    return directory


def cli_app() -> typer.Typer:
    """`nowait demo` and `nowait bench load` on an app of their own (cli.py adds them the same way)."""
    from nowait.bench.load import register as register_load
    from nowait.demo.cli import register as register_demo

    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def root() -> None:
        """test app"""

    bench = typer.Typer()
    register_load(bench)
    app.add_typer(bench, name="bench")
    register_demo(app)
    return app


def last_json(output: str) -> dict:
    """The JSON object a --json command printed (its last line)."""
    return json.loads(output.strip().splitlines()[-1])
