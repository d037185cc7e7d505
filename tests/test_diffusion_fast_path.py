"""The diffusion engine's fast paths give what the general code gives: the greedy threshold
decision, the best-position rule, one-tensor cache surgery, cache memory kept between requests,
and the one-query check of a slot's commits."""

from __future__ import annotations

import itertools

import pytest
import torch

from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.diffusion import cache as cache_ops
from nowait.engines.diffusion import policies
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.diffusion.row import RowState
from nowait.engines.structured.byte_dfa import compile_language
from nowait.engines.structured.languages import parse_regex
from nowait.engines.structured.token_automaton import SlotAutomaton
from nowait.extraction.corpus import KINDS, schema_for
from nowait.model import KVCache

from .conftest import build_model


@pytest.fixture(scope="module")
def model(codec):
    return build_model(vocab_size=codec.vocab_size, causal=False, logits_shift=True, mask_token_id=codec.mask_id)


def _rows(engine: DiffusionEngine, codec, tau: float) -> tuple[RowState, RowState]:
    plan = engine.plan(GenerationRequest(codec.encode("Extract the fields."), SamplingParams(max_tokens=24),
                                         options={"tau": tau, "block": 8}))
    fast, general = (RowState(plan, 0, True, codec.mask_id, torch.device("cpu")) for _ in range(2))
    assert fast._greedy_threshold
    general._greedy_threshold = False
    return fast, general


@pytest.mark.parametrize("tau", [0.02, 0.3, 0.999])
def test_greedy_threshold_fast_path_commits_as_the_general_rule(model, codec, tau):
    engine = DiffusionEngine(model, codec)
    fast, general = _rows(engine, codec, tau)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    for _ in range(8):  # each step's logits cover its open range: from the first masked position on
        first = int(fast._masked(0, 8).nonzero()[0])
        logits = torch.randn(8 - first, vocab, generator=generator) * 3
        logits[:, 5] = logits[:, 6]  # ties: the first of equal scores is the best in both
        committed_fast = fast.decide(logits.clone(), first)
        committed_general = general.decide(logits.clone(), first)
        assert committed_fast.tolist() == committed_general.tolist()
        assert torch.equal(fast.tokens, general.tokens)
        assert torch.equal(fast.confidence.nan_to_num(-1), general.confidence.nan_to_num(-1))
        if not bool(fast._masked(0, 8).any()):
            break
    assert len(committed_fast) or tau > 0.5  # a low tau commits something at every step


def test_with_best_adds_the_best_masked_position_as_defined():
    generator = torch.Generator().manual_seed(2)
    for _ in range(50):
        score = torch.randint(0, 4, (3, 7), generator=generator).float() / 4  # many ties
        still = torch.rand(3, 7, generator=generator) < 0.5
        still[0] = False  # a row with nothing masked commits nothing
        chosen = still & (score >= 0.5)
        best = score.masked_fill(~still, float("-inf")).argmax(-1, keepdim=True)
        expected = chosen | (torch.zeros_like(chosen).scatter(-1, best, True) & still.any(-1, keepdim=True))
        assert torch.equal(policies._with_best(chosen, score, still), expected)


def _filled(model, batch: int, slots: int) -> tuple[cache_ops.SlotCache, KVCache]:
    slot_cache = cache_ops.empty_cache(model, batch, slots)
    slot_cache.storage.copy_(torch.randn(slot_cache.storage.shape))
    plain = KVCache(model.config, batch, slots)
    for layer in range(model.config.num_layers):
        plain.keys[layer].copy_(slot_cache.keys[layer])
        plain.values[layer].copy_(slot_cache.values[layer])
    slot_cache.lengths = torch.tensor([slots - 3, slots - 1, slots][:batch])
    plain.lengths = slot_cache.lengths.clone()
    return slot_cache, plain


def _same(a: KVCache, b: KVCache) -> bool:
    return torch.equal(a.lengths, b.lengths) and all(
        torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))


def test_slot_cache_surgery_equals_the_per_layer_copies(model):
    slot_cache, plain = _filled(model, 3, 20)
    assert slot_cache.keys[0].data_ptr() == slot_cache.storage.data_ptr()  # the layers are views of one tensor
    for runs in ([(0, 4), (12, 15), (6, 9)], [(0, 5), (9, 14)], [(3, 8)], [(0, 6)]):
        cache_ops.keep_slot_runs(slot_cache, 1, runs)
        cache_ops.keep_slot_runs(plain, 1, runs)
        assert _same(slot_cache, plain)
    # take_rows/put_rows/stack_caches on a SlotCache keep every layer as the per-layer code does
    part = cache_ops.take_rows(model, slot_cache, [2, 0], 18, 20)
    reference = KVCache(model.config, 2, 20)
    for layer in range(model.config.num_layers):
        reference.keys[layer][:, :, :18] = plain.keys[layer][[2, 0], :, :18]
        reference.values[layer][:, :, :18] = plain.values[layer][[2, 0], :, :18]
    reference.lengths = plain.lengths[[2, 0]]
    assert _same(part, reference)
    part.storage.mul_(2)
    cache_ops.put_rows(slot_cache, [2, 0], part, 18)
    for layer in range(model.config.num_layers):
        for store in (plain.keys[layer], plain.values[layer]):
            store[[2, 0], :, :18] *= 2
    assert _same(slot_cache, plain)
    stacked = cache_ops.stack_caches(model, slot_cache, part, 20)
    assert torch.equal(stacked.storage[:, :, 3:], part.storage) and stacked.batch == 5
    view = slot_cache.view(1, 1)
    assert torch.equal(view.keys[-1], slot_cache.keys[-1][1:2]) and view.keys[-1].is_contiguous()
    slot_cache.select(torch.tensor([2, 1]))
    assert torch.equal(slot_cache.values[-1][0], plain.values[-1][2]) and slot_cache.batch == 2


