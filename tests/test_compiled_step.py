"""The compiled decode step: the model's own logits and cache writes, one graph for every length,
and an AR engine that decodes the same tokens with it (issue 28)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.config import ArEngineConfig
from nowait.engines.factory import EngineModel, engine_from
from nowait.model import KVCache
from nowait.model.compiled_step import CompiledDecode, warm_up_length
from tests.conftest import build_model

END = 0


def decode_both(model, compiled: CompiledDecode, prompt: list[int], steps: int) -> tuple[float, list, list]:
    """Feed the same greedy tokens through the model's forward and the compiled step, each with
    its own cache: the largest logit difference and both caches' final (keys, lengths)."""
    eager, fast = KVCache(model.config, 1, len(prompt) + steps), KVCache(model.config, 1, len(prompt) + steps)
    with torch.no_grad():
        model(torch.tensor([prompt]), eager)
        model(torch.tensor([prompt]), fast)
        token, worst = prompt[-1], 0.0
        for _ in range(steps):
            expected, got = model(torch.tensor([[token]]), eager), compiled(token, fast)
            assert got.shape == expected.shape == (1, 1, model.config.vocab_size)
            worst = max(worst, float((expected - got).abs().max()))
            token = int(expected.argmax())
    return worst, [eager.keys, eager.values, eager.lengths], [fast.keys, fast.values, fast.lengths]


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False, "num_kv_heads": 4}])
def test_the_step_gives_the_forwards_logits_and_writes_the_same_cache(overrides):
    model = build_model(3, **overrides)
    counter = CompileCounter()
    compiled = CompiledDecode(model, backend=counter)
    worst, eager, fast = decode_both(model, compiled, list(range(1, 12)), steps=20)
    assert worst < 1e-4
    assert torch.equal(eager[2], fast[2])  # lengths moved on one per step
    for eager_layer, fast_layer in zip(eager[0] + eager[1], fast[0] + fast[1], strict=True):
        torch.testing.assert_close(fast_layer, eager_layer, atol=1e-5, rtol=1e-5)
    # 20 lengths, 11 to 30 keys: compiled once, the length a symbol (a graph per length would
    # cost a compile per decode step).
    assert counter.frame_count == 1


def test_warm_up_compiles_once_and_the_first_real_step_compiles_nothing_more():
    model = build_model(4)
    counter = CompileCounter()
    compiled = CompiledDecode(model, backend=counter)
    assert compiled.warm_up() == compiled.compile_seconds > 0
    assert counter.frame_count == 1
    decode_both(model, compiled, [5, 6, 7], steps=3)
    assert counter.frame_count == 1


def test_the_warm_up_length_is_no_other_size_of_the_step():
    # With a length equal to another input's size (here the heads, 4), the compiler ties the
    # two and compiles again for each length that differs.
    model = build_model(0)
    length = warm_up_length(model)
    c = model.config
    assert length >= 2 and not {length, length - 1} & {c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size,
                                                         c.vocab_size, c.intermediate_size}


def test_it_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="causal"):
        CompiledDecode(build_model(0, causal=False))
    model = build_model(0)
    compiled = CompiledDecode(model, backend="eager")
    with pytest.raises(ValueError, match="one row"):
        compiled(1, KVCache(model.config, 2, 8))
    full = KVCache(model.config, 1, 4)
    full.lengths.fill_(4)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        compiled(1, full)


@pytest.fixture(scope="module")
def engine_model():
    return build_model(5)


def test_an_engine_with_the_inductor_step_decodes_the_same_tokens(engine_model):
    """The real compiler (generated C++ kernels), through the engine: one request at a time
    takes the compiled step, several at once the eager batch; both give the eager tokens."""
    model = engine_model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (7, 19, 33)]

    compiled_steps = []

    def completions(compile_decode: bool, together: bool) -> list[list[int]]:
        engine = AutoregressiveEngine(model, end_id=END, config=EngineConfig(max_num_seqs=4,
                                                                             compile_decode=compile_decode))
        if compile_decode:  # count the steps the compiled graph takes
            step = engine.runner.compiled
            engine.runner.compiled = lambda token, cache: compiled_steps.append(token) or step(token, cache)
        reqs = [GenerationRequest(p, SamplingParams(max_tokens=24)) for p in prompts]
        done = engine.generate(reqs) if together else [engine.generate([r])[0] for r in reqs]
        return [c.token_ids for c in done]

    expected = completions(False, together=False)
    assert completions(True, together=False) == expected
    # alone, every decode step takes it: one per token after the prefill's (and one more for
    # an answer that ended on the end token, which its ids leave out)
    assert len(compiled_steps) >= sum(len(tokens) - 1 for tokens in expected) > 0
    assert completions(True, together=True) == expected


def test_the_config_key_reaches_the_engine(engine_model):
    model = engine_model  # compiled by the test above: the compiler's cache answers at once
    target = EngineModel(model, None, end_ids=(END,))
    plain = engine_from(ArEngineConfig(kind="ar", structured=False), target)
    assert plain.runner.compiled is None
    compiled = engine_from(ArEngineConfig(kind="ar", structured=False, compile=True), target)
    assert isinstance(compiled.runner.compiled, CompiledDecode) and compiled.runner.compiled.compile_seconds > 0
