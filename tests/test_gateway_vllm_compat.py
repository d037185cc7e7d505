"""vLLM's side endpoints against a live server: health and ping (no key), version, tokenize and
detokenize with vLLM's shapes, and `max_model_len` on the model cards."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import httpx
import pytest

from nowait.gateway.app import create_app
from nowait.gateway.config import parse_config
from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("vllm-compat")
    return save_tiny_models(root / "models", codec), root


@pytest.fixture(scope="module")
def server(models):
    saved, root = models
    with live_server(base_config(saved, root / "data", free_port())) as live:
        yield live


def test_health_and_ping_answer_without_a_key(server):
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        response = httpx.request(method, f"{server.base_url}{path}")
        assert response.status_code == 200, (method, path, response.text)
    assert httpx.get(f"{server.base_url}/version").json() == {"version": version("nowait")}


def test_health_is_503_while_starting_and_while_draining(models):
    """Before the lifespan has loaded the engines, and once shutdown has begun, probes are told 503."""
    saved, root = models
    app = create_app(parse_config(base_config(saved, root / "drain-data", free_port())))

    async def probe() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            starting = await client.get("/health")
            early = await client.post("/tokenize", json={"model": "ar", "prompt": "x"})
            assert early.status_code == 503 and early.json()["error"]["code"] == "starting"
            models = await client.get("/v1/models", headers=AUTH)  # every route: 503, not a crash
            assert models.status_code == 503 and models.json()["error"]["code"] == "starting"
            async with app.router.lifespan_context(app):
                serving = await client.get("/health")
            return [starting, serving, await client.get("/ping")]

    starting, serving, draining = asyncio.run(probe())
    assert starting.status_code == 503 and starting.json() == {"status": "starting"}
    assert serving.status_code == 200
    assert draining.status_code == 503 and draining.json() == {"status": "draining"}


def test_tokenize_a_prompt_counts_what_completions_bill(server):
    prompt = "Name: Ann Lee\nDate of birth: 1990-01-02"
    body = httpx.post(f"{server.base_url}/tokenize", json={"model": "ar", "prompt": prompt}).json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == server.gateway.backends["ar"].max_model_len
    completion = server.client().completions.create(model="ar", prompt=prompt, max_tokens=2)
    assert completion.usage.prompt_tokens == body["count"]
    back = httpx.post(f"{server.base_url}/detokenize", json={"model": "ar", "tokens": body["tokens"]}).json()
    assert back == {"prompt": prompt}


def test_tokenize_messages_counts_what_chat_bills(server):
    messages = [{"role": "system", "content": "Extract the form as JSON."}, {"role": "user", "content": "Name: Bo"}]
    body = httpx.post(f"{server.base_url}/tokenize", json={"model": "ar", "messages": messages}).json()
    chat = server.client().chat.completions.create(model="ar", messages=messages, max_tokens=2)
    assert body["count"] == chat.usage.prompt_tokens
    without = httpx.post(f"{server.base_url}/tokenize", json={
        "model": "ar", "messages": messages, "add_generation_prompt": False, "return_token_strs": True}).json()
    # The generation prompt is the assistant marker: one token fewer without it.
    assert without["tokens"] == body["tokens"][:-1]
    assert without["token_strs"] == [server.gateway.backends["ar"].codec.tokenizer.id_to_token(t)
                                     for t in without["tokens"]]


def test_tokenize_refusals(server):
    unknown = httpx.post(f"{server.base_url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    remote = httpx.post(f"{server.base_url}/tokenize", json={"model": "frontier-api", "prompt": "x"})
    assert remote.status_code == 400 and remote.json()["error"]["code"] == "unsupported_model"
    both = httpx.post(f"{server.base_url}/tokenize", json={"model": "ar", "prompt": "x", "messages": []})
    assert both.status_code == 400
    vocab = server.gateway.backends["ar"].codec.vocab_size
    bad = httpx.post(f"{server.base_url}/detokenize", json={"model": "ar", "tokens": [1, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"


def test_router_model_tokenizes_with_its_batch_engine(server):
    prompt = "Name: Cy"
    routed = httpx.post(f"{server.base_url}/tokenize", json={"model": "nowait", "prompt": prompt}).json()
    batch = httpx.post(f"{server.base_url}/tokenize", json={"model": server.gateway.policy.batch_engine,
                                                            "prompt": prompt}).json()
    assert routed["tokens"] == batch["tokens"]


def test_model_cards_carry_max_model_len(server):
    cards = {m.id: m for m in server.client().models.list().data}
    backends = server.gateway.backends
    for name in ("ar", "spec", "diffusion"):
        assert cards[name].model_extra["max_model_len"] == backends[name].max_model_len
    assert cards["frontier-api"].model_extra["max_model_len"] is None  # a remote upstream does not say
    owned = [backends[n].max_model_len for n in ("ar", "spec", "diffusion")]
    assert cards["nowait"].model_extra["max_model_len"] == min(owned)
    assert httpx.get(f"{server.base_url}/v1/models/ar", headers=AUTH).json()["max_model_len"] == owned[0]
