"""The compiled diffusion block step: the model's own logits and cache writes, one graph for every
span, cached length and read count, and a diffusion engine that decodes the same tokens with it
(issue 28)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.config import DiffusionEngineConfig
from nowait.engines.diffusion.cache import empty_cache, forward_spans
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.factory import EngineModel, engine_from
from nowait.model import KVCache
from nowait.model.compiled_block import CompiledBlock, warm_up_sizes
from tests.conftest import build_model


@pytest.fixture(autouse=True)
def inference_tensors():
    """As in the engine, whose tensors are inference tensors: the graph is compiled for them."""
    torch._dynamo.reset()  # each test's graphs its own (the compiler keeps 8 per function at most)
    with torch.inference_mode():
        yield


# (cached slots, span tokens, read offsets): a dual-cache step, a refresh, a one-position step
# (a read count of 1), a span over an empty cache, reads not at the span's end.
STEPS = [(40, 9, range(1, 9)), (33, 21, range(3, 19)), (50, 2, range(1, 2)), (0, 12, range(4, 12)),
         (0, 30, range(17, 30)), (7, 15, range(9, 14))]


def both_caches(model, filled: int) -> tuple[KVCache, KVCache]:
    """Two identical one-row engine caches holding keys/values of `filled` random tokens."""
    tokens = torch.randint(2, model.config.vocab_size, (1, filled), generator=torch.Generator().manual_seed(3))
    caches = empty_cache(model, 1, 128), empty_cache(model, 1, 128)
    for cache in caches:
        model(tokens, cache)
    return caches


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False, "num_kv_heads": 4}])
def test_the_step_gives_the_forwards_logits_and_writes_the_same_cache(overrides):
    model = build_model(3, causal=False, **overrides)
    counter = CompileCounter()
    compiled = CompiledBlock(model, backend=counter)
    compiled.warm_up()  # as the engine does: sizes that tie no symbols together
    eager, fast = both_caches(model, 60)
    g = torch.Generator().manual_seed(4)
    for cached, length, reads in STEPS:
        span = torch.randint(2, model.config.vocab_size, (length,), generator=g)
        outputs = torch.tensor(list(reads))[None]
        eager.lengths.fill_(cached)
        fast.lengths.fill_(cached)
        expected = forward_spans(model, [span], [cached + 3], 0, eager, write=True, outputs=outputs)
        got = compiled(span, cached + 3, fast, outputs)
        assert got.shape == expected.shape == (1, len(reads), model.config.vocab_size)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(eager.lengths, fast.lengths) and int(fast.lengths[0]) == cached + length
        torch.testing.assert_close(fast.storage, eager.storage, atol=1e-5, rtol=1e-5)
    # Six shapes, a read count of 1 among them: compiled once, each size a symbol (a graph per
    assert counter.frame_count == 1


def test_warm_up_compiles_once_and_later_steps_compile_nothing_more():
    model = build_model(4, causal=False)
    counter = CompileCounter()
    compiled = CompiledBlock(model, backend=counter)
    assert compiled.warm_up() == compiled.compile_seconds > 0
    assert counter.frame_count == 1
    fast = both_caches(model, 30)[0]
    for cached, length, reads in STEPS:
        fast.lengths.fill_(cached)
        compiled(torch.arange(2, 2 + length), cached, fast, torch.tensor(list(reads))[None])
    assert counter.frame_count == 1


def test_the_warm_up_sizes_are_no_other_size_of_the_step():
    model = build_model(0, causal=False)
    cached, length, count = warm_up_sizes(model)
    c = model.config
    sizes = [count, count - 1, length, length - 1, cached + length, cached + length - 2]
    assert 1 < count < length and len(set(sizes)) == len(sizes)
    assert not set(sizes) & {c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.vocab_size,
                             c.intermediate_size, c.max_position, 2}


def test_it_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="bidirectional"):
        CompiledBlock(build_model(0))
    model = build_model(0, causal=False)
    compiled = CompiledBlock(model, backend="eager")
    reads = torch.arange(2)[None]
    with pytest.raises(ValueError, match="one row"):
        compiled(torch.arange(2, 5), 0, KVCache(model.config, 2, 8), reads)
    full = KVCache(model.config, 1, 8)
    full.lengths.fill_(6)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        compiled(torch.arange(2, 5), 6, full, reads)
    with pytest.raises(ValueError, match="at least two tokens"):
        compiled(torch.arange(2, 3), 0, KVCache(model.config, 1, 8), reads[:, :1])


@pytest.fixture(scope="module")
def diffusion(codec):
    return build_model(6, vocab_size=codec.vocab_size, causal=False, logits_shift=True, mask_token_id=codec.mask_id)


def decode(engine: DiffusionEngine, codec, together: bool) -> list[tuple[list[int], list[float], int]]:
    prompts = ["Extract the fields.", "Invoice 1234 from ACME, total 99.50 EUR due 2026-01-05.", "Name: Ada"]
    requests = [GenerationRequest(codec.encode(p), SamplingParams(max_tokens=20), options={"tau": tau, "block": 8})
                for p in prompts for tau in (0.3, 0.999)]
    done = engine.generate(requests) if together else [engine.generate([r])[0] for r in requests]
    return [(c.token_ids, c.token_confidences, c.forwards) for c in done]


def test_an_engine_with_the_compiled_step_decodes_the_same_tokens(diffusion, codec):
    """Alone, every forward of a request but its first (refreshes and steps) takes the compiled
    step; several at once stay eager; both give the eager engine's tokens."""
    expected = decode(DiffusionEngine(diffusion, codec), codec, together=False)
    engine = DiffusionEngine(diffusion, codec)
    counter = CompileCounter()
    engine.compiled = CompiledBlock(diffusion, backend=counter)
    engine.compiled.warm_up()  # as `compile=True` does
    calls = []
    step = engine.compiled.__call__
    engine.compiled = lambda *args: calls.append(args) or step(*args)
    got = decode(engine, codec, together=False)
    for (tokens, confidences, forwards), (want_tokens, want_confidences, want_forwards) in zip(got, expected,
                                                                                           strict=True):
        assert tokens == want_tokens and forwards == want_forwards
        assert confidences == pytest.approx(want_confidences, abs=1e-4)
    assert len(calls) == sum(forwards - 1 for _, _, forwards in expected) and counter.frame_count == 1
    calls.clear()
    together = decode(engine, codec, together=True)
    assert [t for t, _, _ in together] == [t for t, _, _ in expected]
    # Rows forwarded together stay eager (a row left alone in the batch takes the compiled step).
    assert len(calls) < sum(forwards for _, _, forwards in together) / 2