def test_engine_keeps_its_cache_memory_and_the_same_output(model, codec):
    engine = DiffusionEngine(model, codec)
    requests = [GenerationRequest(codec.encode(text), SamplingParams(max_tokens=40), options={"tau": 0.6, "block": 8})
                for text in ("Name: Ada Obi", "Extract the fields of this letter, please.", "ID 42")]
    first = [engine.generate([r])[0] for r in requests]
    kept = engine.storage._free
    assert kept is not None
    again = [engine.generate([r])[0] for r in requests]  # each reuses the memory the one before left
    assert engine.storage._free is kept  # slots rounded up: prompts of these lengths share one shape
    fresh = [DiffusionEngine(model, codec).generate([r])[0] for r in requests]
    batched = engine.generate(requests)
    for a, b, c, d in zip(first, again, fresh, batched, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
        assert a.token_confidences == b.token_confidences == c.token_confidences
        assert a.forwards == b.forwards == c.forwards  # (a batch prefills its prompts in a forward of their own)


def test_a_slot_checked_in_one_query_keeps_what_one_by_one_keeps(model, codec, monkeypatch):
    engine = DiffusionEngine(model, codec)
    prompt = codec.encode("Extract the fields as JSON.")
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=512, temperature=t, seed=s),
                                  schema=schema_for(kind), options={"tau": tau})
                for kind in KINDS for t, s, tau in ((0.0, 0, 0.05), (1.0, 3, 0.2))]
    shortcut = engine.generate(requests)
    calls = []

    def never(*args):
        calls.append(args)
        return False

    monkeypatch.setattr(RowState, "_all_legal", staticmethod(never))
    one_by_one = engine.generate(requests)
    assert calls  # the shortcut was asked (several commits in one slot)
    for a, b in zip(shortcut, one_by_one, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text


def test_all_legal_says_exactly_when_one_by_one_keeps_every_pick():
    """On a toy vocabulary: the one query agrees with checking the picks one after another
    (each legal after those before it), including picks that are legal alone but not together."""
    end, width = 0, 4
    vocabulary = [None, None, b"1", b"2", b"-", b"12", b"0", b"-1", b"x"]
    automaton = SlotAutomaton(compile_language(parse_regex(r"-?(0|[1-9][0-9]*)")), vocabulary, end, width)
    tokens = [0, 2, 3, 4, 5, 6, 7]
    disagreements = conflicts = 0
    for assigned in itertools.product([None, None, end, 4, 5], repeat=width):
        free = [i for i, t in enumerate(assigned) if t is None]
        for offsets in itertools.combinations(free, 2):
            legal = automaton.allowed(list(assigned), offsets)
            for picked in itertools.product(tokens, repeat=2):
                picks = list(zip(offsets, picked, strict=True))
                if not all(legal[o][t] for o, t in picks):
                    continue  # a pick is always legal alone (the template mask chose it)
                state, kept = list(assigned), True
                for rank, (offset, token) in enumerate(picks):
                    if rank and not automaton.allowed(state, [offset])[offset][token]:
                        kept = False
                        break
                    state[offset] = token
                conflicts += not kept
                disagreements += RowState._all_legal(automaton, list(assigned), picks) != kept
    assert conflicts and not disagreements


def test_settled_facts_read_the_block_and_the_early_stop_at_once():
    from nowait.engines.diffusion.row import settled_facts

    t, f = True, False
    masked = torch.tensor([f, f, t, t, f, f])
    ends = torch.tensor([f, f, f, f, t, t])
    assert settled_facts(masked, 0, 2, ends) == (False, False)  # block done; masked before the first end
    assert settled_facts(masked, 2, 4, ends) == (True, False)
    assert settled_facts(masked, 2, 4, None) == (True, False)  # templates: no early stop
    early = torch.tensor([f, t, f, f, f, f])  # an end at 1: only position 0 counts, and it is set
    assert settled_facts(masked, 2, 4, early) == (True, True)
    assert settled_facts(masked, 0, 2, torch.zeros(6, dtype=torch.bool)) == (False, False)  # no end at all
    assert settled_facts(torch.zeros(6, dtype=torch.bool), 0, 6, ends) == (False, True)
