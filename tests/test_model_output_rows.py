"""`output_positions` leaves the last layer's unread positions out (their queries, attention,
output projection and MLP): the logits at the asked positions and every key and value stored
equal the full forward's, under each attention pattern, and the AR and diffusion engines give
the same tokens, confidences and logprobs as with the full forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.diffusion.request import DiffusionOptions
from nowait.model import KVCache

from .conftest import build_model

END = 0  # the tiny models' end token
ATOL = 1e-5  # a smaller matmul may round differently; a wrong pattern moves logits by O(0.1)


def full_forward(model):
    """A copy of `model` that computes every position and gathers the asked ones afterwards
    (what the forward did before it left rows out)."""
    twin = copy.deepcopy(model)
    forward = twin.forward

    def every_position(*args, output_positions=None, **kwargs):
        logits = forward(*args, **kwargs)
        if output_positions is None:
            return logits
        return logits.gather(1, output_positions[..., None].expand(-1, -1, logits.shape[-1]))

    twin.forward = every_position
    return twin


def assert_same_forward(model, ids, picked, cache_of=None, prefill=None, **kwargs):
    """The forward with `output_positions=picked` against the full one gathered there: logits
    within ATOL, the caches (every position's keys and values) and their lengths bit-identical."""
    caches = []
    for _ in range(2):
        cache = cache_of() if cache_of else None
        if prefill is not None:
            model(prefill, cache)
        caches.append(cache)
    full = model(ids, caches[0], **kwargs)
    part = model(ids, caches[1], output_positions=picked, **kwargs)
    want = full.gather(1, picked[..., None].expand(-1, -1, full.shape[-1]))
    assert part.shape == want.shape
    torch.testing.assert_close(part, want, atol=ATOL, rtol=0)
    if cache_of:
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values, strict=True):
            assert torch.equal(a, b)


@torch.no_grad()
def test_causal_patterns_give_the_full_forwards_logits_at_the_asked_positions():
    model = build_model(0, num_layers=3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (1, 30), generator=g)
    for picked in ([[29]], [[4, 29, 0]], [[12]]):  # the last one (no mask needed), and others
        assert_same_forward(model, ids, torch.tensor(picked))  # no cache: causal
        assert_same_forward(model, ids, torch.tensor(picked), lambda: KVCache(model.config, 1, 64))  # slice write
    cache_of = lambda: KVCache(model.config, 3, 64)  # noqa: E731
    batch, valid = torch.randint(0, 64, (3, 20), generator=g), torch.tensor([20, 7, 13])
    assert_same_forward(model, batch, (valid - 1)[:, None], cache_of, valid_lengths=valid)  # padded prefill
    assert_same_forward(model, batch, torch.tensor([[0, 19], [6, 2], [12, 12]]), cache_of, valid_lengths=valid)
    # A chunk continuing a cache (chunked prefill, a restored prefix), one row and padded rows.
    one = lambda: KVCache(model.config, 1, 64)  # noqa: E731
    assert_same_forward(model, ids[:, 10:], torch.tensor([[19]]), one, prefill=ids[:, :10])
    assert_same_forward(model, ids[:, 10:], torch.tensor([[19]]), one, prefill=ids[:, :10],
                        valid_lengths=torch.tensor([20]))
    assert_same_forward(model, batch[:, 10:], torch.tensor([[9], [0], [2]]), cache_of, prefill=batch[:, :10],
                        valid_lengths=torch.tensor([10, 1, 3]))


