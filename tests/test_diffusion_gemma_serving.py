"""DiffusionGemma served like the other diffusion models: load_pretrained on a directory written by
transformers' save_pretrained, the engine factory, the engine's answers, streaming, confidence
and refusals, and the gateway over HTTP with the official openai client."""

from __future__ import annotations

import openai
import pytest
import torch

from nowait.checkpoints import load_pretrained
from nowait.engines.base import GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.config import DiffusionEngineConfig
from nowait.engines.diffusion.gemma_engine import DiffusionGemmaEngine
from nowait.engines.diffusion.gemma_sampler import GemmaSampling, generate_diffusion_gemma
from nowait.engines.factory import ModelCache, build_engine
from nowait.generate import generate_once, prompt_ids
from nowait.model.diffusion_gemma import DiffusionGemma

from .gateway_support import API_KEY, free_port, live_server
from .gemma_checkpoints import CANVAS, diffusion_gemma_checkpoint

pytest.importorskip("transformers.models.diffusion_gemma")
PROMPT = [2, 17, 40, 5, 88, 23, 61, 9]
FAST = {"max_denoising_steps": 4}  # few steps per block: the tests check plumbing, not quality


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("diffusiongemma-serving") / "diffusiongemma-tiny"
    diffusion_gemma_checkpoint(directory, seed=5)
    (directory / "generation_config.json").write_text('{"eos_token_id": 1, "max_denoising_steps": 4}')
    return directory


@pytest.fixture(scope="module")
def engine(checkpoint):
    built = build_engine(DiffusionEngineConfig(kind="diffusion", model=str(checkpoint)), ModelCache())
    return built.engine


def test_load_pretrained_reads_the_text_model_and_its_conventions(checkpoint):
    loaded = load_pretrained(checkpoint)
    assert isinstance(loaded.model, DiffusionGemma) and loaded.engine_kind == "diffusion"
    assert loaded.conventions.end_ids == (1,) and loaded.conventions.bos_id == 2
    assert loaded.conventions.chat_template is not None
    with pytest.raises(Exception, match="no AR engine"):
        load_pretrained(checkpoint, engine="ar")


def test_nowait_generate_runs_it_with_its_chat_template(checkpoint):
    loaded = load_pretrained(checkpoint)
    first, _ = generate_once(loaded, "hello cat", CANVAS, seed=4)
    again, _ = generate_once(loaded, "hello cat", CANVAS, seed=4)
    assert first.token_ids == again.token_ids and len(first.token_ids) <= CANVAS  # the seed fixes the answer
    assert first.prompt_tokens == len(prompt_ids(loaded, "hello cat")) and first.forwards >= 1


def test_the_factory_builds_the_gemma_engine_with_the_checkpoints_sampler(engine):
    assert isinstance(engine, DiffusionGemmaEngine) and engine.kind == "diffusion"
    assert engine.sampling.max_denoising_steps == 4  # generation_config.json over the defaults
    assert engine.sampling.t_min == GemmaSampling().t_min


def test_answers_follow_the_decode_and_the_confidence_is_the_least_sure_token(engine):
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=2 * CANVAS, seed=7))
    [completion] = engine.generate([request])
    decode = generate_diffusion_gemma(engine.model, PROMPT, 2 * CANVAS, engine.end_ids, engine.sampling,
                                      torch.Generator().manual_seed(7))
    assert completion.token_ids == decode.tokens
    assert completion.text == engine.codec.decode(decode.tokens)
    assert completion.forwards == decode.forwards
    # The end token the model wrote counts as a completion token (one rule for every engine).
    assert completion.completion_tokens == len(decode.tokens) + (decode.finish_reason == "stop")
    probabilities = [p for block in decode.blocks for p in block.probabilities.tolist()]
    deciding = probabilities[: len(decode.tokens) + (decode.finish_reason == "stop")]
    assert completion.confidence == pytest.approx(min(deciding))
    assert completion.confidence_kind == "min_token_probability" and 0 < completion.confidence <= 1


