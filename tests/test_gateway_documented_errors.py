"""Each error and fallback cause docs/gateway.md documents, produced for real and checked by its
`code` and HTTP status (not only its message): `schema_unsupported` and its 400 without a
fallback engine, `invalid_output` for a json_schema, a remote engine without its key (503) or at
its `max_concurrency` (429), failover when an upstream refuses connections or times out,
`/readyz` 503, an unknown file or batch's 404 `not_found`, every `unsupported_parameter` refusal, and batch lines that
wait out a 429.

The upstreams are real HTTP servers on loopback: a scripted app mounted in the gateway's own
uvicorn (slow, or held until the test lets it answer), and a closed port for a refused connection.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI

from nowait.gateway.ledger import read_audit_log
from tests.gateway_support import API_KEY, SMALL_SCHEMA, base_config, free_port, live_server, save_tiny_models

MESSAGES = [{"role": "user", "content": "Name: Ann Lee"}]
# A nested object: the diffusion template lays out scalar slots only, AR's grammar takes it.
NESTED_SCHEMA = {"type": "object", "required": ["person"], "properties": {
    "person": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
UNSET_KEY_VARIABLE = "NOWAIT_TEST_KEY_THAT_IS_NEVER_SET"
SLOW_UPSTREAM_S = 3.0  # how long the slow upstream takes: far past its engine's timeout_s


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


class ScriptedUpstream:
    """OpenAI-compatible upstreams whose timing the test controls: `/slow` answers after
    SLOW_UPSTREAM_S, `/held` once `release` is set (or after 10 s, so nothing hangs)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.app = FastAPI()

        def answer(model: str) -> dict:
            return {"id": "up-1", "object": "chat.completion", "created": 0, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "upstream"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

        @self.app.post("/slow/v1/chat/completions")
        async def slow(body: dict):
            await asyncio.sleep(SLOW_UPSTREAM_S)
            return answer(body["model"])

        @self.app.post("/held/v1/chat/completions")
        async def held(body: dict):
            deadline = time.monotonic() + 10
            while not self.release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return answer(body["model"])


@pytest.fixture(scope="module")
def upstream():
    return ScriptedUpstream()


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec, upstream, monkeypatch_module):
    root = tmp_path_factory.mktemp("gateway-documented-errors")
    models = save_tiny_models(root / "models", codec)
    port = free_port()
    monkeypatch_module.delenv(UNSET_KEY_VARIABLE, raising=False)
    remote = {"kind": "remote", "model": "upstream-model", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}
    config = base_config(models, root / "data", port, batches={"max_concurrent_lines": 2})
    engines = config["engines"]
    del engines["spec"], engines["frontier-api"]  # not needed here: a faster start
    engines |= {
        # Not the router's fast engine: pinned, it has no fallback.
        "diffusion-raw": {"kind": "diffusion", "model": models["diffusion"], "options": {"block": 16}},
        # One request at a time, none waiting: a second one is refused with 429.
        "tight": {"kind": "ar", "model": models["ar"], "max_num_seqs": 1, "max_queue": 0, "structured": False},
        # Nothing listens on a port just freed: every connection is refused.
        "closed-api": {**remote, "base_url": f"http://127.0.0.1:{free_port()}/v1", "data_classes": ["public"]},
        "slow-api": {**remote, "base_url": f"http://127.0.0.1:{port}/upstream/slow/v1", "data_classes": ["internal"],
                     "timeout_s": 0.3},
        "held-api": {**remote, "base_url": f"http://127.0.0.1:{port}/upstream/held/v1", "max_concurrency": 1,
                     "data_classes": ["public", "internal"]},
        "keyless-api": {**remote, "base_url": f"http://127.0.0.1:{port}/upstream/held/v1",
                        "api_key_env": UNSET_KEY_VARIABLE},
    }
    # High-value public work goes to closed-api, high-value internal work to slow-api: each fails.
    config["routing"] = {"confidence_threshold": 0.0, "frontier_remotes": ["closed-api", "slow-api"]}
    with live_server(config, upstream) as live:
        yield live


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=kwargs.pop("timeout", 30), **kwargs)


def error_of(response: httpx.Response, status: int, code: str, type: str | None = None) -> dict:
    """The OpenAI error object of `response`, after checking its status, code and type."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code, error
    if type is not None:
        assert error["type"] == type, error
    return error


def audit_entry(server, request_id: str) -> dict:
    return next(e for e in read_audit_log(server.config.audit_log_path) if e["request_id"] == request_id)


def metrics_text(server) -> str:
    return httpx.get(f"{server.base_url}/metrics").text


# --- structured output: schema_unsupported, invalid_output ---


def test_a_schema_the_fast_engine_cannot_template_runs_on_the_fallback_engine(server):
    """`schema_unsupported`: a pinned diffusion model keeps its fallback, and so does the router's."""
    client = server.client()
    for model, extra in (("diffusion", None), ("nowait", {"nowait": {"latency_budget_ms": 500}})):
        completion = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24,
                                                    response_format=json_schema_format(NESTED_SCHEMA),
                                                    extra_body=extra)
        info = completion.model_extra["nowait"]
        assert info["route"] == "ar" and info["fallback"] is True, info
        assert [a["engine"] for a in info["engines_tried"]] == ["diffusion", "ar"]
        assert audit_entry(server, completion.id)["fallback_cause"] == "schema_unsupported"
    assert 'nowait:fallbacks_total{cause="schema_unsupported",engine="diffusion",to="ar"} 2.0' in metrics_text(server)


