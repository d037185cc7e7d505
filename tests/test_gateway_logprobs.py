"""`logprobs` and `top_logprobs` over HTTP, parsed by the official openai client: chat and legacy
completions, whole and streamed, on the AR, speculative and diffusion engines, equal to a softmax
computed here from the checkpoint's own logits; stop strings, and the refusals by code."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from nowait.checkpoints import load_pretrained
from nowait.engines.ar import AutoregressiveEngine
from nowait.engines.base import GenerationRequest, SamplingParams, TokenLogprob
from nowait.gateway.logprobs import EntryBuilder, TokenTexts
from nowait.gateway.prompts import chat_prompt
from nowait.tokenizer import SPECIAL_TOKENS
from tests.gateway_support import API_KEY, SMALL_SCHEMA, base_config, free_port, live_server, save_tiny_models

MESSAGES = [{"role": "user", "content": "Name: Ann Lee, born 1985."}]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec):
    return save_tiny_models(tmp_path_factory.mktemp("logprob-models"), codec)


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    config = base_config(models, tmp_path_factory.mktemp("logprob-data"), free_port())
    config["engines"]["diffusion-raw"] = {"kind": "diffusion", "model": models["diffusion"], "options": {"block": 8}}
    with live_server(config) as live:
        yield live


@pytest.fixture(scope="module")
def reference(models, codec):
    """The AR checkpoint's greedy answer to MESSAGES, its ids, and each token's log-softmax row,
    from a cacheless forward over prompt + answer (not through the gateway)."""
    loaded = load_pretrained(models["ar"])
    prompt = codec.encode(chat_prompt(MESSAGES))
    [completion] = AutoregressiveEngine(loaded.model, codec).generate(
        [GenerationRequest(prompt, SamplingParams(max_tokens=MAX_TOKENS))])
    ids = completion.token_ids
    with torch.no_grad():
        logits = loaded.model(torch.tensor([prompt + ids]))[0].float()
    return ids, logits[len(prompt) - 1: len(prompt) - 1 + len(ids)].log_softmax(-1)


def text_bytes(entries) -> bytes:
    """The bytes the tokens add to the text (special tokens are written but add nothing)."""
    return b"".join(bytes(e.bytes) for e in entries if e.token not in SPECIAL_TOKENS)


def as_text(entries) -> str:
    """The text those bytes write, as the tokenizer decodes (a random model writes invalid UTF-8 too)."""
    return text_bytes(entries).decode(errors="replace")


def test_token_bytes_rebuild_the_text_and_offsets_count_its_characters(codec):
    texts = TokenTexts(codec)
    ids = codec.encode("a\u20acb")  # the euro sign is three byte-level tokens here
    entries = EntryBuilder(texts).add([TokenLogprob(i, -1.0) for i in ids])
    assert b"".join(bytes(e.text.bytes) for e in entries) == "a\u20acb".encode()
    assert [e.offset for e in entries] == [0, 1, 1, 1, 2]
    assert [e.text.token for e in entries][1:4] == ["\\xe2", "\\x82", "\\xac"]  # as OpenAI writes bytes
    # Bytes that never make a character (a random model writes them): each becomes one U+FFFD in
    # the decoded text, and the next token's offset counts it.
    broken = [codec.encode(c)[0] for c in "ab"]
    lone = [i for i in range(codec.vocab_size) if texts.of(i).bytes in ([0xE1], [0xD1])]
    entries = EntryBuilder(texts).add([TokenLogprob(i, -1.0) for i in (broken[0], *lone, broken[1])])
    text = codec.decode([broken[0], *lone, broken[1]])
    assert text == "a\ufffd\ufffdb" and [e.offset for e in entries] == [0, 1, 2, 3]


def test_chat_logprobs_are_the_models_softmax_in_openais_shape(server, reference):
    ids, expected = reference
    response = server.client().chat.completions.create(model="ar", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                       logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert choice.logprobs.refusal is None and len(content) == len(ids) > 0
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
        values = expected[i].topk(2).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values, abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the argmax
    assert as_text(content) == choice.message.content
    # The raw JSON has chat's keys exactly, refusal included.
    raw = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": "ar", "messages": MESSAGES, "max_tokens": 3, "logprobs": True}).json()
    logprobs = raw["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    assert set(logprobs["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert logprobs["content"][0]["top_logprobs"] == []  # logprobs without top_logprobs: none


def test_without_logprobs_the_answer_has_none(server):
    response = server.client().chat.completions.create(model="ar", messages=MESSAGES, max_tokens=3)
    assert response.choices[0].logprobs is None


def chat_stream(server, model: str, **fields):
    chunks = list(server.client().chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                          logprobs=True, stream=True, **fields))
    return [c for c in chunks if c.choices and c.choices[0].logprobs is not None]


@pytest.mark.parametrize("model", ["ar", "spec", "diffusion", "diffusion-raw"])
def test_each_streamed_chunk_carries_its_deltas_logprobs(server, model):
    whole = server.client().chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                    logprobs=True, top_logprobs=1)
    chunks = chat_stream(server, model, top_logprobs=1)
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == \
        [(e.token, pytest.approx(e.logprob, abs=1e-5)) for e in whole.choices[0].logprobs.content]
    for chunk in chunks:
        assert as_text(chunk.choices[0].logprobs.content) == (chunk.choices[0].delta.content or "")
    for entry in streamed:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob) and len(entry.top_logprobs) == 1


def test_speculative_logprobs_equal_ar_ones(server):
    """One target model: the verify pass scores the tokens as AR decoding does."""
    answers = [server.client().chat.completions.create(model=m, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                       logprobs=True).choices[0].logprobs.content
               for m in ("ar", "spec")]
    assert [e.token for e in answers[0]] == [e.token for e in answers[1]]
    assert [e.logprob for e in answers[1]] == pytest.approx([e.logprob for e in answers[0]], abs=1e-4)


def test_completions_logprobs_in_the_legacy_shape(server, reference):
    ids, expected = reference
    prompt = chat_prompt(MESSAGES)
    response = server.client().completions.create(model="ar", prompt=prompt, max_tokens=MAX_TOKENS, logprobs=2)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids)
    assert logprobs.token_logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    checked = 0
    for token, logprob, top, start in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                          logprobs.text_offset, strict=True):
        assert top[token] == pytest.approx(logprob) and len(top) <= 3  # the sampled token is always there
        if token not in SPECIAL_TOKENS and "\\x" not in token:  # a whole-character token: it is at its offset
            assert choice.text[start: start + len(token)] == token
            checked += 1
    assert checked > 0
    streamed = list(server.client().completions.create(model="ar", prompt=prompt, max_tokens=MAX_TOKENS, logprobs=2,
                                                       stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens] == logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == logprobs.text_offset


def test_a_stop_string_cuts_the_logprobs_with_the_text(server):
    prompt = chat_prompt(MESSAGES)
    full = server.client().completions.create(model="ar", prompt=prompt, max_tokens=MAX_TOKENS, logprobs=0)
    text, offsets = full.choices[0].text, full.choices[0].logprobs.text_offset
    cut = next(o for o in offsets if o > 0)  # the second token's start: the stop string begins there
    stop = text[cut: cut + 2]
    assert len(stop) == 2 and text.find(stop) == cut, "pick another prompt: the stop string must be new here"
    for stream in (False, True):
        answer = server.client().completions.create(model="ar", prompt=prompt, max_tokens=MAX_TOKENS, logprobs=0,
                                                    stop=[stop], stream=stream)
        if stream:
            parts = [c.choices[0] for c in answer if c.choices]
            got_text = "".join(p.text for p in parts)
            tokens = [t for p in parts if p.logprobs is not None for t in p.logprobs.tokens]
        else:
            got_text, tokens = answer.choices[0].text, answer.choices[0].logprobs.tokens
        assert got_text == text[:cut]
        assert tokens == full.choices[0].logprobs.tokens[: offsets.index(cut)], stream


def test_a_routed_template_request_with_logprobs_runs_on_ar(server):
    """A diffusion template has fixed pieces no model predicted: with a fallback engine the
    request re-runs on AR (which has logprobs for every token); pinned without one it is a 400."""
    response = server.client().chat.completions.create(
        model="diffusion", messages=MESSAGES, max_tokens=24, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SMALL_SCHEMA}})
    assert response.model_extra["nowait"]["route"] == "ar"
    assert as_text(response.choices[0].logprobs.content) == response.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as error:
        server.client().chat.completions.create(
            model="diffusion-raw", messages=MESSAGES, max_tokens=24, logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SMALL_SCHEMA}})
    assert error.value.body["code"] == "logprobs_unsupported" and error.value.body["param"] == "logprobs"


def test_a_routed_frontier_request_with_logprobs_runs_on_the_owned_frontier_engine(server):
    """The remote frontier cannot give logprobs; routed (not pinned), the request goes where the
    router sends a failing upstream's, the owned frontier engine, instead of failing."""
    raw = server.client().chat.completions.with_raw_response.create(
        model="nowait", messages=MESSAGES, max_tokens=4, logprobs=True,
        extra_body={"nowait": {"token_value_usd_per_mtok": 20, "data_class": "internal"}})
    response = raw.parse()
    info = response.model_extra["nowait"]
    assert info["rule"] == "frontier" and info["engines_tried"][0]["engine"] == "frontier-api"
    assert raw.headers["x-nowait-route"] == info["route"] != "frontier-api" and info["fallback"] is True
    assert "cannot return logprobs" in info["reason"]
    assert len(response.choices[0].logprobs.content) > 0


@pytest.mark.parametrize(("endpoint", "fields", "param", "code"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "integer_below_min_value"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # needs logprobs: true, as on OpenAI
    ("chat", {"logprobs": 2}, "logprobs", "invalid_type"),
    ("completions", {"logprobs": 21}, "logprobs", "integer_above_max_value"),
    ("completions", {"logprobs": True}, "logprobs", "invalid_type"),
    ("chat-remote", {"logprobs": True}, "logprobs", "logprobs_unsupported"),
])
def test_bad_or_impossible_logprobs_are_400s_by_code(server, endpoint, fields, param, code):
    body = ({"model": "frontier-api" if endpoint == "chat-remote" else "ar", "messages": MESSAGES}
            if endpoint.startswith("chat") else {"model": "ar", "prompt": "Name:"})
    path = "/v1/chat/completions" if endpoint.startswith("chat") else "/v1/completions"
    response = httpx.post(f"{server.base_url}{path}", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={**body, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
