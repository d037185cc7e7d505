"""A remote fast (diffusion) engine: its confidence from the upstream's token logprobs, and the
router's fallback rule on it, through a live gateway whose upstream is a fake OpenAI server
(mounted in the same server) answering with the logprobs each test sets."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from nowait.checkpoints import save_pretrained
from nowait.gateway.config import load_config, parse_config
from nowait.gateway.domain import Call, Metadata
from nowait.gateway.engines import build_backends
from nowait.gateway.ledger import read_audit_log
from nowait.gateway.owned import UnavailableBackend
from nowait.gateway.remote import RemoteBackend
from nowait.gateway.remote_confidence import TokenLogprobs, chosen_logprobs, logprob_fields, min_token_probability
from nowait.router import DataClass
from tests.conftest import build_model
from tests.gateway_support import API_KEY, free_port, live_server

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vllm-diffusiongemma.yaml"
MESSAGES = [{"role": "user", "content": "Name: Ann Lee\nBorn: 1985"}]
SURE = [-0.01, -0.05, -0.02]  # least sure token: exp(-0.05) = 0.951
UNSURE = [-0.01, -1.5, -0.02]  # exp(-1.5) = 0.223
THRESHOLD = 0.9


# --- the pure parts ---

def test_the_confidence_is_the_least_sure_tokens_probability():
    assert min_token_probability(SURE) == pytest.approx(math.exp(-0.05))
    assert min_token_probability([0.0]) == 1.0 and min_token_probability([5e-5]) == 1.0  # rounding, capped
    assert min_token_probability([-9999.0]) == 0.0  # vLLM's stand-in for -inf


def test_chat_and_completions_logprobs_are_both_read():
    chat = {"content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []},
                        {"token": "b", "logprob": -0.3, "bytes": [98], "top_logprobs": []}], "refusal": None}
    assert chosen_logprobs(chat) == ([-0.1, -0.3], "")
    legacy = {"tokens": ["a", "b"], "token_logprobs": [-0.2, -0.4], "top_logprobs": None, "text_offset": [0, 1]}
    assert chosen_logprobs(legacy) == ([-0.2, -0.4], "")
    assert logprob_fields("chat") == {"logprobs": True}  # no top_logprobs: the chosen token's is all it needs
    assert logprob_fields("completions") == {"logprobs": 0}


@pytest.mark.parametrize("logprobs, why", [
    (None, "returned no logprobs"),
    ({"content": None}, "hold no token logprobs"),
    ({"content": [{"token": "a"}]}, "None where a token logprob belongs"),
    ({"token_logprobs": [-0.1, None]}, "None where"),
    ({"token_logprobs": [0.5]}, "0.5 where"),  # a positive log probability is not one
    ({"token_logprobs": [float("nan")]}, "nan where"),
])
def test_unreadable_logprobs_give_no_confidence_and_say_why(logprobs, why):
    values, missing = chosen_logprobs(logprobs)
    assert values is None and why in missing
    tally = TokenLogprobs()
    tally.add(logprobs)
    assert tally.confidence() == (None, missing)


def test_a_streams_logprobs_are_gathered_and_one_text_chunk_without_them_spoils_it():
    tally = TokenLogprobs()
    tally.add(None, has_text=False)  # the role chunk and the finish chunk carry none
    tally.add({"content": [{"token": "a", "logprob": -0.1}]})
    tally.add({"content": [{"token": "b", "logprob": -0.7}]})
    assert tally.confidence() == (pytest.approx(math.exp(-0.7)), "")
    tally.add(None, has_text=True)
    assert tally.confidence()[0] is None
    assert TokenLogprobs().confidence() == (None, "the upstream returned no token logprobs for the answer")


# --- through the gateway ---

class LogprobUpstream:
    """An OpenAI-compatible diffusion server: answers `text` with `logprobs` (None: none at all)."""

    text = "Ann Lee, 1985"

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.logprobs: list[float] | None = SURE
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)
        self.app.post("/v1/completions")(self.completions)

    def _tokens(self) -> list[str]:
        return [self.text[i::3] for i in range(3)]  # one token per logprob; the text itself is not re-read

    async def chat(self, request: Request):
        body = await request.json()
        self.received.append(body)
        logprobs = None if self.logprobs is None else {"content": [
            {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
            for t, v in zip(self._tokens(), self.logprobs, strict=True)]}
        if body.get("stream"):
            def events():
                for i, piece in enumerate((self.text[:4], self.text[4:])):
                    part = None if logprobs is None else {"content": logprobs["content"][i::2]}
                    choice = {"index": 0, "delta": {"content": piece}, "logprobs": part}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"id": "up-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text},
                             "logprobs": logprobs, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}

    async def completions(self, request: Request):
        body = await request.json()
        self.received.append(body)
        logprobs = None if self.logprobs is None else {"tokens": self._tokens(), "token_logprobs": self.logprobs,
                                                       "top_logprobs": None, "text_offset": [0, 1, 2]}
        return {"id": "up-2", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "text": self.text, "logprobs": logprobs, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}


def remote_diffusion_config(ar_model: str, data_dir: Path, port: int, upstream_url: str,
                            threshold: float = THRESHOLD) -> dict:
    """An owned AR engine for fallback and a remote diffusion engine (in the building) as the fast one."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "request_timeout_s": 30},
        "auth": {"api_keys": [API_KEY], "api_keys_env": None},
        "data_dir": str(data_dir),
        "engines": {
            "ar": {"kind": "ar", "model": ar_model, "max_num_seqs": 4, "max_num_batched_tokens": 512},
            "remote-diffusion": {"kind": "remote", "base_url": upstream_url, "model": "diffusion-upstream",
                                 "on_premises": True, "input_usd_per_mtok": 0.1, "output_usd_per_mtok": 0.4,
                                 "timeout_s": 20},
        },
        "routing": {"fast_engine": "remote-diffusion", "fallback_engine": "ar", "confidence_threshold": threshold},
        "defaults": {"max_tokens": 8, "data_class": "internal"},
    }