def test_a_schema_the_engine_cannot_template_is_400_without_a_fallback_engine(server):
    """Pinned to a diffusion engine that is not the fast engine, nothing can take over: a 400
    naming response_format, before any byte of a stream."""
    body = {"model": "diffusion-raw", "messages": MESSAGES, "max_tokens": 24,
            "response_format": json_schema_format(NESTED_SCHEMA)}
    for stream in (False, True):
        error = error_of(post(server, "/v1/chat/completions", {**body, "stream": stream}), 400,
                         "schema_not_supported_by_engine", "invalid_request_error")
        assert error["param"] == "response_format" and "scalar" in error["message"]


def test_a_fast_answer_invalid_for_its_json_schema_reruns_on_the_fallback_engine(server, monkeypatch):
    """`invalid_output` for `json_schema` (not only json_object): the diffusion answer is valid
    JSON but breaks the schema (an enum value it does not list), so AR answers under its grammar."""
    backend = server.gateway.backends["diffusion"]
    run = backend.run

    async def run_then_break_the_enum(call, timeout_s):
        attempt = await run(call, timeout_s)
        return replace(attempt, text='{"kind": "mortgage", "ok": true}')

    monkeypatch.setattr(backend, "run", run_then_break_the_enum)
    completion = server.client().chat.completions.create(model="diffusion", messages=MESSAGES, max_tokens=24,
                                                         response_format=json_schema_format(SMALL_SCHEMA))
    info = completion.model_extra["nowait"]
    assert info["route"] == "ar" and info["fallback"] is True and "not JSON valid" in info["reason"]
    assert audit_entry(server, completion.id)["fallback_cause"] == "invalid_output"
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SMALL_SCHEMA)


# --- remote engines: an unset key, max_concurrency, refused connections, timeouts ---


def test_a_remote_engine_whose_key_is_unset_is_503(server):
    body = {"model": "keyless-api", "messages": MESSAGES, "nowait": {"data_class": "public"}}  # it may take public
    error = error_of(post(server, "/v1/chat/completions", body), 503, "engine_unavailable", "server_error")
    assert UNSET_KEY_VARIABLE in error["message"] and error["param"] == "model"
    assert "keyless-api" not in {m.id for m in server.client().models.list()}
    ready = httpx.get(f"{server.base_url}/readyz").json()["engines"]["keyless-api"]
    assert ready["available"] is False and UNSET_KEY_VARIABLE in ready["reason"]


def test_a_remote_engine_at_its_max_concurrency_is_429(server, upstream):
    """held-api takes one request at a time; the one held upstream is answered once released."""
    backend = server.gateway.backends["held-api"]
    body = {"model": "held-api", "messages": MESSAGES, "nowait": {"data_class": "public"}}
    upstream.release.clear()
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, server, "/v1/chat/completions", body)
            deadline = time.monotonic() + 10
            while backend.in_flight == 0 and not first.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert backend.in_flight == 1, "the first request never reached the upstream"
            refused = post(server, "/v1/chat/completions", body)
            upstream.release.set()
            answered = first.result(timeout=30)
    finally:
        upstream.release.set()
    error_of(refused, 429, "rate_limit_exceeded", "rate_limit_error")
    assert int(refused.headers["retry-after"]) >= 1
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == "upstream"


@pytest.mark.parametrize(("engine", "data_class", "failure"), [("closed-api", "public", "ConnectError"),
                                                                ("slow-api", "internal", "Timeout")])
def test_a_routed_upstream_that_cannot_be_reached_fails_over_to_the_owned_frontier(server, engine, data_class,
                                                                                   failure):
    """`upstream_failure` on a refused connection and on a timeout (the 5xx case is in
    test_gateway_routing.py), streamed or not; pinned, the same failure is a 502."""
    client = server.client()
    high_value = {"nowait": {"token_value_usd_per_mtok": 20, "data_class": data_class}}
    completion = client.chat.completions.create(model="nowait", messages=MESSAGES, max_tokens=4,
                                                extra_body=high_value)
    info = completion.model_extra["nowait"]
    assert info["route"] == "ar" and info["fallback"] is True and failure in info["reason"], info
    assert [a["engine"] for a in info["engines_tried"]] == [engine, "ar"]
    entry = audit_entry(server, completion.id)
    assert entry["decision"] == engine and entry["fallback_cause"] == "upstream_failure"
    chunks = list(client.chat.completions.create(model="nowait", messages=MESSAGES, max_tokens=4, stream=True,
                                                 extra_body=high_value))
    assert chunks[-1].model_extra["nowait"]["route"] == "ar"
    pinned = post(server, "/v1/chat/completions", {"model": engine, "messages": MESSAGES, **high_value})
    error = error_of(pinned, 502, "upstream_error", "server_error")
    assert failure in error["message"]


