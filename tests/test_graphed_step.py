"""The static-shape decode step that CUDA Graphs replay (issue 24): on this CPU it runs eagerly
and must give the model's own logits and cache writes for every row, at any bucket; an engine
with it on decodes the same tokens; capture is refused without CUDA."""

from __future__ import annotations

import pytest
import torch

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.config import ArEngineConfig
from nowait.engines.factory import EngineModel, engine_from
from nowait.model import KVCache
from nowait.model.graphed_step import GraphedDecode, bucket, slot_buckets, static_decode_logits
from tests.conftest import build_model

END = 0


def test_buckets_are_the_smallest_that_hold_the_size_and_never_pass_the_cap():
    assert [bucket(n, (1, 2, 4, 8), 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket(3, (1, 2, 4, 8), 3) == 3  # the pool has 3 rows: no bucket of 4
    assert bucket(70, (64, 128), 100) == 100
    assert slot_buckets(1025) == (64, 128, 256, 512, 1024, 1025)
    assert slot_buckets(64) == (64,) and slot_buckets(10) == (10,)
    for bad in (0, 9):
        with pytest.raises(ValueError):
            bucket(bad, (1, 2, 4, 8), 8)


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False, "num_kv_heads": 4}])
def test_rows_of_different_lengths_get_the_forwards_logits_and_cache(overrides):
    """Three rows of 5, 17 and 40 cached tokens in a pool of 8 rows: one static step (batch
    bucket 4, so one padding row) against the model's forward over the same rows."""
    model = build_model(3, **overrides)
    prompts = [list(range(1, 6)), list(range(3, 20)), [7, 9] * 20]
    eager, static = KVCache(model.config, 8, 96), KVCache(model.config, 8, 96)
    graphed = GraphedDecode(model, static)
    assert not graphed.capture  # a CPU cache: nothing is captured
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            for cache in (eager, static):
                view = cache.view(row, 1)
                model(torch.tensor([prompt]), view)
                cache.lengths[row] = len(prompt)
        tokens = [11, 12, 13]
        for _ in range(6):
            view = eager.view(0, 3)
            expected = model(torch.tensor([[t] for t in tokens]), view)
            eager.lengths[:3] = view.lengths
            view = static.view(0, 3)
            got = graphed(tokens, view)
            static.lengths[:3] = view.lengths
            assert got.shape == expected.shape == (3, 1, model.config.vocab_size)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            tokens = expected[:, 0].argmax(-1).tolist()
    assert torch.equal(eager.lengths[:3], static.lengths[:3])
    assert graphed.buckets(3, 46) == (4, 64)
    for e, s in zip(eager.keys + eager.values, static.keys + static.values, strict=True):
        for row, prompt in enumerate(prompts):  # every valid slot alike; padding wrote row 3 only
            n = len(prompt) + 6
            torch.testing.assert_close(s[row, :, :n], e[row, :, :n], atol=1e-5, rtol=1e-5)
        assert not s[4:].any()


def test_a_masked_slot_changes_nothing_and_a_visible_one_does():
    """The mask is what keeps the bucket's extra slots out: garbage past a row's length leaves
    the logits alone, garbage inside them moves them."""
    model = build_model(1)
    cache = KVCache(model.config, 1, 64)
    with torch.no_grad():
        model(torch.tensor([list(range(1, 10))]), cache)
        rope = model.rope(64, torch.device("cpu"))
        inputs = (torch.tensor([4]), torch.tensor([9]), rope)
        clean = static_decode_logits(model, *inputs, cache.keys, cache.values)
        for k in cache.keys:
            k[0, :, 20:] = 50.0
        assert torch.allclose(static_decode_logits(model, *inputs, cache.keys, cache.values), clean, atol=1e-5)
        for k in cache.keys:
            k[0, :, 3] = 50.0
        assert not torch.allclose(static_decode_logits(model, *inputs, cache.keys, cache.values), clean, atol=1e-2)