@pytest.fixture(scope="module")
def upstream():
    return LogprobUpstream()


@pytest.fixture(scope="module")
def ar_model(tmp_path_factory, codec) -> str:
    return str(save_pretrained(build_model(0, vocab_size=codec.vocab_size), codec,
                               tmp_path_factory.mktemp("remote-diffusion") / "ar"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, ar_model, upstream):
    port = free_port()
    config = remote_diffusion_config(ar_model, tmp_path_factory.mktemp("remote-diffusion-data"), port,
                                     f"http://127.0.0.1:{port}/upstream/v1")
    with live_server(config, upstream) as live:
        yield live


@pytest.fixture(autouse=True)
def sure_upstream(upstream):
    upstream.logprobs = SURE
    yield


def ask(server, model="nowait", stream=False):
    client = server.client()
    if stream:
        chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, stream=True))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].model_extra["nowait"]
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=8)
    completion = raw.parse()
    assert raw.headers["x-nowait-route"] == completion.model_extra["nowait"]["route"]
    return completion, completion.model_extra["nowait"]


def audit_entry(server, request_id: str) -> dict:
    return next(e for e in read_audit_log(server.config.audit_log_path) if e["request_id"] == request_id)


def metrics(server) -> str:
    return httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text


def test_a_confident_remote_diffusion_answer_is_the_answer(server, upstream):
    completion, info = ask(server)
    assert info["route"] == "remote-diffusion" and info["rule"] == "fast" and info["fallback"] is False
    assert completion.choices[0].message.content == upstream.text
    assert info["confidence"] == pytest.approx(math.exp(-0.05))
    sent = upstream.received[-1]
    assert sent["logprobs"] is True and "top_logprobs" not in sent and "stream" not in sent


