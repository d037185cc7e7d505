"""The OpenAPI document: the request shapes the official `openai` client sends validate against
each operation's requestBody schema, and the document names the answers, the errors, the query
bounds, the multipart upload and the links file -> batch -> output file."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from nowait.gateway.app import create_app
from nowait.gateway.config import parse_config
from tests.gateway_support import SMALL_SCHEMA, base_config, free_port, save_tiny_models


@pytest.fixture(scope="module")
def document(tmp_path_factory, codec) -> dict:
    root = tmp_path_factory.mktemp("openapi")
    config = base_config(save_tiny_models(root / "models", codec), root / "data", free_port())
    return create_app(parse_config(config)).openapi()


def recorded_requests(send) -> list[httpx.Request]:
    """Every request the openai client sends while `send(client)` runs, answered by a stub."""
    seen: list[httpx.Request] = []

    def stub(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500, json={"error": {"message": "recorded", "type": "server_error"}})

    client = openai.OpenAI(base_url="http://recorder/v1", api_key="sk-x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(stub)))
    for call in send:
        with pytest.raises(openai.InternalServerError):
            call(client)
    return seen


def request_schema(document: dict, method: str, path: str, media_type: str = "application/json") -> dict:
    schema = document["paths"][path][method]["requestBody"]["content"][media_type]["schema"]
    return {**schema, "components": document["components"]}  # the $refs resolve against the document


CHAT_SHAPES = [
    lambda c: c.chat.completions.create(model="nowait", messages=[{"role": "user", "content": "hi"}]),
    lambda c: c.chat.completions.create(
        model="ar", messages=[{"role": "system", "content": "Extract."},
                              {"role": "user", "content": [{"type": "text", "text": "Name: Ann"}]},
                              {"role": "assistant", "content": "ok"}],
        max_tokens=8, temperature=0.5, top_p=0.9, seed=7, stop=["\n"], n=2, user="u1"),
    lambda c: c.chat.completions.create(
        model="diffusion", messages=[{"role": "user", "content": "x"}], max_completion_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "kyc", "schema": SMALL_SCHEMA,
                                                                 "strict": True}},
        extra_body={"nowait": {"latency_budget_ms": 200, "token_value_usd_per_mtok": 0.5,
                               "data_class": "restricted", "batchable": False}}),
    lambda c: c.chat.completions.create(model="ar", messages=[{"role": "user", "content": "x"}],
                                        response_format={"type": "json_object"}, stream=True,
                                        stream_options={"include_usage": True}),
]
COMPLETION_SHAPES = [
    lambda c: c.completions.create(model="ar", prompt="Name:"),
    lambda c: c.completions.create(model="ar", prompt=["a", "b"], max_tokens=4, echo=False, stream=True),
    lambda c: c.completions.create(model="ar", prompt=[1, 2, 3], seed=1, temperature=0),
]
BATCH_SHAPES = [
    lambda c: c.batches.create(input_file_id="file-abc", endpoint="/v1/chat/completions", completion_window="24h"),
    lambda c: c.batches.create(input_file_id="file-abc", endpoint="/v1/completions", completion_window="24h",
                               metadata={"job": "nightly"}),
]


@pytest.mark.parametrize("path,shapes", [("/v1/chat/completions", CHAT_SHAPES),
                                         ("/v1/completions", COMPLETION_SHAPES),
                                         ("/v1/batches", BATCH_SHAPES)])
def test_what_the_openai_client_sends_validates_against_the_request_schema(document, path, shapes):
    schema = request_schema(document, "post", path)
    sent = recorded_requests(shapes)
    assert len(sent) == len(shapes)
    for request in sent:
        assert request.url.path == path
        jsonschema.validate(json.loads(request.content), schema)


def test_a_body_the_server_refuses_does_not_validate_either(document):
    """The schema is the server's own: what pydantic refuses, the document refuses too."""
    schema = request_schema(document, "post", "/v1/chat/completions")
    for wrong in ({"model": "ar", "messages": []}, {"model": "ar", "messages": [{"role": "robot"}]},
                  {"model": "ar", "messages": [{"role": "user"}], "n": 0},
                  {"model": "ar", "messages": [{"role": "user"}], "nowait": {"unknown": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_the_file_upload_is_multipart_with_the_fields_the_client_sends(document):
    schema = request_schema(document, "post", "/v1/files", "multipart/form-data")
    sent = recorded_requests([lambda c: c.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")])
    body = sent[0].content.decode()
    assert sent[0].headers["content-type"].startswith("multipart/form-data")
    for field in schema["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]["required"]:
        assert f'name="{field}"' in body


def test_answers_errors_and_bounds_are_documented(document):
    paths = document["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert "text/event-stream" in chat["200"]["content"]
    assert "422" not in chat  # validation is answered as a 400 error object
    for status in ("400", "401", "404", "429", "503", "504"):
        assert chat[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    nowait = document["components"]["schemas"]["ChatCompletion"]["properties"]["nowait"]
    assert "NowaitInfo" in json.dumps(nowait)
    files_limit = next(p for p in paths["/v1/files"]["get"]["parameters"] if p["name"] == "limit")["schema"]
    assert (files_limit["minimum"], files_limit["maximum"]) == (1, 10000)
    batches = {p["name"]: p["schema"] for p in paths["/v1/batches"]["get"]["parameters"]}
    assert (batches["limit"]["minimum"], batches["limit"]["maximum"]) == (1, 100)
    assert "maxLength" in json.dumps(batches["after"])
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids))


def test_links_tie_a_file_to_its_batch_and_the_batch_to_its_output(document):
    paths = document["paths"]
    by_id = {op["operationId"]: (method, path) for path, ops in paths.items() for method, op in ops.items()}
    upload = paths["/v1/files"]["post"]["responses"]["200"]["links"]["CreateBatchFromFile"]
    assert by_id[upload["operationId"]] == ("post", "/v1/batches")
    assert upload["requestBody"]["input_file_id"] == "$response.body#/id"
    created = paths["/v1/batches"]["post"]["responses"]["200"]["links"]["GetBatch"]
    assert by_id[created["operationId"]] == ("get", "/v1/batches/{batch_id}")
    output = paths["/v1/batches/{batch_id}"]["get"]["responses"]["200"]["links"]["GetOutputFile"]
    assert by_id[output["operationId"]] == ("get", "/v1/files/{file_id}/content")
    assert output["parameters"] == {"file_id": "$response.body#/output_file_id"}
