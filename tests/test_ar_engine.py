"""The AR engine: continuous batching equals decoding alone, stop/max tokens, records, bad input."""

from __future__ import annotations

import pytest
import torch

from nowait import paths
from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig, greedy_decode
from nowait.engines.ar.runner import length_groups
from nowait.engines.ar.sampling import token_probability
from nowait.engines.base import Engine, GenerationRequest, InvalidRequestError, SamplingParams
from nowait.model import KVCache
from nowait.tokenizer import TextCodec
from tests.conftest import build_model

END = 0


def prompts(count: int, seed: int = 1, vocab: int = 64, longest: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def requests(ids: list[list[int]], **sampling) -> list[GenerationRequest]:
    return [GenerationRequest(p, SamplingParams(**{"max_tokens": 16, **sampling}), request_id=f"r{i}")
            for i, p in enumerate(ids)]


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def small_engine(model, **caps) -> AutoregressiveEngine:
    return AutoregressiveEngine(model, end_id=END, config=EngineConfig(**{"max_num_seqs": 4,
                                                                          "max_num_batched_tokens": 48, **caps}))


def test_it_is_an_engine(model):
    engine = small_engine(model)
    assert isinstance(engine, Engine) and engine.kind == "ar"


def test_continuous_batching_equals_the_reference_greedy_decoder(model):
    ids = prompts(11)
    reference = greedy_decode(model, ids, 16, END)
    engine = small_engine(model)  # 4 rows, 48-token steps: queueing, chunked prefill, row moves
    completions = engine.generate(requests(ids))
    assert [c.token_ids for c in completions] == reference
    assert engine.steps["prefill"] > 1 and engine.steps["decode"] > 16
    assert engine.pool.used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 5},
                                      {"temperature": 1.3, "top_k": 7, "seed": 11}])
def test_a_batched_run_equals_each_request_alone(model, sampling):
    ids = prompts(7, seed=2)
    engine = small_engine(model, max_num_seqs=8, max_num_batched_tokens=512)
    alone = [engine.generate(requests([p], **sampling))[0].token_ids for p in ids]
    together = engine.generate(requests(ids, **sampling))
    assert [c.token_ids for c in together] == alone


def test_seeded_sampling_repeats_and_different_seeds_differ(model):
    engine = small_engine(model)
    first = engine.generate(requests(prompts(3), temperature=1.0, seed=3))
    second = engine.generate(requests(prompts(3), temperature=1.0, seed=3))
    other = engine.generate(requests(prompts(3), temperature=1.0, seed=4))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_max_tokens_and_stop_tokens(model):
    engine = small_engine(model)
    prompt = prompts(1, seed=3)[0]
    free = engine.generate(requests([prompt], max_tokens=12))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop)
    stopped = engine.generate(requests([prompt], max_tokens=12, stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:cut]
    one = engine.generate(requests([prompt], max_tokens=1))[0]
    assert one.token_ids == free.token_ids[:1] and one.forwards == 1


def test_the_model_end_token_stops_and_is_not_emitted():
    model = build_model(4)
    prompt = prompts(1, seed=5)[0]
    free = AutoregressiveEngine(model, end_id=END).generate(requests([prompt], max_tokens=10))[0]
    engine = AutoregressiveEngine(model, end_id=free.token_ids[2])
    completion = engine.generate(requests([prompt], max_tokens=10))[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[2])]


def test_any_of_several_end_ids_stops_with_finish_reason_stop():
    """A checkpoint with several end-of-turn ids (Llama 3: <|end_of_text|>, <|eot_id|>) stops at
    the second as at the first; request stop ids still add to them; the first pads."""
    model = build_model(4)
    prompt = prompts(1, seed=5)[0]
    free = AutoregressiveEngine(model, end_id=END).generate(requests([prompt], max_tokens=10))[0]
    second = free.token_ids[2]
    engine = AutoregressiveEngine(model, end_ids=(END, second))
    assert engine.end_id == END and engine.end_ids == (END, second)
    completion = engine.generate(requests([prompt], max_tokens=10))[0]
    assert completion.finish_reason == "stop" and second not in completion.token_ids
    assert completion.token_ids == free.token_ids[: free.token_ids.index(second)]
    early = engine.generate(requests([prompt], max_tokens=10, stop_token_ids=(free.token_ids[0],)))[0]
    assert early.token_ids == [] and early.finish_reason == "stop"
    assert AutoregressiveEngine(model, end_id=7, end_ids=(END, 7)).end_ids == (7, END)
    with pytest.raises(ValueError, match="end_ids"):
        AutoregressiveEngine(model)


