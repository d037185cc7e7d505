"""Automatic prefix caching: exact block matches, what is restored, eviction, and the engine's
outputs with and without it."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.ar.prefix_cache import PrefixCache
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.model import KVCache
from tests.conftest import build_model

END = 0
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def prefilled(model, prompt: list[int], rows: int = 2) -> KVCache:
    cache = KVCache(model.config, rows, 64)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache.view(0, 1))
    cache.lengths[0] = len(prompt)
    return cache


def test_restore_copies_the_stored_blocks_a_prompt_starts_with(model):
    prompt = list(range(1, 12))  # 11 tokens: two full blocks of 4, three left over
    cache = prefilled(model, prompt)
    store = PrefixCache(cache, capacity_blocks=8, block_size=BLOCK, admit_after=1)
    store.store(prompt, cache, 0)
    assert len(store.slots) == 2
    other = [*prompt[:9], 50, 51]  # shares the first two blocks and one more token
    assert store.restore(other, cache, 1) == 8
    assert int(cache.lengths[1]) == 8
    for layer in range(model.config.num_layers):
        assert_close(cache.keys[layer][1, :, :8], cache.keys[layer][0, :, :8], atol=0, rtol=0)
        assert_close(cache.values[layer][1, :, :8], cache.values[layer][0, :, :8], atol=0, rtol=0)


def test_a_block_matches_only_after_the_same_blocks(model):
    prompt = list(range(1, 12))
    cache = prefilled(model, prompt)
    store = PrefixCache(cache, capacity_blocks=8, block_size=BLOCK, admit_after=1)
    store.store(prompt, cache, 0)
    shifted = [60, 61, 62, 63, *prompt[4:]]  # the second block's tokens, after another first block
    assert store.restore(shifted, cache, 1) == 0
    assert int(cache.lengths[1]) == 0


def test_one_prompt_token_is_always_left_to_compute(model):
    prompt = list(range(1, 9))  # exactly two blocks
    cache = prefilled(model, prompt)
    store = PrefixCache(cache, capacity_blocks=8, block_size=BLOCK, admit_after=1)
    store.store(prompt, cache, 0)
    assert store.restore(prompt, cache, 1) == 4  # the last token's logits choose the first output


def test_the_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_continuations(model):
    first = list(range(1, 10))
    second = list(range(20, 29))
    cache = prefilled(model, first)
    store = PrefixCache(cache, capacity_blocks=3, block_size=BLOCK, admit_after=1)
    store.store(first, cache, 0)  # A1, A2; A1 touched last
    other = prefilled(model, second)
    store.store(second, other, 0)  # B1 takes the free slot; B2 evicts the least recent, A2
    assert len(store.slots) == 3
    assert store.restore([*first[:4], 99, 98], cache, 1) == 4  # A1 kept: a prefix outlives A2
    assert store.restore(first, cache, 1) == 4  # A2 gone
    assert store.restore(second, cache, 1) == 8  # B1, B2
    for layer in range(model.config.num_layers):  # B2 landed in A2's slot: its own keys/values
        assert_close(cache.keys[layer][1, :, :8], other.keys[layer][0, :, :8], atol=0, rtol=0)
        assert_close(cache.values[layer][1, :, :8], other.values[layer][0, :, :8], atol=0, rtol=0)
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixCache(cache, capacity_blocks=0)


def engine(model, **config) -> AutoregressiveEngine:
    return AutoregressiveEngine(model, end_id=END, config=EngineConfig(**{"max_num_seqs": 4,
                                                                          "max_num_batched_tokens": 48,
                                                                          "prefix_block_size": BLOCK, **config}))


def shared_prefix_prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(1, 64, (13,), generator=g).tolist()
    return [system + torch.randint(1, 64, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 9, (count,), generator=g)]


def test_engine_outputs_are_the_same_with_and_without_the_prefix_cache(model):
    ids = shared_prefix_prompts(6)

    def run(e: AutoregressiveEngine) -> list:
        alone = [e.generate([GenerationRequest(p, SamplingParams(max_tokens=12))])[0] for p in ids[:2]]
        return alone + e.generate([GenerationRequest(p, SamplingParams(max_tokens=12)) for p in ids[2:]])

    cached, plain = run(engine(model)), run(engine(model, prefix_cache_tokens=0))
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
    # Seen once, then stored at the second sighting, then restored: 13 shared tokens, three blocks of 4.
    assert [c.cached_prompt_tokens for c in cached] == [0, 0, 12, 12, 12, 12]
    assert all(c.cached_prompt_tokens == 0 for c in plain)
    assert all(c.forwards == p.forwards for c, p in zip(cached, plain, strict=True))


def test_engine_prefix_cache_settings_are_checked(model):
    assert engine(model, prefix_cache_tokens=0).prefix_cache is None
    assert engine(model, prefix_cache_tokens=64).prefix_cache.capacity_blocks == 16
    with pytest.raises(ValueError, match="prefix_block_size"):
        engine(model, prefix_block_size=0)


def test_a_store_smaller_than_the_prompt_keeps_the_prompts_first_blocks(model):
    prompt = list(range(1, 20))  # four full blocks
    cache = prefilled(model, prompt)
    store = PrefixCache(cache, capacity_blocks=2, block_size=BLOCK, admit_after=1)
    other = prefilled(model, [40, 41, 42, 43, 44])
    store.store([40, 41, 42, 43, 44], other, 0)
    store.store(prompt, cache, 0)  # the first two blocks, evicting the other prompt's block
    assert len(store.slots) == 2
    assert store.restore(prompt, cache, 1) == 8
    for layer in range(model.config.num_layers):
        assert_close(cache.keys[layer][1, :, :8], cache.keys[layer][0, :, :8], atol=0, rtol=0)
    assert store.restore([40, 41, 42, 43, 44], other, 1) == 0


def test_restored_prefixes_with_chunked_prefill_and_rows_moving_under_them(model):
    """Prompts longer than the token budget after a restored prefix: chunks continue from the
    restored blocks, rows retire and move while others are still prefilling, and every answer
    is the one the engine gives without a prefix cache."""
    g = torch.Generator().manual_seed(9)
    system = torch.randint(1, 64, (21,), generator=g).tolist()
    ids = [system + torch.randint(1, 64, (int(n),), generator=g).tolist()
           for n in torch.randint(2, 30, (8,), generator=g)]
    budgets = [2, 12, 3, 9, 1, 12, 5, 7]

    def run(**config) -> list:
        e = engine(model, max_num_seqs=3, max_num_batched_tokens=16, **config)
        first = [e.generate([GenerationRequest(p, SamplingParams(max_tokens=b))])[0]
                 for p, b in zip(ids[:2], budgets[:2], strict=True)]
        return first + e.generate([GenerationRequest(p, SamplingParams(max_tokens=b))
                                   for p, b in zip(ids[2:], budgets[2:], strict=True)])

    cached, plain = run(), run(prefix_cache_tokens=0)
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
    assert all(c.cached_prompt_tokens == 20 for c in cached[2:])  # five blocks of 4 of the 21 shared
    assert sum(c.forwards for c in cached) < sum(c.forwards for c in plain)  # fewer prefill chunks


def test_a_block_is_stored_the_second_time_it_is_seen(model):
    """The doorkeeper: a prompt's own tail, seen once, never takes a slot from what prompts share."""
    shared = list(range(1, 9))  # two blocks
    first, second, third = [*shared, 20, 21, 22, 23, 24], [*shared, 30, 31, 32, 33, 34], [*shared, 40, 41]
    cache = prefilled(model, first)
    store = PrefixCache(cache, capacity_blocks=8, block_size=BLOCK)
    store.store(first, cache, 0)
    assert not store.slots and store.restore(first, cache, 1) == 0  # seen once: nothing stored
    other = prefilled(model, second)
    store.store(second, other, 0)  # the shared blocks a second time: stored; its own tail not
    assert len(store.slots) == 2
    assert store.restore(third, cache, 1) == 8
    for layer in range(model.config.num_layers):
        assert_close(cache.keys[layer][1, :, :8], other.keys[layer][0, :, :8], atol=0, rtol=0)
    store.store(first, cache, 0)  # the first prompt again: its third block is now seen twice
    assert len(store.slots) == 3 and store.restore(first, cache, 1) == 12


def test_a_failed_copy_gives_its_slots_back(model, monkeypatch):
    prompt = list(range(1, 17))  # four blocks
    cache = prefilled(model, prompt)
    store = PrefixCache(cache, capacity_blocks=4, block_size=BLOCK, admit_after=1)
    store.store(prompt, cache, 0)

    def broken(*args):
        raise MemoryError("no room")

    other = list(range(30, 46))
    with monkeypatch.context() as patch:
        patch.setattr(store, "_copy_out", broken)
        with pytest.raises(MemoryError):
            store.store(other, cache, 0)
    assert store.restore(other, cache, 1) == 0  # nothing findable from the failed store
    store.store(other, cache, 0)  # every slot still usable
    assert len(store.slots) == 4 and store.restore(other, cache, 1) == 12


def test_prefix_cache_sizes_are_checked(model):
    with pytest.raises(ValueError, match="prefix_cache_tokens must be 0"):
        engine(model, prefix_cache_tokens=BLOCK - 1)
    with pytest.raises(ValueError, match="admit_after"):
        PrefixCache(prefilled(model, [1, 2]), capacity_blocks=2, admit_after=0)