def test_it_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="causal"):
        GraphedDecode(build_model(0, causal=False), KVCache(build_model(0).config, 1, 8))
    model = build_model(0)
    cache = KVCache(model.config, 2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedDecode(model, cache, capture=True)  # no CUDA device behind a CPU cache
    graphed = GraphedDecode(model, cache)
    view = cache.view(0, 2)
    with pytest.raises(ValueError, match="tokens for a view of 2 rows"):
        graphed([1], view)
    cache.lengths.fill_(8)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        graphed([1, 2], cache.view(0, 2))


@pytest.fixture(scope="module")
def engine_model():
    return build_model(5)


def test_an_engine_with_the_static_step_decodes_the_same_tokens(engine_model):
    """Through the engine: decode steps of 1 to 3 running rows take the static step (counted),
    prefills stay eager; greedy tokens equal the eager engine's, alone and together."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (7, 19, 33)]
    steps: list[int] = []

    def completions(graphs: bool, together: bool) -> list[list[int]]:
        engine = AutoregressiveEngine(engine_model, end_id=END, config=EngineConfig(max_num_seqs=4, cuda_graphs=graphs))
        if graphs:
            step = engine.runner.graphed
            assert step is not None and not step.capture

            class Counted:
                failed = False

                def __call__(self, tokens, view, longest):
                    steps.append(len(tokens))
                    return step(tokens, view, longest)

            engine.runner.graphed = Counted()
        reqs = [GenerationRequest(p, SamplingParams(max_tokens=24)) for p in prompts]
        done = engine.generate(reqs) if together else [engine.generate([r])[0] for r in reqs]
        return [c.token_ids for c in done]

    expected = completions(False, together=False)
    assert completions(True, together=False) == expected
    assert len(steps) >= sum(len(tokens) - 1 for tokens in expected) > 0 and set(steps) == {1}
    steps.clear()
    assert completions(True, together=True) == expected
    assert 3 in steps


def test_a_failed_graph_hands_the_steps_back_to_the_models_forward(engine_model):
    """`failed` (a capture that failed or disagreed, on a GPU) sends every later decode step to
    the engine's own forward: the static step is not called again, the tokens stay the same."""
    engine = AutoregressiveEngine(engine_model, end_id=END, config=EngineConfig(max_num_seqs=2, cuda_graphs=True))
    request = GenerationRequest([3, 4, 5, 6], SamplingParams(max_tokens=12))
    expected = engine.generate([request])[0].token_ids
    engine.runner.graphed.failed = True
    engine.runner.graphed.__class__ = type("Refusing", (GraphedDecode,), {"__call__": lambda *a: pytest.fail("called")})
    assert engine.generate([request])[0].token_ids == expected


def test_warm_up_runs_every_bucket_the_pool_allows_and_writes_only_slot_0():
    model = build_model(2)
    cache = KVCache(model.config, 5, 100)  # batch buckets 1, 2, 4 and the pool's 5; slots 64 and 100
    graphed = GraphedDecode(model, cache)
    assert graphed.warm_up() == 4 * 2
    for keys in cache.keys:
        assert keys[:, :, 0].abs().sum() > 0 and not keys[:, :, 1:].any()
    assert not cache.lengths.any()


def test_a_wrong_longest_is_refused_on_a_cpu():
    model = build_model(0)
    cache = KVCache(model.config, 2, 16)
    cache.lengths.copy_(torch.tensor([3, 9]))
    with pytest.raises(ValueError, match="a row holds 10 keys"):
        GraphedDecode(model, cache)([1, 2], cache.view(0, 2), longest=5)


def test_the_config_key_reaches_the_engine_and_is_off_on_a_cpu_by_default(engine_model):
    target = EngineModel(engine_model, None, end_ids=(END,))
    assert engine_from(ArEngineConfig(kind="ar", structured=False), target).runner.graphed is None
    on = engine_from(ArEngineConfig(kind="ar", structured=False, cuda_graphs=True), target)
    assert isinstance(on.runner.graphed, GraphedDecode) and on.runner.graphed.cache is on.pool.caches[0]
