"""Token logprobs from every owned engine equal a softmax computed here, independently, from the
model's own logits: AR (greedy, sampled, grammar-constrained), speculative, masked diffusion at the
step that unmasked each token, and DiffusionGemma under its block's last denoising step."""

from __future__ import annotations

import math

import pytest
import torch

from nowait.engines.ar import AutoregressiveEngine
from nowait.engines.base import GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.diffusion import DiffusionEngine
from nowait.engines.diffusion.request import DiffusionOptions
from nowait.engines.logprobs import chosen_logprobs, row_logprobs
from nowait.engines.speculative import SpeculativeEngine
from tests.conftest import build_model

TOP = 3


def prompt_of(codec) -> list[int]:
    return codec.encode("Name: Ann Lee, born 1985 in Leeds.")


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of a cacheless causal forward over prompt + output: row i scores output[i]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output]))[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)].log_softmax(-1)


def assert_matches(completion, reference: torch.Tensor, top: int = TOP) -> None:
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids) > 0
    for i, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(reference[i, token]), abs=1e-4)
        values, ids = reference[i].topk(top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        # The log of the confidence the router reads: one distribution, two views.
        assert math.exp(entry.logprob) == pytest.approx(completion.token_confidences[i], rel=1e-4)


def test_chosen_logprobs_are_the_log_softmax_and_its_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    entries = chosen_logprobs(logits, torch.tensor([0, 2]), 2)
    expected = logits.log_softmax(-1)
    assert entries[0].logprob == pytest.approx(float(expected[0, 0]))
    assert [t for t, _ in entries[0].top] == [1, 2] and [t for t, _ in entries[1].top] == [2, 3]
    # Rows that did not ask get None; each row's own top count is kept.
    rows = row_logprobs(logits, torch.tensor([0, 2]), [None, 1])
    assert rows[0] is None and len(rows[1].top) == 1
    assert chosen_logprobs(logits, torch.tensor([0, 2]), 0)[1].top == ()


def test_ar_logprobs_equal_the_models_softmax_greedy_and_sampled(codec):
    model = build_model(0, vocab_size=codec.vocab_size)
    engine = AutoregressiveEngine(model, codec)
    prompt = prompt_of(codec)
    greedy = GenerationRequest(prompt, SamplingParams(max_tokens=10, logprobs=TOP))
    # Sampled with a top-k cut: the logprobs are still the raw softmax (vLLM's default), not the
    # truncated distribution the token was drawn from.
    sampled = GenerationRequest(prompt, SamplingParams(max_tokens=10, temperature=1.5, top_k=4, seed=3,
                                                       logprobs=TOP))
    plain = GenerationRequest(prompt, SamplingParams(max_tokens=10))
    first, second, third = engine.generate([greedy, sampled, plain])
    assert_matches(first, reference_logprobs(model, prompt, first.token_ids))
    assert_matches(second, reference_logprobs(model, prompt, second.token_ids))
    assert third.logprobs is None  # not asked: nothing computed
    assert third.token_ids == first.token_ids


def test_ar_logprobs_under_a_grammar_are_the_unmasked_softmax(codec):
    """The grammar decides which token is chosen, not what the model thought of it: the logprob
    is the raw softmax's, and an alternative the grammar forbade may rank above the choice."""
    from nowait.engines.structured.grammar import GrammarCompiler

    model = build_model(0, vocab_size=codec.vocab_size)
    grammar = GrammarCompiler(codec.tokenizer.to_str(), codec.end_id, codec.vocab_size)
    engine = AutoregressiveEngine(model, codec, grammar=grammar)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    prompt = prompt_of(codec)
    [completion] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=12, logprobs=TOP),
                                                      schema=schema)])
    reference = reference_logprobs(model, prompt, completion.token_ids)
    assert_matches(completion, reference)
    assert any(entry.top[0][0] != entry.token_id for entry in completion.logprobs)  # the mask did choose


def test_ar_stream_chunks_carry_the_logprobs_of_their_tokens(codec):
    model = build_model(0, vocab_size=codec.vocab_size)
    engine = AutoregressiveEngine(model, codec)
    request = GenerationRequest(prompt_of(codec), SamplingParams(max_tokens=10, logprobs=1))
    chunks = list(engine.stream(request))
    streamed = [entry for chunk in chunks for entry in chunk.logprobs]
    assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]
    assert streamed == chunks[-1].completion.logprobs