def test_sequences_stop_at_the_engine_length_limit(model):
    engine = small_engine(model, max_model_len=20)
    completion = engine.generate(requests([list(range(1, 16))], max_tokens=50))[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5


def test_completion_record(model):
    engine = small_engine(model)
    prompt = prompts(1, seed=6)[0]
    completion = engine.generate(requests([prompt], max_tokens=8))[0]
    assert completion.engine == "ar" and completion.request_id == "r0"
    assert completion.prompt_tokens == len(prompt)
    assert completion.forwards == len(completion.token_ids)  # one prefill, then one forward per token
    assert len(completion.token_confidences) == len(completion.token_ids)
    assert completion.confidence == min(completion.token_confidences)
    # confidence is the model's own probability of each token, from a plain forward
    logits = model(torch.tensor([prompt + completion.token_ids]))[0, len(prompt) - 1: -1]
    expected = token_probability(logits, torch.tensor(completion.token_ids))
    assert torch.allclose(torch.tensor(completion.token_confidences), expected, atol=1e-5)
    t = completion.timings
    assert 0 <= t.queued_s <= t.first_token_s <= t.total_s


def test_stream_yields_the_completion_piece_by_piece():
    codec = TextCodec.from_file(paths.tokenizer_path())
    model = build_model(2, vocab_size=codec.vocab_size)
    engine = AutoregressiveEngine(model, codec)
    request = GenerationRequest(codec.encode("Extract the KYC form"), SamplingParams(max_tokens=12))
    chunks = list(engine.stream(request))
    completion = chunks[-1].completion
    assert completion is not None and all(c.completion is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == completion.text == codec.decode(completion.token_ids)
    assert [t for c in chunks for t in c.token_ids] == completion.token_ids


@pytest.mark.parametrize(("request_", "message"), [
    (GenerationRequest([1, 2], SamplingParams(max_tokens=-3)), "max_tokens"),
    (GenerationRequest([1, 2], SamplingParams(top_p=0.0)), "top_p"),
    (GenerationRequest([1, 2], SamplingParams(top_p=1.01)), "top_p"),
    (GenerationRequest([], SamplingParams()), "prompt_ids"),
    (GenerationRequest([1, 64], SamplingParams()), "vocabulary"),
    (GenerationRequest([1, 2], SamplingParams(stop_token_ids=(99,))), "stop_token_ids"),
    (GenerationRequest(list(range(1, 40)) * 20, SamplingParams()), "prompt"),
    (GenerationRequest([1, 2], schema={"type": "object"}), "schema"),
])
def test_bad_requests_are_refused_before_any_work(model, request_, message):
    engine = small_engine(model)
    good = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate([good, request_])
    assert not engine.has_unfinished()  # the good request was not started either


def test_engine_refuses_a_bidirectional_model():
    with pytest.raises(ValueError, match="causal"):
        AutoregressiveEngine(build_model(0, causal=False), end_id=END)


def test_prefill_groups_rows_of_similar_length():
    lengths = [212, 150, 121, 200, 205, 230, 180, 179]
    groups = length_groups(lengths, max_padding=0.1)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) == 1 or sum(lengths[i] for i in group) >= 0.9 * len(group) * longest
    assert length_groups([5]) == [[0]] and length_groups([3, 3, 3]) == [[0, 1, 2]]


@torch.no_grad()
def test_the_models_shortcuts_give_the_same_logits(model):
    """One unpadded row takes a shortcut (no mask for one new token, a contiguous cache write),
    and `output_positions` projects only the asked positions: the same numbers either way."""
    prompt = torch.tensor([prompts(1, seed=8, longest=30)[0]])
    fast, general = KVCache(model.config, 1, 64), KVCache(model.config, 1, 64)
    full = model(prompt, fast)
    assert torch.equal(full, model(prompt, general, valid_lengths=torch.tensor([prompt.shape[1]])))
    for step in ([[5]], [[7, 9, 11]], [[3]]):
        ids = torch.tensor(step)
        a = model(ids, fast)
        b = model(ids, general, valid_lengths=torch.tensor([ids.shape[1]]))  # the batched path
        assert torch.allclose(a, b, atol=1e-5) and torch.equal(fast.lengths, general.lengths)
    last = KVCache(model.config, 1, 64)
    picked = model(prompt, last, output_positions=torch.tensor([[prompt.shape[1] - 1, 0]]))
    assert torch.allclose(picked[0], full[0, [prompt.shape[1] - 1, 0]], atol=1e-5)


def test_confidence_counts_the_stop_decision(codec):
    """An answer that ends on a stop token reports the stop token's probability among its
    decisions, as the diffusion engine counts its closing end token."""
    from nowait.engines.ar.sequence import Sequence

    seq = Sequence(0, GenerationRequest([5, 6], SamplingParams(max_tokens=5)), frozenset({0}), capacity=16,
                   generator=None)
    seq.append_token(9, 0.9, 0.0)
    seq.append_token(0, 0.3, 0.0)  # the stop token, unsure
    completion = seq.to_completion("ar", "x")
    assert completion.token_confidences == [0.9] and completion.confidence == 0.3