@torch.no_grad()
def test_bidirectional_patterns_give_the_full_forwards_logits_at_the_asked_positions():
    model = build_model(1, num_layers=3, causal=False)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (1, 40), generator=g)
    one = lambda: KVCache(model.config, 1, 96)  # noqa: E731
    window = torch.arange(30, 40)[None]
    assert_same_forward(model, ids, window)  # no cache
    assert_same_forward(model, ids, window, one, isolated_prefix=30)  # a request's first forward
    assert_same_forward(model, ids, torch.tensor([[3, 31, 29]]), one, isolated_prefix=30)  # prompt rows too
    assert_same_forward(model, ids[:, 30:], torch.tensor([[2, 5]]), one, prefill=ids[:, :30])  # a written step
    assert_same_forward(model, ids[:, 30:], torch.tensor([[2, 5]]), one, prefill=ids[:, :30], write_cache=False)
    rows = lambda: KVCache(model.config, 2, 96)  # noqa: E731
    spans, valid = torch.randint(0, 64, (2, 8), generator=g), torch.tensor([8, 5])
    for write in (True, False):
        assert_same_forward(model, spans, torch.tensor([[1, 7], [0, 4]]), rows, prefill=torch.randint(0, 64, (2, 12)),
                            valid_lengths=valid, write_cache=write)
    # No position asked (a prefill that only fills the cache): no logits, the same keys stored.
    assert_same_forward(model, ids, torch.zeros(1, 0, dtype=torch.long), one)


@torch.no_grad()
def test_the_last_layer_runs_only_the_asked_rows(monkeypatch):
    """Every layer projects keys and values for all 30 positions; the last one's output
    projection and MLP see the 2 asked rows only (so the saving is real, not a gather after)."""
    model = build_model(0, num_layers=3)
    down = {id(layer.mlp.down_proj.weight): i for i, layer in enumerate(model.layers)}
    qkv = {id(layer.self_attn.qkv_proj.weight): i for i, layer in enumerate(model.layers)}
    rows: dict[tuple[str, int], int] = {}
    linear = F.linear

    def counted(x, weight, bias=None):
        for kind, table in (("down", down), ("qkv", qkv)):
            if id(weight) in table:
                rows[kind, table[id(weight)]] = x.shape[0]
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", counted)
    model(torch.randint(0, 64, (1, 30)), KVCache(model.config, 1, 64), output_positions=torch.tensor([[29, 3]]))
    assert rows == {("qkv", 0): 30, ("qkv", 1): 30, ("qkv", 2): 30, ("down", 0): 30, ("down", 1): 30, ("down", 2): 2}


@pytest.mark.parametrize("caps", [{}, {"max_num_batched_tokens": 16}, {"prefix_cache_tokens": 256}])
def test_ar_engine_tokens_and_logprobs_equal_the_full_forwards(caps):
    """Greedy tokens identical and logprobs within tolerance, with whole-prompt prefill,
    chunked prefill and the prefix cache (prompts sharing a prefix)."""
    model = build_model(2)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 64, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 11, 25, 6)]
    config = EngineConfig(max_num_seqs=4, **caps)
    answers = []
    for m in (model, full_forward(model)):
        engine = AutoregressiveEngine(m, end_id=END, config=config)
        requests = [GenerationRequest(p, SamplingParams(max_tokens=12, logprobs=2)) for p in prompts]
        answers.append(engine.generate(requests[:1]) + engine.generate(requests[1:]))
    for new, old in zip(*answers, strict=True):
        assert new.token_ids == old.token_ids and len(new.token_ids) > 0
        assert new.token_confidences == pytest.approx(old.token_confidences, abs=1e-5)
        for a, b in zip(new.logprobs, old.logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)


@pytest.mark.parametrize("cache", ["none", "prompt", "prefix", "dual"])
def test_diffusion_engine_outputs_equal_the_full_forwards(codec, cache):
    model = build_model(3, vocab_size=codec.vocab_size, causal=False, logits_shift=True, mask_token_id=codec.mask_id)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (9, 23, 14)]
    options = DiffusionOptions(block=4, cache=cache, tau=0.5)
    answers = []
    for m in (model, full_forward(model)):
        requests = [GenerationRequest(p, SamplingParams(max_tokens=12)) for p in prompts]
        engine = DiffusionEngine(m, codec, options)
        answers.append(engine.generate(requests[:1]) + engine.generate(requests[1:]))  # alone, then batched
    for new, old in zip(*answers, strict=True):
        assert new.token_ids == old.token_ids and new.forwards == old.forwards
        assert new.token_confidences == pytest.approx(old.token_confidences, abs=1e-5)
