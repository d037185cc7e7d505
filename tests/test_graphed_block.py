"""The static-shape diffusion block step that CUDA Graphs replay (issue 24): on this CPU it runs
eagerly on its staging cache and must give the model's own logits and cache writes at every
bucket; a diffusion engine with it on decodes the same tokens; capture needs CUDA."""

from __future__ import annotations

import pytest
import torch

from nowait.engines.config import DiffusionEngineConfig
from nowait.engines.diffusion.cache import empty_cache, forward_spans
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.factory import EngineModel, engine_from
from nowait.model import KVCache
from nowait.model.graphed_block import GraphedBlock
from tests.conftest import build_model
from tests.test_compiled_block import decode

# (cached slots, span tokens, read offsets): a dual-cache step, a refresh, a one-position step,
# a span over an empty cache, reads not at the span's end, a span longer than the largest bucket.
STEPS = [(40, 9, range(1, 9)), (33, 21, range(3, 19)), (50, 2, range(1, 2)), (0, 12, range(4, 12)),
         (7, 15, range(9, 14)), (10, 140, range(100, 139))]


@pytest.mark.parametrize("slot_cache", [True, False])
@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False, "num_kv_heads": 4}])
def test_the_step_gives_the_forwards_logits_and_writes_the_same_cache(overrides, slot_cache):
    """Against the model's forward (`forward_spans`), on the engine's one-tensor cache and on a
    plain per-layer KVCache; the staging's leftovers from a longer earlier step stay masked."""
    model = build_model(3, causal=False, max_position=256, **overrides)
    graphed = GraphedBlock(model)
    assert not graphed.capture
    tokens = torch.randint(2, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(3))
    if slot_cache:
        eager, static = empty_cache(model, 1, 256), empty_cache(model, 1, 256)
    else:
        eager, static = KVCache(model.config, 1, 256), KVCache(model.config, 1, 256)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for cache in (eager, static):
            model(tokens, cache)
        for cached, length, reads in STEPS:
            span = torch.randint(2, model.config.vocab_size, (length,), generator=g)
            outputs = torch.tensor(list(reads))[None]
            eager.lengths.fill_(cached)
            static.lengths.fill_(cached)
            expected = forward_spans(model, [span], [cached + 3], 0, eager, write=True, outputs=outputs)
            got = graphed(span, cached + 3, static, outputs)
            assert got.shape == expected.shape == (1, len(reads), model.config.vocab_size)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert int(static.lengths[0]) == cached + length
            for e, s in zip(eager.keys + eager.values, static.keys + static.values, strict=True):
                torch.testing.assert_close(s[:, :, : cached + length], e[:, :, : cached + length], atol=1e-5,
                                           rtol=1e-5)
    assert {key[0] for key in graphed.graphs} == {8, 16, 32, 256}  # power-of-two span buckets


def test_a_span_past_the_last_bucket_and_no_reads_run_without_a_graph_entry():
    from nowait.model.graphed_block import SPAN_BUCKETS

    model = build_model(2, causal=False, max_position=2048)
    graphed = GraphedBlock(model)
    cache = empty_cache(model, 1, 2048)
    with torch.inference_mode():
        long = torch.arange(2, 2 + SPAN_BUCKETS[-1] + 5) % model.config.vocab_size
        reads = torch.arange(3)[None]
        expected = forward_spans(model, [long], [0], 0, empty_cache(model, 1, 2048), write=True, outputs=reads)
        torch.testing.assert_close(graphed(long, 0, cache, reads), expected, atol=1e-4, rtol=1e-4)
        assert not graphed.graphs and int(cache.lengths[0]) == len(long)
        none = graphed(torch.arange(2, 6), int(cache.lengths[0]), cache, torch.zeros(1, 0, dtype=torch.long))
        assert none.shape == (1, 0, model.config.vocab_size)


def test_it_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="bidirectional"):
        GraphedBlock(build_model(0))
    model = build_model(0, causal=False)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedBlock(model, capture=True)
    graphed = GraphedBlock(model)
    reads = torch.arange(2)[None]
    with pytest.raises(ValueError, match="one row"):
        graphed(torch.arange(2, 5), 0, KVCache(model.config, 2, 8), reads)
    full = KVCache(model.config, 1, 8)
    full.lengths.fill_(6)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        graphed(torch.arange(2, 5), 6, full, reads)


@pytest.fixture(scope="module")
def diffusion(codec):
    return build_model(6, vocab_size=codec.vocab_size, causal=False, logits_shift=True, mask_token_id=codec.mask_id)


def test_an_engine_with_the_static_step_decodes_the_same_tokens(diffusion, codec):
    """Alone, every forward of a request but its first takes the static step (counted); the
    tokens, confidences and forwards equal the eager engine's, alone and together."""
    expected = decode(DiffusionEngine(diffusion, codec), codec, together=False)
    engine = DiffusionEngine(diffusion, codec, cuda_graphs=True)
    assert isinstance(engine.compiled, GraphedBlock) and not engine.compiled.capture
    calls = []
    step = engine.compiled.__call__
    engine.compiled = lambda *args: calls.append(args) or step(*args)
    got = decode(engine, codec, together=False)
    for (tokens, confidences, forwards), (want_tokens, want_confidences, want_forwards) in zip(got, expected,
                                                                                           strict=True):
        assert tokens == want_tokens and forwards == want_forwards
        assert confidences == pytest.approx(want_confidences, abs=1e-4)
    assert len(calls) == sum(forwards - 1 for _, _, forwards in expected) > 0
    assert [t for t, _, _ in decode(engine, codec, together=True)] == [t for t, _, _ in expected]


def test_the_config_key_reaches_the_engine_and_is_off_on_a_cpu_by_default(diffusion, codec):
    target = EngineModel(diffusion, codec)
    assert engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=1), target).compiled is None
    on = engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=1, cuda_graphs=True), target)
    assert isinstance(on.compiled, GraphedBlock)
