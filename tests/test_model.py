"""The transformer: attention patterns, the KV cache in all its uses, and the cost model."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from nowait.model import KVCache, ModelConfig, Transformer, block_causal_mask
from nowait.model.transformer import fuse_projections

VOCAB = 64
ATOL = 1e-5

CONFIG_VARIANTS = {
    "gqa": {},  # 4 query heads over 2 kv heads
    "mha": {"num_kv_heads": 4},
    "mqa": {"num_kv_heads": 1},
    "qkv_bias": {"qkv_bias": True},
    "untied": {"tie_embeddings": False},
}


def random_ids(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=generator)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def right_pad(rows: list[torch.Tensor], pad: int = 0) -> torch.Tensor:
    padded = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return padded


# --- attention patterns ---


def test_causal_logits_ignore_later_tokens(make_model):
    model = make_model()
    generator = torch.Generator().manual_seed(1)
    ids = random_ids(generator, 2, 12)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert_close(before[:, :6], after[:, :6], atol=ATOL, rtol=0)
    assert max_diff(before[:, 6:], after[:, 6:]) > 1e-2


def test_bidirectional_logits_see_later_tokens(make_model):
    model = make_model(causal=False)
    generator = torch.Generator().manual_seed(1)
    ids = random_ids(generator, 2, 12)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(ids), model(changed)
    for position in range(6):
        assert max_diff(before[:, position], after[:, position]) > 1e-2, position


def test_bidirectional_padding_is_invisible(make_model):
    """valid_lengths without a cache: right padding must not change the real positions."""
    model = make_model(causal=False)
    generator = torch.Generator().manual_seed(2)
    short = random_ids(generator, 5)
    padded = torch.cat([short, random_ids(generator, 4)])[None]
    with torch.no_grad():
        alone = model(short[None])
        with_padding = model(padded, valid_lengths=torch.tensor([5]))
        padding_attended = model(padded)
    assert_close(with_padding[:, :5], alone, atol=ATOL, rtol=0)
    assert max_diff(padding_attended[:, :5], alone) > 1e-2


# --- KV cache: incremental AR decode ---


def check_incremental_decode(model: Transformer, prompt_lengths: list[int], steps: int, seed: int) -> None:
    """Prefill right-padded prompts, decode `steps` tokens one at a time, and compare every
    logit with the row's own unpadded full forward."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    prompts = [random_ids(generator, n) for n in prompt_lengths]
    continuation = random_ids(generator, batch, steps)
    lengths = torch.tensor(prompt_lengths)
    cache = KVCache(model.config, batch, max(prompt_lengths) + steps)
    with torch.no_grad():
        prefill = model(right_pad(prompts, pad=VOCAB - 1), cache, valid_lengths=lengths)
        assert cache.lengths.tolist() == prompt_lengths
        decoded = [prefill[torch.arange(batch), lengths - 1]]
        for step in range(steps):
            decoded.append(model(continuation[:, step: step + 1], cache)[:, 0])
        assert cache.lengths.tolist() == [n + steps for n in prompt_lengths]
        for row, n in enumerate(prompt_lengths):
            full = model(torch.cat([prompts[row], continuation[row]])[None])[0]
            assert_close(prefill[row, :n], full[:n], atol=ATOL, rtol=0)
            for step, logits in enumerate(decoded):
                assert_close(logits[row], full[n - 1 + step], atol=ATOL, rtol=0,
                             msg=lambda m, row=row, step=step: f"row {row} step {step}: {m}")


@pytest.mark.parametrize("variant", list(CONFIG_VARIANTS))
def test_incremental_decode_equals_full_forward(make_model, variant):
    check_incremental_decode(make_model(**CONFIG_VARIANTS[variant]), [9], steps=6, seed=3)