def test_rows_made_outside_inference_mode_run_the_warm_up_graph(diffusion, codec):
    """A server plans its requests outside inference mode (the engine enters it for the steps),
    so a row's tokens are ordinary tensors: the step still runs the graph the warm-up compiled
    (a graph compiled again for them took seconds at a server's first request)."""
    engine = DiffusionEngine(diffusion, codec)
    counter = CompileCounter()
    engine.compiled = CompiledBlock(diffusion, backend=counter)
    engine.compiled.warm_up()
    with torch.inference_mode(False):
        streamed = list(engine.stream(GenerationRequest(codec.encode("Name: Ann"), SamplingParams(max_tokens=48))))
        together = decode(engine, codec, together=False)
    assert streamed[-1].completion is not None and together
    assert counter.frame_count == 1


def test_the_config_key_builds_an_inductor_step_that_decodes_the_same_tokens(diffusion, codec):
    """The real compiler (generated C++ kernels) through the config key `compile`."""
    target = EngineModel(diffusion, codec)
    plain = engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=1), target)
    assert plain.compiled is None
    compiled = engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=1, compile=True), target)
    assert isinstance(compiled.compiled, CompiledBlock) and compiled.compiled.compile_seconds > 0
    assert [t for t, _, _ in decode(compiled, codec, False)] == [t for t, _, _ in decode(plain, codec, False)]
