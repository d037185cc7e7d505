"""The Responses API with the official client, unchanged, against a live server: plain, json_schema
through `text.format`, streamed (typed events, in order, numbered), the refusals, and the same
routing and pricing as the chat request it means."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.gateway_support import API_KEY, SMALL_SCHEMA, base_config, free_port, live_server, save_tiny_models
from tests.tenant_support import ADMIN_KEY, create_key

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("gateway-responses")
    models = save_tiny_models(root / "models", codec)
    config = base_config(models, root / "data", free_port(), auth={"admin_keys": [ADMIN_KEY], "admin_keys_env": None})
    with live_server(config) as live:
        yield live


def test_plain_response_is_the_chat_answer(server):
    client = server.client()
    raw = client.responses.with_raw_response.create(model="ar", instructions="Extract the form as JSON.",
                                                    input="Name: Ann Lee", max_output_tokens=8)
    response = raw.parse()
    assert raw.headers["x-nowait-route"] == "ar"
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "ar"
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.store is False  # nothing is stored
    info = response.model_extra["nowait"]
    assert info["route"] == "ar" and info["rule"] == "pinned" and info["cost_usd"] > 0
    # The same request through chat: the same prompt, the same (greedy) answer.
    chat = client.chat.completions.create(model="ar", max_tokens=8, messages=[
        {"role": "system", "content": "Extract the form as JSON."}, {"role": "user", "content": "Name: Ann Lee"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_message_input_and_router_model(server):
    response = server.client().responses.create(
        model="nowait", max_output_tokens=6,
        input=[{"role": "developer", "content": "Extract the form as JSON."},
               {"role": "user", "content": [{"type": "input_text", "text": "Name: Bo Chan"}]}],
        extra_body={"nowait": {"batchable": True}})
    info = response.model_extra["nowait"]
    assert info["route"] == server.gateway.policy.batch_engine and info["rule"] != "pinned"
    assert isinstance(response.output_text, str)


@pytest.mark.parametrize("engine", ["ar", "diffusion"])
def test_json_schema_through_text_format(server, engine):
    response = server.client().responses.create(
        model=engine, input="Name: Ann Lee, loan", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "form", "schema": SMALL_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SMALL_SCHEMA)
    assert response.text.format.type == "json_schema" and response.text.format.name == "form"


def test_streamed_response_events_in_order(server):
    stream = server.client().responses.create(model="ar", input="Name: Ann Lee", max_output_tokens=10, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_EVENTS
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):-1] == CLOSING_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert kinds[-1] == ("response.incomplete" if final.status == "incomplete" else "response.completed")
    text = "".join(d.delta for d in deltas)
    assert events[4 + len(deltas)].text == text == final.output_text
    assert final.usage.output_tokens >= 1 and final.model_extra["nowait"]["route"] == "ar"
    # The streamed text is the answer: the same request without streaming gives the same (greedy).
    again = server.client().responses.create(model="ar", input="Name: Ann Lee", max_output_tokens=10)
    assert again.output_text == text


def test_stream_helper_parses_a_json_schema_stream(server):
    """The client's own stream helper accumulates the events into the final response."""
    with server.client().responses.stream(
            model="ar", input="Name: Ann Lee, kyc", max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "form", "schema": SMALL_SCHEMA}}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), SMALL_SCHEMA)


def test_responses_are_routed_and_counted_like_chat(server):
    def routed() -> float:
        metrics = httpx.get(f"{server.base_url}/metrics").text
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith('nowait:routed_requests_total{') and 'engine="spec"' in line)

    before = routed()
    server.client().responses.create(model="spec", input="Name: Cy", max_output_tokens=4)
    assert routed() == before + 1


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "array"}}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_refusals_name_the_responses_field(server, extra, param):
    body = {"model": "ar", "input": "Name: Ann"} | extra
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().responses.create(**body)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == param
    if param == "previous_response_id":
        assert error["code"] == "unsupported_parameter"


def test_context_overflow_speaks_of_max_output_tokens(server):
    limit = server.gateway.backends["ar"].max_model_len
    response = httpx.post(f"{server.base_url}/v1/responses", headers=AUTH,
                          json={"model": "ar", "input": "Name: Ann", "max_output_tokens": limit})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "max_output_tokens" and "max_output_tokens" in error["message"]


def test_a_tenant_key_is_scoped_and_charged_on_responses_as_on_chat(server):
    key = create_key(server, "team-responses", models=["ar"])["key"]
    client = server.client(api_key=key)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.responses.create(model="spec", input="Name: Ann", max_output_tokens=4)
    assert refused.value.body["code"] == "model_not_allowed"
    client.responses.create(model="ar", input="Name: Ann", max_output_tokens=4)
    metrics = httpx.get(f"{server.base_url}/metrics").text
    counted = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("nowait:tenant_requests_total{") and 'tenant="team-responses"' in line}
    assert counted == {'code="200",tenant="team-responses"': 1.0, 'code="403",tenant="team-responses"': 1.0}
