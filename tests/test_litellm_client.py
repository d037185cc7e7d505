"""LiteLLM's SDK, unchanged, as a client of the gateway (`model="openai/<name>"`, `api_base`): chat,
a stream and a json_schema request, with the request metadata in and the `nowait` routing object
out, as LiteLLM hands them to its own callers."""

from __future__ import annotations

import importlib
import json
import os

import jsonschema
import pytest

from tests.gateway_support import API_KEY, SMALL_SCHEMA, base_config, free_port, live_server, save_tiny_models

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list, not a download
litellm = importlib.import_module("litellm")  # after the setting above, which it reads on import

MESSAGES = [{"role": "system", "content": "Extract the KYC onboarding form below as JSON."},
            {"role": "user", "content": "Name: Ann Lee"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("gateway-litellm")
    models = save_tiny_models(root / "models", codec)
    with live_server(base_config(models, root / "data", free_port())) as live:
        yield live


def complete(server, model: str, **kwargs):
    return litellm.completion(model=f"openai/{model}", api_base=f"{server.base_url}/v1", api_key=API_KEY,
                              messages=MESSAGES, **kwargs)


def test_chat_through_litellm_keeps_the_routing_object(server):
    answer = complete(server, "nowait", max_tokens=6, extra_body={"nowait": {"batchable": True}})
    info = answer.nowait
    assert info["rule"] == "batch" and info["route"] == server.gateway.policy.batch_engine
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    # The header LiteLLM keeps from the response says the same engine.
    assert answer._hidden_params["additional_headers"]["llm_provider-x-nowait-route"] == info["route"]


def test_metadata_as_a_body_field_reaches_the_router(server):
    """A LiteLLM proxy hands its client's body fields to `completion` as keyword arguments;
    LiteLLM sends an unknown one on to an OpenAI-compatible server in the body."""
    pinned = complete(server, "nowait", max_tokens=4, nowait={"batchable": True})
    assert pinned.nowait["rule"] == "batch"
    by_header = complete(server, "nowait", max_tokens=4, extra_headers={"x-nowait-batchable": "true"})
    assert by_header.nowait["rule"] == "batch"


def test_stream_through_litellm_ends_with_the_routing_object(server):
    chunks = list(complete(server, "ar", max_tokens=10, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    routed = [c.nowait for c in chunks if getattr(c, "nowait", None)]
    assert len(routed) == 1 and routed[0]["route"] == "ar"
    # The streamed text is the answer: the same request without streaming gives the same (greedy).
    assert text == complete(server, "ar", max_tokens=10).choices[0].message.content


@pytest.mark.parametrize("engine", ["ar", "diffusion"])
def test_json_schema_through_litellm(server, engine):
    answer = complete(server, engine, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "form", "schema": SMALL_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), SMALL_SCHEMA)
    assert answer.nowait["route"] == engine