def test_a_low_confidence_remote_diffusion_answer_falls_back_to_ar(server, upstream):
    upstream.logprobs = UNSURE
    completion, info = ask(server)
    assert info["route"] == "ar" and info["fallback"] is True
    assert f"remote-diffusion confidence {math.exp(-1.5):.3g} is below {THRESHOLD:g}: re-ran on ar" in info["reason"]
    assert [a["engine"] for a in info["engines_tried"]] == ["remote-diffusion", "ar"]
    assert info["engines_tried"][0]["confidence"] == pytest.approx(math.exp(-1.5))
    assert completion.choices[0].message.content != upstream.text  # the AR model's own answer
    assert audit_entry(server, completion.id)["fallback_cause"] == "confidence"


def test_an_answer_without_logprobs_is_not_confident_it_falls_back_and_is_counted(server, upstream):
    upstream.logprobs = None
    completion, info = ask(server)
    assert info["route"] == "ar" and info["fallback"] is True
    assert "remote-diffusion gave no confidence (the upstream returned no logprobs)" in info["reason"]
    assert info["engines_tried"][0]["confidence"] is None  # unknown, not a number made up
    assert audit_entry(server, completion.id)["fallback_cause"] == "confidence_unknown"
    assert 'nowait:fallbacks_total{cause="confidence_unknown",engine="remote-diffusion",to="ar"}' in metrics(server)


def test_a_pinned_remote_diffusion_engine_keeps_its_fallback(server, upstream):
    upstream.logprobs = UNSURE
    _, info = ask(server, model="remote-diffusion")
    assert info["route"] == "ar" and info["rule"] == "pinned" and info["fallback"] is True


def test_a_stream_is_held_until_the_confidence_is_known_as_for_an_owned_diffusion_engine(server, upstream):
    text, info = ask(server, stream=True)
    assert text == upstream.text and info["route"] == "remote-diffusion"
    assert "stream" not in upstream.received[-1]  # asked whole, so its confidence decides before a byte is sent
    upstream.logprobs = UNSURE
    text, info = ask(server, stream=True)
    assert info["route"] == "ar" and info["fallback"] is True
    direct = server.client().chat.completions.create(model="ar", messages=MESSAGES, max_tokens=8)
    assert text == direct.choices[0].message.content  # only AR's answer, nothing of the unsure one


def test_completions_ask_for_the_chosen_tokens_logprobs_too(server, upstream):
    completion = server.client().completions.create(model="nowait", prompt="Name: Ann Lee", max_tokens=8)
    sent = upstream.received[-1]
    assert sent["logprobs"] == 0 and completion.model_extra["nowait"]["route"] == "remote-diffusion"
    upstream.logprobs = UNSURE
    completion = server.client().completions.create(model="nowait", prompt="Name: Ann Lee", max_tokens=8)
    assert completion.model_extra["nowait"]["route"] == "ar"


def test_the_remote_streams_own_logprobs_give_its_confidence(server, upstream, caplog):
    """A stream is relayed (not held) only where no fallback applies, but its Attempt still
    carries the confidence its chunks give."""
    live = server.gateway.backends["remote-diffusion"]
    backend = RemoteBackend("remote-diffusion", live.config, 60, confidence=True)  # a client of this loop
    call = Call("r-1", "chat", "remote-diffusion", Metadata(None, 0.0, DataClass.internal, False), messages=MESSAGES)

    async def streamed():
        await backend.start()
        try:
            stream = await backend.open_stream(call, 10)
            pieces = [piece async for piece in stream.deltas()]
        finally:
            await backend.stop()
        return "".join(pieces), stream.attempt

    text, attempt = asyncio.run(streamed())
    assert text == upstream.text and attempt.confidence == pytest.approx(math.exp(-0.05))
    assert upstream.received[-1]["stream"] is True and upstream.received[-1]["logprobs"] is True
    upstream.logprobs = None
    with caplog.at_level(logging.WARNING, logger="nowait.gateway"):
        assert asyncio.run(streamed())[1].confidence is None
        asyncio.run(streamed())
    warned = [r.getMessage() for r in caplog.records if "have no confidence" in r.getMessage()]
    assert warned == ["fast engine 'remote-diffusion': the upstream returned no logprobs, so its answers have no "
                      "confidence and re-run on the fallback engine"]  # once, not per answer