def test_speculative_logprobs_are_the_targets(codec):
    target = build_model(0, vocab_size=codec.vocab_size)
    draft = build_model(1, vocab_size=codec.vocab_size, num_layers=1)
    engine = SpeculativeEngine(target, codec, draft=draft)
    prompt = prompt_of(codec)
    greedy = GenerationRequest(prompt, SamplingParams(max_tokens=12, logprobs=TOP))
    sampled = GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=TOP))
    for completion in (*engine.generate([greedy]), *engine.generate([sampled])):  # both verify paths
        assert completion.draft_tokens_proposed > 0
        assert_matches(completion, reference_logprobs(target, prompt, completion.token_ids))


def test_diffusion_logprobs_are_the_step_that_unmasked_each_token(codec):
    """One token per step over one block, no cache: the step's distribution is recomputed here
    with a plain bidirectional forward, the LLaDA reference loop in a few lines."""
    model = build_model(2, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id)
    options = DiffusionOptions(policy="fixed", block=None, cache="none")
    engine = DiffusionEngine(model, codec, options)
    prompt, length = prompt_of(codec), 8
    [completion] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=length, logprobs=TOP))])
    tokens = torch.tensor(prompt + [codec.mask_id] * length)
    expected: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        while (tokens[len(prompt):] == codec.mask_id).any():
            logits = model(tokens[None])[0, len(prompt):].float()
            logits[:, codec.mask_id] = float("-inf")
            logprobs = logits.log_softmax(-1)
            best, choice = logprobs.max(-1)
            best[tokens[len(prompt):] != codec.mask_id] = float("-inf")
            position = int(best.argmax())
            tokens[len(prompt) + position] = choice[position]
            expected[position] = logprobs[position]
            if int(choice[position]) == codec.end_id and all(  # the engine's early stop
                    int(t) != codec.mask_id for t in tokens[len(prompt): len(prompt) + position]):
                break
    reference = torch.stack([expected[i] for i in range(len(completion.token_ids))])
    assert completion.token_ids == tokens[len(prompt):len(prompt) + len(completion.token_ids)].tolist()
    assert_matches(completion, reference)


def test_diffusion_stream_chunks_carry_their_tokens_logprobs(codec):
    model = build_model(2, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id)
    engine = DiffusionEngine(model, codec, DiffusionOptions(block=4))
    request = GenerationRequest(prompt_of(codec), SamplingParams(max_tokens=12, logprobs=2))
    chunks = list(engine.stream(request))
    assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]
    [whole] = engine.generate([GenerationRequest(prompt_of(codec), SamplingParams(max_tokens=12, logprobs=2))])
    assert [e for c in chunks for e in c.logprobs] == whole.logprobs


def test_a_diffusion_template_refuses_logprobs_by_name(codec):
    model = build_model(2, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    request = GenerationRequest(prompt_of(codec), SamplingParams(max_tokens=8, logprobs=0), schema=schema)
    with pytest.raises(InvalidRequestError, match=r"^logprobs: "):
        DiffusionEngine(model, codec).plan(request)


def test_logprobs_over_twenty_are_refused():
    with pytest.raises(InvalidRequestError, match="logprobs must be in"):
        SamplingParams(logprobs=21).validate()


def test_diffusion_gemma_logprobs_are_its_last_steps_probabilities(tmp_path):
    pytest.importorskip("transformers.models.diffusion_gemma")
    from nowait.engines.config import DiffusionEngineConfig
    from nowait.engines.factory import ModelCache, build_engine
    from tests.gemma_checkpoints import CANVAS, diffusion_gemma_checkpoint

    directory = tmp_path / "diffusiongemma-tiny"
    diffusion_gemma_checkpoint(directory, seed=5)
    (directory / "generation_config.json").write_text('{"eos_token_id": 1, "max_denoising_steps": 4}')
    engine = build_engine(DiffusionEngineConfig(kind="diffusion", model=str(directory)), ModelCache()).engine
    prompt = [2, 17, 40, 5, 88, 23, 61, 9]
    asked = GenerationRequest(prompt, SamplingParams(max_tokens=2 * CANVAS, seed=7, logprobs=TOP))
    [completion] = engine.generate([asked])
    [plain] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=2 * CANVAS, seed=7))])
    assert plain.logprobs is None and plain.token_ids == completion.token_ids  # same draws either way
    assert len(completion.logprobs) == len(completion.token_ids) > 0
    for entry, token, probability in zip(completion.logprobs, completion.token_ids, completion.token_confidences,
                                         strict=True):
        # The block's tokens are the last step's argmax: the most likely token, at temperature 1.
        assert entry.token_id == token and entry.top[0][0] == token
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert math.exp(entry.logprob) == pytest.approx(probability, rel=1e-4)
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    chunks = list(engine.stream(GenerationRequest(prompt, SamplingParams(max_tokens=2 * CANVAS, seed=7, logprobs=TOP))))
    assert [e for c in chunks for e in c.logprobs] == completion.logprobs
