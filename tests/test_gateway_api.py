"""The OpenAI surface with the official client, unchanged, against a live server on loopback:
chat, completions, streaming (with usage), json_schema output, models, health and metrics."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from nowait.gateway.ledger import read_audit_log
from tests.gateway_support import SMALL_SCHEMA, base_config, free_port, live_server, save_tiny_models

KYC_INSTRUCTION = "Extract the KYC onboarding form below as JSON."


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("gateway-api")
    models = save_tiny_models(root / "models", codec)
    config = base_config(models, root / "data", free_port())
    # A second diffusion engine that is not the router's fast engine: pinned, it has no fallback,
    # so its streams are relayed block by block instead of held.
    config["engines"]["diffusion-raw"] = {"kind": "diffusion", "model": models["diffusion"], "options": {"block": 8}}
    with live_server(config) as live:
        yield live


def test_chat_completion_answers_with_route_and_cost(server):
    raw = server.client().chat.completions.with_raw_response.create(
        model="ar", max_tokens=8,
        messages=[{"role": "system", "content": KYC_INSTRUCTION}, {"role": "user", "content": "Name: Ann Lee"}])
    completion = raw.parse()
    assert raw.headers["x-nowait-route"] == "ar"
    assert completion.object == "chat.completion" and completion.model == "ar"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    info = completion.model_extra["nowait"]
    assert info["route"] == "ar" and info["rule"] == "pinned" and info["fallback"] is False
    assert info["cost_usd"] > 0  # compute seconds x $36/h


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(server):
    """Requests that share a long instruction: from the third on (the shared blocks are stored
    the second time they are seen), prefill starts after them, and usage says so as OpenAI
    does (prompt_tokens_details.cached_tokens)."""
    instruction = KYC_INSTRUCTION + " Keep every field exactly as the form writes it." * 3
    answers = [server.client().chat.completions.create(
        model="ar", max_tokens=4, messages=[{"role": "system", "content": instruction},
                                            {"role": "user", "content": f"Name: {name}"}])
        for name in ("Ann Lee", "Bo Chan", "Cy Diaz")]
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert cached[2] >= 16 and cached[2] < answers[2].usage.prompt_tokens
    assert cached[2] % 16 == 0  # whole blocks
    metrics = httpx.get(f"{server.base_url}/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith('nowait:prefix_cache_hits_total{engine="ar"}')]
    assert hits and float(hits[0].split()[-1]) >= cached[2]


def test_chat_messages_fold_into_the_trained_prompt(server):
    """System instruction + pasted document become one user turn, as the demo models were trained."""
    backend = server.gateway.backends["ar"]
    folded = backend.codec.decode(backend.prompt_ids(_call([{"role": "system", "content": KYC_INSTRUCTION},
                                                            {"role": "user", "content": "Name: Ann\n"}])))
    assert folded == f"{KYC_INSTRUCTION}\nName: Ann\n"  # special tokens are not decoded
    ids = backend.prompt_ids(_call([{"role": "user", "content": f"{KYC_INSTRUCTION}\nName: Ann"}]))
    assert ids == backend.codec.encode(f"<|user|>{KYC_INSTRUCTION}\nName: Ann\n<|assistant|>")


def _call(messages):
    from nowait.gateway.domain import Call, Metadata
    from nowait.router import DataClass

    return Call(request_id="t", endpoint="chat", model="ar", messages=messages,
                meta=Metadata(None, 1.0, DataClass.internal, False))


def test_completions_with_several_prompts(server):
    completion = server.client().completions.create(model="ar", prompt=["Name: Ann", "Name: Bob"], max_tokens=4)
    assert completion.object == "text_completion"
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(isinstance(c.text, str) for c in completion.choices)
    assert completion.usage.completion_tokens <= 8


def test_streaming_chat_with_usage(server):
    stream = server.client().chat.completions.create(
        model="ar", max_tokens=12, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Name: Ann"}])
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["nowait"]["route"] == "ar"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens >= 1
    # The streamed text is the answer: the same request without streaming gives the same (greedy).
    again = server.client().chat.completions.create(model="ar", max_tokens=12,
                                                    messages=[{"role": "user", "content": "Name: Ann"}])
    assert text == again.choices[0].message.content


def test_streaming_completions_end_with_done(server):
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers={"Authorization": "Bearer sk-test-key"},
                      json={"model": "spec", "prompt": "Name:", "max_tokens": 6, "stream": True}) as response:
        assert response.headers["x-nowait-route"] == "spec"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["object"] == "text_completion" for e in events)


@pytest.mark.parametrize("engine", ["ar", "diffusion"])
def test_json_schema_output_for_the_callers_own_schema(server, engine):
    completion = server.client().chat.completions.create(
        model=engine, max_tokens=40, messages=[{"role": "user", "content": "Loan file: approved"}],
        response_format={"type": "json_schema", "json_schema": {"name": "decision", "schema": SMALL_SCHEMA}})
    value = json.loads(completion.choices[0].message.content)
    jsonschema.validate(value, SMALL_SCHEMA)
    assert completion.model_extra["nowait"]["route"] == engine


def test_models_lists_engines_and_the_router(server):
    models = {m.id: m.model_extra.get("kind") for m in server.client().models.list()}
    assert models == {"nowait": "router", "ar": "ar", "spec": "spec", "diffusion": "diffusion",
                      "diffusion-raw": "diffusion", "frontier-api": "remote"}


def test_health_readiness_and_metrics(server):
    assert httpx.get(f"{server.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["engines"]["diffusion"]["available"] is True
    server.client().chat.completions.create(model="ar", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("nowait:time_to_first_token_seconds_bucket", "nowait:inter_token_latency_seconds_bucket",
                 "nowait:e2e_request_latency_seconds_bucket", "nowait:generation_tokens_total",
                 "nowait:num_requests_waiting", "nowait:engine_utilization",
                 "nowait:effective_cost_usd_per_mtok", "nowait:routed_requests_total"):
        assert name in text, name
    cost = [line for line in text.splitlines() if line.startswith('nowait:effective_cost_usd_per_mtok{engine="ar"}')]
    assert cost and float(cost[0].split()[-1]) > 0


def test_every_request_is_in_the_audit_log(server):
    completion = server.client().chat.completions.create(model="nowait", max_tokens=4,
                                                         messages=[{"role": "user", "content": "x"}])
    entries = read_audit_log(server.config.audit_log_path)
    entry = next(e for e in entries if e["request_id"] == completion.id)
    assert entry["status"] == 200 and entry["decision"] == "diffusion" and entry["rule"] == "fast"
    assert entry["engines_tried"][0]["engine"] == "diffusion" and "reason" in entry and entry["cost_usd"] > 0


def test_json_object_mode_on_diffusion_falls_back_when_the_output_is_not_json(server):
    completion = server.client().chat.completions.create(
        model="diffusion", max_tokens=16, messages=[{"role": "user", "content": "Name: Ann"}],
        response_format={"type": "json_object"})
    info = completion.model_extra["nowait"]
    assert info["route"] == "ar" and info["fallback"] is True and "not JSON" in info["reason"]
    assert completion.choices[0].message.content.startswith("{")  # AR under the any-object grammar


def test_diffusion_streams_block_by_block(server):
    chunks = list(server.client().chat.completions.create(
        model="diffusion-raw", max_tokens=24, stream=True, messages=[{"role": "user", "content": "Name: Ann"}]))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    whole = server.client().chat.completions.create(model="diffusion-raw", max_tokens=24,
                                                    messages=[{"role": "user", "content": "Name: Ann"}])
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].model_extra["nowait"]["route"] == "diffusion-raw"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_answer(server, stream):
    client = server.client()
    full = client.completions.create(model="ar", prompt="Name: Ann", max_tokens=24).choices[0].text
    stop = full[6:9]
    assert len(full) > 12 and stop
    expected = full[: full.find(stop)]
    if stream:
        chunks = list(client.completions.create(model="ar", prompt="Name: Ann", max_tokens=24, stop=[stop],
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(model="ar", prompt="Name: Ann", max_tokens=24, stop=stop).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == expected and finish == "stop"


def test_several_choices(server):
    completion = server.client().chat.completions.create(model="ar", n=2, max_tokens=4, temperature=0.8, seed=3,
                                                         messages=[{"role": "user", "content": "Name: Ann"}])
    assert [c.index for c in completion.choices] == [0, 1]


def test_concurrent_clients_share_forwards(server):
    """Continuous batching across HTTP clients: six concurrent requests of 20 tokens take far fewer
    decode steps than the 120 they would one after another."""
    import asyncio

    import openai

    engine = server.gateway.backends["ar"].worker.engine
    before = engine.steps["decode"]

    async def burst():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="sk-test-key", max_retries=0)
        return await asyncio.gather(*(client.completions.create(model="ar", prompt=f"Name: {i}", max_tokens=20)
                                      for i in range(6)))

    answers = asyncio.run(burst())
    tokens = sum(a.usage.completion_tokens for a in answers)
    steps = engine.steps["decode"] - before
    assert tokens > 60 and steps < tokens / 2, (tokens, steps)