def test_only_the_fast_engine_asks_for_logprobs(tmp_path, ar_model):
    config = remote_diffusion_config(ar_model, tmp_path, 9, "http://127.0.0.1:9/v1")
    config["engines"]["other-remote"] = dict(config["engines"]["remote-diffusion"])
    backends = build_backends(parse_config(config), owned=lambda name, spec: UnavailableBackend(name, spec.kind,
                                                                                               "not built", 60))
    assert backends["remote-diffusion"].confidence is True and backends["other-remote"].confidence is False


def test_the_vllm_diffusiongemma_example_loads_with_the_remote_as_fast_engine():
    config = load_config(EXAMPLE)
    policy = config.routing_policy()
    fast = config.engines[policy.fast_engine]
    assert fast.kind == "remote" and fast.on_premises and policy.fallback_engine in config.engines
    backends = build_backends(config, owned=lambda name, spec: UnavailableBackend(name, spec.kind, "not built", 60))
    assert isinstance(backends[policy.fast_engine], RemoteBackend) and backends[policy.fast_engine].confidence


# --- another nowait as the upstream, over real HTTP ---

def test_a_nowait_gateway_as_the_upstream_routes_the_same(tmp_path, codec, ar_model):
    """A nowait gateway serving a tiny diffusion model is the upstream; the outer gateway's
    confidence is the least sure token's probability in the logprobs it returns, so a threshold
    below it keeps the answer and one above it re-runs the request on AR."""
    diffusion = save_pretrained(build_model(2, vocab_size=codec.vocab_size, causal=False,
                                            mask_token_id=codec.mask_id), codec, tmp_path / "diffusion")
    upstream_port = free_port()
    inner = {"server": {"host": "127.0.0.1", "port": upstream_port, "request_timeout_s": 30},
             "auth": {"api_keys": [], "api_keys_env": None}, "data_dir": str(tmp_path / "inner"),
             "engines": {"diffusion": {"kind": "diffusion", "model": str(diffusion), "options": {"block": 8}}},
             "routing": {"fast_engine": None, "batch_engine": "diffusion", "fallback_engine": "diffusion",
                         "owned_frontier_engine": "diffusion"},
             "defaults": {"max_tokens": 8, "data_class": "internal"}}
    with live_server(inner) as upstream:
        direct = upstream.client().chat.completions.create(model="diffusion", messages=MESSAGES, max_tokens=8,
                                                           logprobs=True)
        expected = min_token_probability([t.logprob for t in direct.choices[0].logprobs.content])
        assert 0 < expected < 1  # a random model is unsure: room for a threshold on either side
        # The upstream's own confidence is the same minimum with its end token counted too.
        assert direct.model_extra["nowait"]["confidence"] <= expected * (1 + 1e-6)
        for threshold, route in ((expected / 2, "remote-diffusion"), ((expected + 1) / 2, "ar")):
            port = free_port()
            config = remote_diffusion_config(ar_model, tmp_path / f"outer-{route}", port,
                                             f"{upstream.base_url}/v1", threshold=threshold)
            config["engines"]["remote-diffusion"]["model"] = "diffusion"
            with live_server(config) as outer:
                completion, info = ask(outer)
                tried = info["engines_tried"]
                assert info["route"] == route and info["fallback"] is (route == "ar")
                assert tried[0]["engine"] == "remote-diffusion"
                assert tried[0]["confidence"] == pytest.approx(expected, rel=1e-6)
                if route == "remote-diffusion":
                    assert completion.choices[0].message.content == direct.choices[0].message.content
                else:
                    assert [a["engine"] for a in tried] == ["remote-diffusion", "ar"]
                    assert audit_entry(outer, completion.id)["fallback_cause"] == "confidence"
