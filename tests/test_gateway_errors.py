"""Every refusal is an OpenAI error object: 401, 429 with Retry-After, bad JSON, unknown model,
over-long prompt, invalid schema, unsupported parameters, an engine whose model is missing; and a
client that hangs up cancels its work."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest

from nowait.checkpoints import save_pretrained
from nowait.gateway.errors import APIError
from nowait.gateway.ledger import read_audit_log
from tests.conftest import build_model
from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models

MESSAGES = [{"role": "user", "content": "Name: Ann"}]


def never_ending_model(codec, tokens: int = 400):
    """A tiny random model whose greedy answer to "Name:" runs at least `tokens` tokens, so the
    timeout and hang-up tests always catch it mid-generation (which seed does so depends on the
    test tokenizer, hence the search; it is deterministic)."""
    from nowait.engines.ar.engine import greedy_decode

    prompt = codec.encode("Name:")
    for seed in range(3, 40):
        model = build_model(seed, vocab_size=codec.vocab_size, max_position=4096)
        if len(greedy_decode(model, [prompt], tokens, codec.end_id)[0]) == tokens:
            return model
    raise AssertionError("no seed in 3..39 gives a tiny model that keeps generating")


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("gateway-errors")
    models = save_tiny_models(root / "models", codec)
    long_model = save_pretrained(never_ending_model(codec), codec, root / "long")
    config = base_config(models, root / "data", free_port())
    config["engines"] |= {
        # One sequence at a time and one waiting: the third concurrent request is refused.
        "tight": {"kind": "ar", "model": str(long_model), "max_num_seqs": 1, "max_num_batched_tokens": 64,
                  "max_queue": 1, "structured": False},
        "mercury": {"kind": "diffusion", "model": str(root / "not-trained-yet")},
    }
    config["routing"] = {"fast_engine": "mercury"}  # missing: latency-bound work must go to AR instead
    config["server"]["max_request_bytes"] = 64 * 1024
    with live_server(config) as live:
        yield live


def post(server, path, **kwargs):
    headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}{path}", headers=headers, timeout=kwargs.pop("timeout", 30), **kwargs)


def assert_error_object(response, status, code=None, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def test_missing_or_wrong_api_key_is_401(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-wrong").chat.completions.create(model="ar", messages=MESSAGES)
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "ar", "messages": MESSAGES})
    assert_error_object(response, 401, code="invalid_api_key")
    assert httpx.get(f"{server.base_url}/healthz").status_code == 200  # health needs no key


def test_bad_json_is_400(server):
    response = post(server, "/v1/chat/completions", content=b'{"model": "ar", "messages": [',
                    headers={"content-type": "application/json"})
    assert_error_object(response, 400, code="invalid_json")


def test_schema_violations_are_400_naming_the_field(server):
    error = assert_error_object(post(server, "/v1/chat/completions", json={"model": "ar", "messages": []}), 400)
    assert error["param"] == "messages"
    error = assert_error_object(post(server, "/v1/chat/completions",
                                     json={"model": "ar", "messages": MESSAGES, "max_tokens": 0}), 400)
    assert error["param"] == "max_tokens"
    error = assert_error_object(post(server, "/v1/chat/completions", json={"model": "ar", "messages": MESSAGES},
                                     headers={"x-nowait-data-class": "secret"}), 400)
    assert error["param"] == "x-nowait-data-class"


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as error:
        server.client().chat.completions.create(model="gpt-imaginary", messages=MESSAGES)
    assert error.value.body["code"] == "model_not_found" and "nowait" in error.value.body["message"]


def test_an_over_long_prompt_is_400(server):
    with pytest.raises(openai.BadRequestError) as error:
        server.client().chat.completions.create(model="ar", messages=[{"role": "user", "content": "Ann " * 600}])
    assert error.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as error:  # fits, but not with the output asked for
        server.client().completions.create(model="ar", prompt="Name: Ann", max_tokens=600)
    assert error.value.body["param"] == "max_tokens"


def test_invalid_schema_is_400(server):
    for schema in ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, {"type": "array"}):
        with pytest.raises(openai.BadRequestError) as error:
            server.client().chat.completions.create(
                model="ar", messages=MESSAGES,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert error.value.body["param"] == "response_format.json_schema.schema"


def test_unsupported_parameters_are_refused_not_ignored(server):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        server.client().chat.completions.create(model="ar", messages=MESSAGES, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="tools"):
        server.client().chat.completions.create(
            model="ar", messages=MESSAGES,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


def test_a_missing_model_leaves_its_engine_unavailable_with_a_clear_error(server):
    assert "mercury" not in {m.id for m in server.client().models.list()}
    with pytest.raises(openai.InternalServerError) as error:
        server.client().chat.completions.create(model="mercury", messages=MESSAGES)
    assert error.value.status_code == 503 and "not-trained-yet" in error.value.body["message"]
    # The router works around it: latency-bound, low-value work goes to AR.
    raw = server.client().chat.completions.with_raw_response.create(model="nowait", messages=MESSAGES, max_tokens=4)
    assert raw.headers["x-nowait-route"] == "ar"
    ready = httpx.get(f"{server.base_url}/readyz").json()
    assert ready["status"] == "ready" and ready["engines"]["mercury"]["available"] is False


def test_a_full_queue_is_429_with_retry_after(server):
    async def burst():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        calls = [client.completions.create(model="tight", prompt="Name:", max_tokens=300) for _ in range(6)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    answered = [r for r in results if not isinstance(r, Exception)]
    assert refused and len(answered) >= 2, results
    assert int(refused[0].response.headers["retry-after"]) >= 1
    assert refused[0].body["code"] == "rate_limit_exceeded"


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Poll `condition` until it holds or the deadline passes: a passing run returns as soon as
    it holds, and the deadline only bounds a failing one."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def tight_sequences(server, monkeypatch):
    """Every Sequence the "tight" engine takes during a test: the engine's own record of how a
    request ended (cancelled, or decoded on to its max_tokens), whatever its client saw."""
    engine = server.gateway.backends["tight"].worker.engine
    submit, taken = engine.submit, []

    def recording_submit(request):
        seq = submit(request)
        taken.append(seq)
        return seq

    monkeypatch.setattr(engine, "submit", recording_submit)
    return taken


# Far more than the engine decodes before a cancellation reaches it (a few hundred at most).
LONG_ANSWER = 3500


def assert_cancelled_mid_generation(server, seq) -> None:
    """The engine stopped decoding `seq` early and gave back its place. Checked on the sequence
    itself, not by waiting for the engine to go idle: an uncancelled sequence also leaves the
    engine, once it has decoded all its LONG_ANSWER tokens, but as `length`, not `cancelled`."""
    backend = server.gateway.backends["tight"]
    assert wait_until(lambda: seq.is_finished), f"still decoding after its client left: {seq!r}"
    assert seq.finish_reason == "cancelled" and len(seq.output_ids) < LONG_ANSWER, seq
    assert wait_until(lambda: backend.worker.running() == 0 and backend.in_flight == 0)


def test_a_client_that_hangs_up_cancels_its_work(server, tight_sequences):
    """A stream whose client disconnects leaves the engine at the next step: guards against a
    request that keeps its engine slot (and decodes for nobody) after its client has gone."""
    body = {"model": "tight", "prompt": "Name:", "max_tokens": LONG_ANSWER, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # got the first chunk: now hang up
    [seq] = tight_sequences
    assert_cancelled_mid_generation(server, seq)
    entry = read_audit_log(server.config.audit_log_path)[-1]
    assert entry["status"] == 499 and entry["model"] == "tight"


def test_a_non_streaming_client_that_hangs_up_cancels_its_work(server, tight_sequences):
    """The same for a plain request, found by the handler's disconnect poll: the client hangs up
    once the engine is decoding its request (awaited, not slept), and the engine stops."""
    async def hang_up_once_decoding():
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=30) as client:
            request = asyncio.create_task(client.post("/v1/completions", json={
                "model": "tight", "prompt": "Name:", "max_tokens": LONG_ANSWER}))
            deadline = time.monotonic() + 10
            while not tight_sequences and not request.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(hang_up_once_decoding())
    [seq] = tight_sequences
    assert_cancelled_mid_generation(server, seq)
    assert wait_until(lambda: read_audit_log(server.config.audit_log_path)[-1]["status"] == 499)


def test_a_request_past_its_timeout_is_504_and_stops(server, tight_sequences):
    """A run past its timeout is answered 504 and its sequence leaves the engine: guards against
    a timed-out request that goes on decoding after its client got the 504."""
    from nowait.gateway.domain import Call, Metadata, Sampling
    from nowait.router import DataClass

    backend = server.gateway.backends["tight"]
    call = Call(request_id="slow", endpoint="completions", model="tight", prompt="Name:",
                sampling=Sampling(max_tokens=LONG_ANSWER), meta=Metadata(None, 1.0, DataClass.internal, False))
    with pytest.raises(APIError) as error:
        asyncio.run(backend.run(call, timeout_s=0.3))
    assert error.value.status == 504 and error.value.code == "timeout"
    [seq] = tight_sequences
    assert_cancelled_mid_generation(server, seq)


def test_a_request_past_its_timeout_is_504_over_http(server, monkeypatch, tight_sequences):
    """server.request_timeout_s through HTTP: a plain request gets a 504 `timeout` error object;
    a stream, already answered 200, ends with a `timeout` error event and [DONE]. Both stop."""
    monkeypatch.setattr(server.gateway.dispatcher, "timeout_s", 0.4)
    body = {"model": "tight", "prompt": "Name:", "max_tokens": LONG_ANSWER}
    error = assert_error_object(post(server, "/v1/completions", json=body), 504, code="timeout")
    assert error["type"] == "timeout_error" and "0.4 s" in error["message"]
    assert_cancelled_mid_generation(server, tight_sequences[0])
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    event = json.loads(lines[-2].removeprefix("data:"))["error"]
    assert event["code"] == "timeout" and event["type"] == "timeout_error"
    assert_cancelled_mid_generation(server, tight_sequences[1])


def error_counts(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("nowait:request_errors_total{")}


def test_errors_are_counted_once_and_refusals_logged(server):
    before = error_counts(server)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-imaginary-2", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-wrong").models.list()
    after = error_counts(server)
    for labels in ('code="model_not_found",status="404"', 'code="invalid_api_key",status="401"'):
        assert after[labels] - before.get(labels, 0) == 1, labels
    refused = [e for e in read_audit_log(server.config.audit_log_path) if e["model"] == "gpt-imaginary-2"]
    assert refused and refused[-1]["status"] == 404 and refused[-1]["rule"] == "none"


def test_a_request_with_more_choices_than_its_engine_admits_still_completes(server):
    """"tight" admits two requests at once (one running, one queued); five prompts in one request
    are run two at a time instead of refusing the third with a 429 that no retry could cure."""
    assert server.gateway.backends["tight"].admits == 2
    completion = server.client().completions.create(model="tight", prompt=["Name:"] * 5, max_tokens=2)
    assert len(completion.choices) == 5 and all(c.text for c in completion.choices)


def test_a_seed_a_generator_cannot_take_is_400_and_harms_nobody(server):
    for seed in (2**64, -(2**63) - 1):
        response = post(server, "/v1/completions", json={"model": "ar", "prompt": "Name:", "seed": seed,
                                                          "temperature": 0.5, "max_tokens": 2})
        assert_error_object(response, 400, param="seed")
    # Engines used as a library refuse it too, before any work.
    from nowait.engines.base import InvalidRequestError, SamplingParams

    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(temperature=0.5, seed=2**64).validate()
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=float("nan")).validate()


def test_a_request_the_engine_fails_to_take_fails_alone(server, monkeypatch):
    """An unexpected error while the engine takes a request is that request's 500; a request
    already decoding on the same engine carries on to its last token.

    Guards against a failure that fails every running request. The running request is a stream
    whose first chunk is awaited before the failing one is sent, and the failing hook records
    that it was still decoding at that moment: had it already finished, there would have been
    nothing to protect, and the test says so instead of passing."""
    engine = server.gateway.backends["tight"].worker.engine
    submit = engine.submit
    decoding_at_failure: list[int] = []

    def failing_submit(request):
        if request.sampling.max_tokens == 7:
            decoding_at_failure.extend(len(s.output_ids) for s in engine.scheduler.running if not s.is_finished)
            raise RuntimeError("simulated failure")
        return submit(request)

    monkeypatch.setattr(engine, "submit", failing_submit)
    running_tokens = 200  # within never_ending_model's guaranteed 400: no end token cuts it short
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "tight", "prompt": "Name:", "max_tokens": running_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}, timeout=30) as running:
        events = (line.removeprefix("data:").strip() for line in running.iter_lines() if line.startswith("data:"))
        first = next(events)  # the engine is decoding it
        failing = post(server, "/v1/completions", json={"model": "tight", "prompt": "Name:", "max_tokens": 7})
        rest = [first, *events]
    error = assert_error_object(failing, 500, code="engine_error")
    assert "simulated failure" in error["message"]
    assert decoding_at_failure, "the running request had finished before the failure: nothing was protected"
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(data) for data in rest[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-2:]
    assert chunks[-1]["usage"]["completion_tokens"] == running_tokens


def test_a_body_over_the_limit_is_413(server):
    big = {"model": "ar", "prompt": "x" * (80 * 1024), "max_tokens": 2}
    assert_error_object(post(server, "/v1/completions", json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "ar", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'", "max_tokens": 2}'

    response = post(server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error_object(response, 413, code="request_too_large")
    assert post(server, "/v1/completions", json={"model": "ar", "prompt": "Name:", "max_tokens": 2}).status_code == 200


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(server, monkeypatch):
    backend = server.gateway.backends["ar"]
    open_stream = backend.open_stream

    async def broken_open_stream(call, timeout_s):
        stream = await open_stream(call, timeout_s)
        deltas = stream.deltas

        async def first_then_fail():
            async for text in deltas():
                yield text
                raise RuntimeError("simulated bug")

        stream.deltas = first_then_fail
        return stream

    monkeypatch.setattr(backend, "open_stream", broken_open_stream)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "ar", "prompt": "Name:", "max_tokens": 8, "stream": True}, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data:"))["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert backend.in_flight == 0


def test_a_schema_is_checked_against_the_metaschema_once_and_a_bad_one_every_time(monkeypatch):
    from jsonschema import Draft202012Validator

    from nowait.gateway import prompts
    from nowait.gateway.errors import APIError

    checked = []
    real = Draft202012Validator.check_schema
    monkeypatch.setattr(Draft202012Validator, "check_schema",
                        classmethod(lambda cls, schema: checked.append(schema) or real(schema)))
    prompts._valid_json_schema.cache_clear()
    good = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    reordered = {"properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "type": "object"}
    for schema in (good, reordered, good):
        prompts.check_schema(schema)
    assert len(checked) == 1  # the same schema, whatever its key order
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    for _ in range(2):
        with pytest.raises(APIError, match="not a valid JSON Schema at properties/a/type"):
            prompts.check_schema(bad)
    assert len(checked) == 3