@pytest.mark.parametrize("variant", list(CONFIG_VARIANTS))
def test_incremental_decode_rows_of_different_lengths(make_model, variant):
    check_incremental_decode(make_model(**CONFIG_VARIANTS[variant]), [9, 3, 6], steps=5, seed=4)


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_ragged_decode_writes_and_reads_like_the_scatter_path(make_model, variant):
    """A decode step over rows of different lengths writes each new key with one flat copy
    (`RaggedDecode`); a cache whose tensors are not contiguous takes the scatter path. Both
    give the same logits and leave the same keys and values, slot for slot."""
    model = make_model(**CONFIG_VARIANTS[variant])
    generator = torch.Generator().manual_seed(11)
    prompts = [random_ids(generator, n) for n in (6, 2, 9, 4)]
    lengths = torch.tensor([len(p) for p in prompts])
    nxt = random_ids(generator, 4, 3)
    flat = KVCache(model.config, 4, 16)
    strided = KVCache(model.config, 4, 16)
    # Same shapes, storage laid out slot-major: every slice is a view, none contiguous.
    strided.keys = [k.transpose(0, 2).contiguous().transpose(0, 2) for k in strided.keys]
    strided.values = [v.transpose(0, 2).contiguous().transpose(0, 2) for v in strided.values]
    assert not strided.keys[0].is_contiguous()
    with torch.no_grad():
        for cache in (flat, strided):
            model(right_pad(prompts), cache, valid_lengths=lengths)
        for step in range(3):
            a = model(nxt[:, step: step + 1], flat)
            b = model(nxt[:, step: step + 1], strided)
            assert_close(a, b, atol=ATOL, rtol=0)
    assert flat.lengths.tolist() == strided.lengths.tolist() == (lengths + 3).tolist()
    for row, n in enumerate((lengths + 3).tolist()):
        for layer in range(model.config.num_layers):
            assert_close(flat.keys[layer][row, :, :n], strided.keys[layer][row, :, :n], atol=ATOL, rtol=0)
            assert_close(flat.values[layer][row, :, :n], strided.values[layer][row, :, :n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_reuses_intermediates_in_place_with_the_same_numbers(make_model, dtype):
    """Without gradients the norms, rotary and MLP write into their own fresh intermediates;
    the logits are those of the out-of-place form autograd uses, bit for bit."""
    model = make_model(num_kv_heads=2).to(dtype)
    ids = random_ids(torch.Generator().manual_seed(12), 2, 9)
    with torch.no_grad():
        inference = model(ids)
    training = model(ids)
    assert training.requires_grad
    assert torch.equal(inference, training.detach())
    training.float().sum().backward()  # and autograd still works through the training form
    assert model.layers[0].mlp.gate_up_proj.weight.grad is not None


@pytest.mark.parametrize("variant", ["gqa", "qkv_bias"])
def test_state_dict_is_the_checkpoint_layout_and_loads_into_the_fused_layers(make_model, variant):
    """The layers compute q/k/v and gate/up as one matmul each; the state dict is still one
    tensor per projection (Hugging Face's names and shapes), each the rows of its fused layer,
    and loading it (as it is, or fused first by `fuse_projections`) gives the same logits."""
    model = make_model(**CONFIG_VARIANTS[variant])
    c = model.config
    state = model.state_dict()
    attention, mlp = "layers.1.self_attn.", "layers.1.mlp."
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in state)
    assert state[attention + "q_proj.weight"].shape == (c.num_heads * c.head_dim, c.hidden_size)
    assert state[attention + "v_proj.weight"].shape == (c.num_kv_heads * c.head_dim, c.hidden_size)
    assert state[mlp + "up_proj.weight"].shape == (c.intermediate_size, c.hidden_size)
    assert (attention + "k_proj.bias" in state) == c.qkv_bias
    fused = model.layers[1].self_attn.qkv_proj.weight
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    assert torch.equal(state[attention + "k_proj.weight"], fused[q_rows: q_rows + kv_rows])
    assert torch.equal(state[mlp + "up_proj.weight"], model.layers[1].mlp.gate_up_proj.weight[c.intermediate_size:])

    ids = random_ids(torch.Generator().manual_seed(14), 2, 7)
    with torch.no_grad():
        expected = model(ids)
        loaded = make_model(seed=1, **CONFIG_VARIANTS[variant])
        assert not torch.equal(loaded(ids), expected)
        loaded.load_state_dict({name: tensor.clone() for name, tensor in state.items()})
        assert torch.equal(loaded(ids), expected)
        parts = {name: tensor.clone() for name, tensor in state.items()}
        fuse_projections(parts, c)
        assert attention + "q_proj.weight" not in parts and mlp + "gate_proj.weight" not in parts
        assert parts[attention + "qkv_proj.weight"].shape == (q_rows + 2 * kv_rows, c.hidden_size)
        other = make_model(seed=2, **CONFIG_VARIANTS[variant])
        other.load_state_dict(parts)
        assert torch.equal(other(ids), expected)


def test_rotary_table_grows_past_max_position(make_model):
    """The rotary table is built once for max_position positions and grown when a forward goes
    further (a cache may hold more slots than max_position); its rows are the RoPE formula."""
    model = make_model(max_position=8)
    ids = random_ids(torch.Generator().manual_seed(15), 1, 12)
    with torch.no_grad():
        model(ids)
        table = model.rope(1, torch.device("cpu"))
        assert table.shape[0] >= 12
        c = model.config
        angles = 10 * c.rope_theta ** (-torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        assert_close(table[10, 0], torch.cat([angles, angles]).cos())
        assert_close(table[10, 1], torch.cat([-angles.sin(), angles.sin()]))


def test_ragged_decode_with_a_padding_row_and_a_view_of_later_rows(make_model):
    """A decode step over a view of rows 1-3 of a cache, one of them padding (valid length 0):
    the real rows' logits equal their own full forwards, and the padding row's length stays."""
    model = make_model()
    generator = torch.Generator().manual_seed(13)
    prompts = [random_ids(generator, n) for n in (5, 3, 7)]
    nxt = random_ids(generator, 3, 1)
    cache = KVCache(model.config, 4, 12)
    view = cache.view(1, 3)
    with torch.no_grad():
        model(right_pad(prompts), view, valid_lengths=torch.tensor([5, 3, 7]))
        logits = model(nxt, view, valid_lengths=torch.tensor([1, 0, 1]))[:, 0]
        assert view.lengths.tolist() == [6, 3, 8]
        for row in (0, 2):
            full = model(torch.cat([prompts[row], nxt[row]])[None])[0, -1]
            assert_close(logits[row], full, atol=ATOL, rtol=0)
    assert int(cache.lengths[0]) == 0 and all(float(k[0].abs().max()) == 0 for k in cache.keys)  # row 0 untouched


def test_cache_select_keeps_rows(make_model):
    model = make_model()
    generator = torch.Generator().manual_seed(5)
    prompts = [random_ids(generator, n) for n in (4, 7, 5)]
    nxt = random_ids(generator, 3, 1)
    cache = KVCache(model.config, 3, 10)
    with torch.no_grad():
        model(right_pad(prompts), cache, valid_lengths=torch.tensor([4, 7, 5]))
        cache.select(torch.tensor([2, 0]))
        assert cache.batch == 2 and cache.lengths.tolist() == [5, 4]
        logits = model(nxt[[2, 0]], cache)[:, 0]
        for out_row, row in enumerate((2, 0)):
            full = model(torch.cat([prompts[row], nxt[row]])[None])[0, -1]
            assert_close(logits[out_row], full, atol=ATOL, rtol=0)


def test_truncate_rolls_back_rejected_tokens(make_model):
    """Speculative decoding: decode 3 drafted tokens, roll back, decode others == a fresh cache."""
    model = make_model()
    generator = torch.Generator().manual_seed(6)
    prompt = random_ids(generator, 2, 6)
    rejected = random_ids(generator, 2, 3)
    accepted = (rejected + 1) % VOCAB
    keep = torch.tensor([0, 1])  # row 0 rejects all three drafts, row 1 keeps the first
    with torch.no_grad():
        cache = KVCache(model.config, 2, 12)
        model(prompt, cache)
        for step in range(3):
            model(rejected[:, step: step + 1], cache)
        cache.truncate(6 + keep)
        assert cache.lengths.tolist() == [6, 7]
        rolled = torch.stack([model(accepted[:, step: step + 1], cache)[:, 0] for step in range(3)], 1)
        for row in range(2):
            fresh = KVCache(model.config, 1, 12)
            kept = rejected[row, : int(keep[row])]
            model(torch.cat([prompt[row], kept])[None], fresh)
            expected = torch.stack([model(accepted[row: row + 1, s: s + 1], fresh)[0, 0] for s in range(3)])
            assert_close(rolled[row], expected, atol=ATOL, rtol=0)


def test_truncate_never_lengthens(make_model):
    model = make_model()
    cache = KVCache(model.config, 2, 8)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), cache)
    cache.truncate(torch.tensor([5, 1]))
    assert cache.lengths.tolist() == [3, 1]