def test_streaming_sends_blocks_that_add_up_to_the_answer(engine):
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=3 * CANVAS, seed=3))
    chunks = list(engine.stream(request))
    [expected] = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=3 * CANVAS, seed=3))])
    assert chunks[-1].completion is not None and chunks[-1].completion.token_ids == expected.token_ids
    assert "".join(chunk.text for chunk in chunks) == expected.text
    assert sum(len(chunk.token_ids) for chunk in chunks) == len(expected.token_ids)


class ThreeByteCodec:
    """Three ids a character, as three bytes of UTF-8 are: a count that is no multiple of three
    ends in part of a character, which decodes as U+FFFD, as a byte-level tokenizer's does."""

    def decode(self, ids: list[int]) -> str:
        whole = "".join(chr(0x4E00 + sum(ids[i:i + 3]) % 500) for i in range(0, len(ids) - 2, 3))
        return whole + ("\ufffd" if len(ids) % 3 else "")


def test_a_stream_never_sends_part_of_a_character(checkpoint):
    assert CANVAS % 3  # so that blocks end inside a character
    engine = build_engine(DiffusionEngineConfig(kind="diffusion", model=str(checkpoint)), ModelCache()).engine
    engine.codec = ThreeByteCodec()
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=4 * CANVAS, seed=3))
    chunks = list(engine.stream(request))
    [expected] = engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=4 * CANVAS, seed=3))])
    assert len(expected.token_ids) > CANVAS  # more than one block, so a block boundary was crossed
    assert "".join(chunk.text for chunk in chunks) == expected.text
    assert not any(chunk.text.endswith("\ufffd") for chunk in chunks[:-1])
    assert sum(len(chunk.token_ids) for chunk in chunks) == len(expected.token_ids)


@pytest.mark.parametrize(("change", "message"), [
    ({"schema": {"type": "object", "properties": {"a": {"type": "string"}}}}, "^schema: "),
    ({"sampling": SamplingParams(top_p=0.5)}, "top_p and top_k"),
    ({"prompt_ids": [5, 258880]}, r"prompt_ids must be token ids|image tokens"),
    ({"options": {"policy": "threshold"}}, r"options \['policy'\] do not apply"),
    ({"options": {"t_min": 0.9, "t_max": 0.5}}, "t_min < t_max"),
])
def test_requests_it_cannot_serve_are_refused_by_name(engine, change, message):
    request = GenerationRequest(**{"prompt_ids": PROMPT, **change})
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate([request])


def test_an_image_token_is_refused(engine, monkeypatch):
    monkeypatch.setitem(engine.model.config.extra, "image_token_id", 40)
    with pytest.raises(InvalidRequestError, match="text model only"):
        engine.plan(GenerationRequest(PROMPT))


def test_the_gateway_serves_it_with_streaming(checkpoint, tmp_path):
    config = {
        "server": {"host": "127.0.0.1", "port": free_port(), "request_timeout_s": 60},
        "auth": {"api_keys": [API_KEY], "api_keys_env": None}, "data_dir": str(tmp_path / "data"),
        "engines": {"gemma": {"kind": "diffusion", "model": str(checkpoint)}},
        "routing": {"confidence_threshold": 0.0, "batch_engine": "gemma", "fast_engine": "gemma",
                    "fallback_engine": "gemma", "owned_frontier_engine": "gemma"},
        "defaults": {"max_tokens": CANVAS},
    }
    messages = [{"role": "user", "content": "hello cat"}]
    with live_server(config) as server:
        client = server.client()
        reply = client.chat.completions.create(model="gemma", messages=messages, max_tokens=2 * CANVAS, seed=11)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.model_extra["nowait"]["route"] == "gemma"
        assert 0 < reply.model_extra["nowait"]["confidence"] <= 1
        streamed = client.chat.completions.create(model="gemma", messages=messages, max_tokens=2 * CANVAS, seed=11,
                                                  stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == reply.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="schema"):
            client.chat.completions.create(
                model="gemma", messages=messages, max_tokens=CANVAS,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}})