# --- readiness, files, unsupported parameters ---


def test_readyz_is_503_when_the_batch_engine_cannot_serve(tmp_path):
    """A server whose only engine (the batch engine) has no model starts, says it is not ready,
    and answers requests with 503 engine_unavailable (no other engine can stand in for it)."""
    config = {"server": {"host": "127.0.0.1", "port": free_port()}, "auth": {"api_keys": [API_KEY],
                                                                             "api_keys_env": None},
              "data_dir": str(tmp_path / "data"), "engines": {"ar": {"kind": "ar", "model": str(tmp_path / "none")}},
              "routing": {"fast_engine": None, "confidence_threshold": 0.5}}
    with live_server(config) as live:
        ready = httpx.get(f"{live.base_url}/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
        assert ready.json()["engines"]["ar"]["available"] is False
        assert httpx.get(f"{live.base_url}/healthz").status_code == 200  # alive, just not ready
        error_of(post(live, "/v1/chat/completions", {"model": "nowait", "messages": MESSAGES}), 503,
                 "engine_unavailable", "server_error")


def test_an_unknown_file_or_batch_is_404_not_found(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, param in (("GET", "/v1/files/file-nope", "file_id"),
                                ("GET", "/v1/files/file-nope/content", "file_id"),
                                ("DELETE", "/v1/files/file-nope", "file_id"),
                                ("GET", "/v1/batches/batch_nope", "batch_id"),
                                ("POST", "/v1/batches/batch_nope/cancel", "batch_id")):
        response = httpx.request(method, f"{server.base_url}{path}", headers=headers)
        assert error_of(response, 404, "not_found", "invalid_request_error")["param"] == param, (method, path)
    with pytest.raises(openai.NotFoundError) as error:
        server.client().files.retrieve("file-nope")
    assert error.value.body["code"] == "not_found"


CHAT = {"model": "ar", "messages": MESSAGES, "max_tokens": 2}
TEXT = {"model": "ar", "prompt": "Name:", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


UNSUPPORTED = [  # (endpoint, fields added to a valid body, the param the refusal names)
    ("chat", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("chat", {"tools": [TOOL]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tools"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "!"}, "echo"),
    ("completions", {"best_of": 2}, "echo"),
    ("chat", {"n": 2, "stream": True}, "n"),
    ("completions", {"n": 2, "stream": True}, "n"),
    ("completions", {"prompt": ["Name:", "Born:"], "stream": True}, "prompt"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), UNSUPPORTED,
                         ids=[f"{endpoint}-{'+'.join(fields)}" for endpoint, fields, _ in UNSUPPORTED])
def test_each_unsupported_parameter_is_refused_by_its_code(server, endpoint, fields, param):
    """Refused rather than ignored: 400 `unsupported_parameter` naming the field."""
    body = {**(CHAT if endpoint == "chat" else TEXT), **fields}
    error = error_of(post(server, f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", body), 400,
                     "unsupported_parameter", "invalid_request_error")
    assert error["param"] == param


# --- batches ---


def test_a_batch_line_waits_out_a_full_engine_instead_of_failing(server):
    """A line refused with 429 is retried (after its Retry-After) until its engine has room, and
    then answered 200; it never reaches the error file. "tight" admits one request; its place is
    taken here as a running request would take it, so the line's first try is surely refused."""
    backend = server.gateway.backends["tight"]
    line = {"custom_id": "waits", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tight", "prompt": "Name:", "max_tokens": 3}}
    client = server.client()
    uploaded = client.files.create(file=("wait.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())),
                                   purpose="batch")
    backend.in_flight += 1  # the one place is taken
    try:
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        line_id = f"req_{batch.id.removeprefix('batch_')}_"

        def refused_once() -> bool:
            return any(e["request_id"].startswith(line_id) and e["status"] == 429
                       for e in read_audit_log(server.config.audit_log_path))

        deadline = time.monotonic() + 20
        while not refused_once() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused_once(), "the line was never refused: the engine was not full"
    finally:
        backend.in_flight -= 1  # the place is free again: the retry gets it
    deadline = time.monotonic() + 30
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)
    assert batch.status == "completed" and batch.request_counts.completed == 1 and batch.request_counts.failed == 0
    [answer] = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert answer["custom_id"] == "waits" and answer["response"]["status_code"] == 200
    assert batch.error_file_id is None
    assert 'nowait:request_errors_total{code="rate_limit_exceeded",status="429"}' in metrics_text(server)