def test_cache_overflow_raises(make_model):
    model = make_model()
    cache = KVCache(model.config, 1, 8)
    with torch.no_grad():
        with pytest.raises(ValueError, match="KV cache"):
            model(torch.zeros(1, 9, dtype=torch.long), cache)
        model(torch.zeros(1, 8, dtype=torch.long), cache)  # exactly full is fine
        with pytest.raises(ValueError, match="KV cache"):
            model(torch.zeros(1, 1, dtype=torch.long), cache)


# --- KV cache: bidirectional forward over a cached prefix ---


@pytest.mark.parametrize("variant", ["gqa", "qkv_bias", "untied"])
def test_cached_prefix_equals_block_causal_forward(make_model, variant):
    model = make_model(causal=False, **CONFIG_VARIANTS[variant])
    generator = torch.Generator().manual_seed(7)
    batch, prefix, new = 2, 7, 5
    ids = random_ids(generator, batch, prefix + new)
    cache = KVCache(model.config, batch, prefix)
    with torch.no_grad():
        model(ids[:, :prefix], cache)
        keys_before = [k.clone() for k in cache.keys]
        cached = model(ids[:, prefix:], cache, write_cache=False)
        mask = block_causal_mask(prefix, prefix + new)[None].expand(batch, -1, -1)
        block_causal = model(ids, attention_mask=mask)
        bidirectional = model(ids)
    assert cache.lengths.tolist() == [prefix] * batch
    for before, after in zip(keys_before, cache.keys, strict=True):
        assert torch.equal(before, after)
    assert_close(cached, block_causal[:, prefix:], atol=ATOL, rtol=0)
    # The prompt cache is an approximation of full bidirectional attention, not equal to it.
    assert max_diff(cached, bidirectional[:, prefix:]) > 1e-2


@pytest.mark.parametrize("variant", list(CONFIG_VARIANTS))
def test_isolated_prefix_forward_equals_prefill_then_window(make_model, variant):
    """A diffusion request's first forward: the prompt attending only to itself and the window
    attending to everything, in one forward, computes what a prefill of the prompt and then a
    written forward of the window over it compute: the window's logits and every cached slot."""
    model = make_model(causal=False, **CONFIG_VARIANTS[variant])
    generator = torch.Generator().manual_seed(17)
    prompt, window = 7, 6
    ids = random_ids(generator, 1, prompt + window)
    two, one = KVCache(model.config, 1, 16), KVCache(model.config, 1, 16)
    positions = torch.arange(prompt + window)[None]
    with torch.no_grad():
        model(ids[:, :prompt], two)
        separate = model(ids[:, prompt:], two, positions=positions[:, prompt:])
        merged = model(ids, one, positions=positions, isolated_prefix=prompt)
        bidirectional = model(ids)
    assert one.lengths.tolist() == two.lengths.tolist() == [prompt + window]
    assert_close(merged[:, prompt:], separate, atol=ATOL, rtol=0)
    for merged_keys, separate_keys in zip(one.keys + one.values, two.keys + two.values, strict=True):
        assert_close(merged_keys, separate_keys, atol=ATOL, rtol=0)
    assert max_diff(merged[:, prompt:], bidirectional[:, prompt:]) > 1e-2  # not plain full attention


def test_isolated_prefix_refuses_what_it_cannot_compute(make_model):
    ids = torch.zeros(2, 5, dtype=torch.long)
    bidirectional, causal = make_model(causal=False), make_model()
    with pytest.raises(ValueError, match="isolated_prefix"):  # two rows: padding would need a mask
        bidirectional(ids, KVCache(bidirectional.config, 2, 8), isolated_prefix=2)
    with pytest.raises(ValueError, match="isolated_prefix"):
        causal(ids[:1], KVCache(causal.config, 1, 8), isolated_prefix=2)
    with pytest.raises(ValueError, match="isolated_prefix"):  # the whole span: nothing after the prefix
        bidirectional(ids[:1], KVCache(bidirectional.config, 1, 8), isolated_prefix=5)


def test_cached_prefix_rows_of_different_lengths(make_model):
    model = make_model(causal=False)
    generator = torch.Generator().manual_seed(8)
    prefix_lengths, new = [7, 3], 4
    prefixes = [random_ids(generator, n) for n in prefix_lengths]
    new_ids = random_ids(generator, 2, new)
    cache = KVCache(model.config, 2, max(prefix_lengths))
    with torch.no_grad():
        model(right_pad(prefixes, pad=5), cache, valid_lengths=torch.tensor(prefix_lengths))
        cached = model(new_ids, cache, write_cache=False)
        for row, n in enumerate(prefix_lengths):
            ids = torch.cat([prefixes[row], new_ids[row]])[None]
            expected = model(ids, attention_mask=block_causal_mask(n, n + new)[None])[0, n:]
            assert_close(cached[row], expected, atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == prefix_lengths


def test_causal_read_only_cache_equals_full_forward(make_model):
    """write_cache=False on a causal model (verifying drafts) is exact against the full forward."""
    model = make_model()
    generator = torch.Generator().manual_seed(9)
    ids = random_ids(generator, 2, 10)
    cache = KVCache(model.config, 2, 6)
    with torch.no_grad():
        model(ids[:, :6], cache)
        cached = model(ids[:, 6:], cache, write_cache=False)
        full = model(ids)
    assert_close(cached, full[:, 6:], atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [6, 6]


def test_block_causal_mask_pattern():
    mask = block_causal_mask(3, 5)
    assert mask.shape == (5, 5) and mask.dtype == torch.bool
    assert not mask[:3, 3:].any()
    assert mask[:3, :3].all() and mask[3:].all()


# --- cost model ---


COST_CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
                   num_kv_heads=4)


def test_flops_linear_in_new_tokens_at_fixed_context():
    config = ModelConfig(**COST_CONFIG)
    context = 64
    one = config.forward_cost(1, cached_tokens=context - 1).flops
    for new in (2, 4, 8, 16, 32):
        assert config.forward_cost(new, cached_tokens=context - new).flops == pytest.approx(new * one, rel=1e-12)
    # Attention makes each new token cost more the longer the context it reads.
    assert config.forward_cost(1, cached_tokens=512).flops > config.forward_cost(1, cached_tokens=0).flops
    # Batch rows are independent sequences.
    assert config.forward_cost(4, 20, batch=3).flops == pytest.approx(3 * config.forward_cost(4, 20).flops)


def test_intensity_grows_with_tokens_per_forward():
    config = ModelConfig(**COST_CONFIG)
    decode = config.forward_cost(1, cached_tokens=128)
    parallel = config.forward_cost(32, cached_tokens=128)
    assert decode.intensity < 2  # memory-bound: about one FLOP per byte of weights
    assert parallel.intensity > 10 * decode.intensity
    assert parallel.bytes < 2 * decode.bytes  # the weights, read once, dominate both


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": False}, {"qkv_bias": True},
                                       {"tie_embeddings": False, "qkv_bias": True, "num_kv_heads": 1},
                                       {"head_dim": 12}])
def test_parameter_count_matches_module(overrides):
    config = ModelConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                   num_kv_heads=2), **overrides})
    model = Transformer(config)
    actual = sum(p.numel() for p in model.parameters())
    assert config.parameter_count() == actual
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
    assert config.parameter_count(include_embeddings=False) == actual - embeddings
