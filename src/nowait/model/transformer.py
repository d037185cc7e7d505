"""The transformer's layers and forward: RMSNorm, rotary embeddings, attention, SwiGLU.

The forward places new tokens after each row's cached prefix and plans the attention
(`nowait.model.attention`) once for every layer. A small model's decode step is per-operation
overhead, not arithmetic, so each layer runs few operations: q/k/v and gate/up are one matmul
each (fused at load time; the state dict keeps the checkpoint's layout), q and k are rotated
in one pass from a table built once, the norms are one call each, and the weights are called
directly rather than through a module per projection.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nowait.model.attention import (
    CAUSAL_FROM_START,
    AttentionPattern,
    AttentionPlan,
    IsolatedPrefix,
    attend,
    key_padding_mask,
    plan_attention,
    ragged_decode_layout,
    select_queries,
)
from nowait.model.config import ModelConfig
from nowait.model.kv_cache import KVCache

# Inference (no gradients) reuses each fresh intermediate in place: the same operations on the
# same numbers, bit for bit, without allocating and writing another tensor. At prefill sizes
# ([4096 tokens, 512]) the MLP alone ran a quarter faster; a 64-prompt prefill 11% faster.
# Training keeps the out-of-place form that autograd needs.


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Computed in fp32: the reduction over the hidden size loses precision in 16-bit.
    # F.rms_norm is that formula (x in fp32 * rsqrt(mean(x^2) + eps), back to x's dtype, times
    # the weight), bit for bit, as one call instead of six from Python.
    if weight.dtype == x.dtype:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()  # a weight of another dtype promotes the result
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                        device: torch.device | str = "cpu") -> Tensor:
    """RoPE's per-pair frequencies theta^(-2i/d), [head_dim / 2].

    Llama 3.1 ("llama3" scaling) stretches the long wavelengths by `factor` so a model
    pretrained on `original_max_position_embeddings` positions reads longer contexts; short
    wavelengths are kept, and the band between is interpolated smoothly.
    """
    frequency = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if not scaling:
        return frequency
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / frequency
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * frequency / factor + smooth * frequency
    return torch.where(wavelength > original / low, frequency / factor,
                       torch.where(wavelength < original / high, frequency, blended))


def rotary_table(positions: int, head_dim: int, theta: float, scaling: dict | None = None,
                 device: torch.device | str = "cpu") -> Tensor:
    """RoFormer's rotary embedding at positions [0, positions): [positions, 2, head_dim], cos then
    the signed sin (-sin on the first half, sin on the second; see `apply_rotary`), in fp32.
    Built once and indexed by position: the same numbers as computing them per forward."""
    angles = torch.arange(positions, device=device).float()[:, None] * inverse_frequencies(head_dim, theta, scaling,
                                                                                           device)
    sin = angles.sin()
    return torch.stack([torch.cat([angles, angles], dim=-1).cos(), torch.cat([-sin, sin], dim=-1)], dim=1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (the Llama/Hugging Face layout, not interleaved):
    x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]. Written as
    [x2, x1] * [-sin, sin] (the sign moved onto the table, exactly the same products), the
    swap is one flip and the whole rotation four operations. `cos` and `sin` [.., T, 1, D] (the
    two halves of `rotary_table` rows) broadcast over x's heads: x [B, T, heads, D]."""
    x32 = x.float()
    swapped = x32.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    if torch.is_grad_enabled():
        return (x32 * cos + swapped * sin).to(x.dtype)
    return (x32 * cos).add_(swapped.mul_(sin)).to(x.dtype)  # swapped is a fresh copy: in place


ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
MLP_PARTS = ("gate_proj", "up_proj")


def _fuse_parts(state: dict[str, Tensor], prefix: str, fused: str, parts: tuple[str, ...]) -> None:
    for kind in ("weight", "bias"):
        names = [f"{prefix}{name}.{kind}" for name in parts]
        if all(name in state for name in names):
            state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(name) for name in names])


def _fused_state_dict(fused: str, parts: dict[str, int]):
    """State-dict hooks for a module computing `parts` (name -> output rows) as one linear layer
    `fused`: its state dict keeps the checkpoint's layout, one tensor per part (views of the
    fused one), and loading one concatenates the parts, so every checkpoint reader, file and
    trained model loads unchanged while a forward runs one matmul where there were several."""
    sizes = list(parts.values())

    def split(_module: nn.Module, state: dict, prefix: str, _metadata: dict) -> None:
        for kind in ("weight", "bias"):
            tensor = state.pop(f"{prefix}{fused}.{kind}", None)
            if tensor is not None:
                for name, piece in zip(parts, tensor.split(sizes), strict=True):
                    state[f"{prefix}{name}.{kind}"] = piece

    def fuse(_module: nn.Module, state: dict, prefix: str, *_args) -> None:
        _fuse_parts(state, prefix, fused, tuple(parts))

    return split, fuse


def fuse_projections(state: dict[str, Tensor], config: ModelConfig) -> None:
    """Concatenate a checkpoint-layout state dict's q/k/v and gate/up tensors into the fused
    ones, in place, one layer at a time, each part dropped as it is used. `load_state_dict`
    fuses too, but from its own copy of the dict, which holds every part until it ends: a
    loader calls this first so a large checkpoint's weights are never in memory twice."""
    for layer in range(config.num_layers):
        _fuse_parts(state, f"layers.{layer}.self_attn.", "qkv_proj", ATTENTION_PARTS)
        _fuse_parts(state, f"layers.{layer}.mlp.", "gate_up_proj", MLP_PARTS)


class FusedLinear(nn.Linear):
    """Linear layers over the same input as one: their outputs side by side, `parts[i]` rows
    each (one matmul, one read of the input, where there were several)."""

    def __init__(self, in_features: int, parts: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(parts), bias=bias)
        self.parts = list(parts)


class Attention(nn.Module):
    """q, k and v as one linear layer `qkv_proj` (its state dict: q_proj, k_proj, v_proj)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        sizes = [config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd]
        self.qkv_proj = FusedLinear(config.hidden_size, sizes, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)
        split, fuse = _fused_state_dict("qkv_proj", dict(zip(ATTENTION_PARTS, sizes, strict=True)))
        self.register_state_dict_post_hook(split)
        self.register_load_state_dict_pre_hook(fuse)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up as one linear layer
    `gate_up_proj` (its state dict: gate_proj, up_proj)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        split, fuse = _fused_state_dict("gate_up_proj", dict.fromkeys(MLP_PARTS, config.intermediate_size))
        self.register_state_dict_post_hook(split)
        self.register_load_state_dict_pre_hook(fuse)


class Block(nn.Module):
    """One layer, its forward written out with the weights called directly (no module call per
    projection): the fewest operations and the least Python per layer, as every forward,
    training included, runs it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps = config.rms_norm_eps

    def forward(self, x: Tensor, batch: int, length: int, cos: Tensor, sin: Tensor, plan: AttentionPlan,
                keys: Tensor | None, values: Tensor | None, picked: Tensor | None = None) -> Tensor:
        """x [B * T, hidden] (2-D: a matmul on it is one operation, on [B, T, hidden] three).

        `picked` [B, K] (with `plan` from `select_queries`): only those positions' outputs,
        [B * K, hidden]; every position's keys and values are still computed and stored."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        attn, mlp = self.self_attn, self.mlp
        qkv = F.linear(rms_norm(x, self.input_layernorm.weight, self.eps), attn.qkv_proj.weight, attn.qkv_proj.bias)
        qkv = qkv.view(batch, length, heads + 2 * kv_heads, dim)
        qk = apply_rotary(qkv[:, :, : heads + kv_heads], cos, sin)  # q and k rotated in one pass
        q = qk[:, :, :heads]
        if picked is not None:
            # Position-wise from here on (the queries, the output projection, the residual, the
            # MLP): the rows nobody reads are left out, the others get the same numbers.
            q = q.gather(1, picked[:, :, None, None].expand(-1, -1, heads, dim))
            x = x.view(batch, length, -1).gather(1, picked[..., None].expand(-1, -1, x.shape[-1])).flatten(0, 1)
            length = picked.shape[1]
        out = attend(plan, q, qk[:, :, heads:], qkv[:, :, heads + kv_heads:], keys, values)
        out = F.linear(out.reshape(batch * length, heads * dim), attn.o_proj.weight)
        inference = not torch.is_grad_enabled()
        # Without gradients the fresh intermediates are reused in place: the same operations on
        # the same numbers, bit for bit, without allocating and writing another tensor.
        x = out.add_(x) if inference else x + out
        gate, up = F.linear(rms_norm(x, self.post_attention_layernorm.weight, self.eps),
                            mlp.gate_up_proj.weight).split(mlp.intermediate, dim=-1)
        hidden = F.silu(gate, inplace=True).mul_(up) if inference else F.silu(gate) * up
        out = F.linear(hidden, mlp.down_proj.weight)
        return out.add_(x) if inference else x + out


def rotated_qkv(layer: Block, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The first half of `Block.forward` up to attention, for rows x [N, hidden] each at its own
    position (`cos`, `sin` [N, 1, D], halves of `rotary_table` rows): the queries and keys,
    rotated, [N, heads + kv_heads, D], and the values [N, kv_heads, D]; for the steps written
    for the compiler and for CUDA Graphs."""
    heads, kv_heads = layer.heads, layer.kv_heads
    attn = layer.self_attn
    qkv = F.linear(rms_norm(x, layer.input_layernorm.weight, layer.eps), attn.qkv_proj.weight, attn.qkv_proj.bias)
    qkv = qkv.view(x.shape[0], heads + 2 * kv_heads, layer.head_dim)
    return apply_rotary(qkv[:, : heads + kv_heads], cos, sin), qkv[:, heads + kv_heads:]


def mlp_residual(layer: Block, x: Tensor) -> Tensor:
    """x plus the layer's SwiGLU of its post-attention norm: the second half of `Block.forward`,
    out of place, for the steps written for the compiler and for CUDA Graphs."""
    mlp = layer.mlp
    gate, up = F.linear(rms_norm(x, layer.post_attention_layernorm.weight, layer.eps),
                        mlp.gate_up_proj.weight).split(mlp.intermediate, dim=-1)
    return x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)


class Transformer(nn.Module):
    """Parameter names follow Hugging Face Llama (`model.layers.0.self_attn.q_proj.weight`)
    minus the `model.` prefix, so checkpoints map by a prefix alone: the state dict reads and
    writes that layout, while the modules hold q/k/v and gate/up fused (`Attention`, `MLP`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        self._rope: Tensor | None = None  # `rotary_table`, built on first use on the weights' device

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            # A fused layer is drawn part by part, in the order of the separate layers it
            # replaces: a seed gives the same random weights as before the fusion.
            for piece in module.weight.data.split(getattr(module, "parts", [module.out_features])):
                nn.init.normal_(piece, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def output_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, positions: int, device: torch.device) -> Tensor:
        """The rotary table for at least `positions` positions (grown by doubling when short)."""
        table = self._rope
        if table is None or table.device != device or table.shape[0] < positions:
            c = self.config
            rows = max(positions, c.max_position, 2 * table.shape[0] if table is not None else 0)
            table = self._rope = rotary_table(rows, c.head_dim, c.rope_theta, c.rope_scaling, device)
        return table

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, valid_lengths: Tensor | None = None,
                write_cache: bool = True, attention_mask: Tensor | None = None,
                positions: Tensor | None = None, output_positions: Tensor | None = None,
                isolated_prefix: int = 0, positions_end: int | None = None) -> Tensor:
        """Logits [B, T, vocab] for `input_ids` [B, T].

        Without a cache: a plain forward, causal or bidirectional per the config; an optional
        boolean `attention_mask` [B, T, T] (True = may attend) replaces the default pattern.
        With a cache: the new tokens sit after each row's cached prefix. `valid_lengths[b]`
        counts the real tokens of row b (the rest is right padding). `write_cache=True`
        appends them to the cache (AR prefill/decode); False lets them attend to the prefix and
        to each other without being stored (a diffusion step over a cached prompt).
        `output_positions` [B, K]: logits only at those positions, [B, K, vocab] (a prefill
        needs each row's last one; projecting every position onto the vocabulary is waste).
        The last layer then computes only those positions' queries and outputs, every position's
        keys and values still stored (K = 0: a cache filled, no logits).
        `isolated_prefix` (bidirectional, one unpadded row written to a cache): the first that
        many new tokens attend only to the cache and themselves (`IsolatedPrefix`).
        `positions_end`: one past the largest of `positions`, when the caller knows it; else it
        is read from the device (on a GPU, a synchronization in every forward).
        """
        batch, length = input_ids.shape
        device = input_ids.device
        c = self.config
        padded = valid_lengths is not None
        if valid_lengths is None and cache is not None and batch > 1:  # the only forwards that read them
            valid_lengths = torch.full((batch,), length, dtype=torch.long, device=device)
        mask, write, where, key_slots, start = attention_mask, None, None, 0, 0
        if mask is not None:
            mask = mask[:, None]
        if cache is not None:
            mask, write, where, key_slots = self._cache_mask(cache, length, valid_lengths, write_cache, padded)
            start = where.start if isinstance(where, slice) else None
        if isolated_prefix:
            if c.causal or write != "slice" or not 0 < isolated_prefix < length:
                raise ValueError("isolated_prefix needs a bidirectional model, one unpadded row written to a cache, "
                                 f"and 0 < isolated_prefix < {length} new tokens")
            mask = IsolatedPrefix(isolated_prefix, where.start + isolated_prefix)
        elif mask is None and (not c.causal) and padded and bool((valid_lengths < length).any()):
            mask = key_padding_mask(valid_lengths, length)[:, None, None, :].expand(batch, 1, length, length)
        rope = self._positions_rope(positions, start, cache, length, key_slots, device, positions_end)
        weight = self.embed_tokens.weight
        plan = plan_attention(mask, write, where, key_slots, length, c.causal and cache is None, c.num_kv_heads,
                              c.num_heads, weight.dtype)
        cos, sin = rope[..., 0:1, :], rope[..., 1:2, :]
        x = F.embedding(input_ids.reshape(-1), weight)
        stores = zip(cache.keys, cache.values, strict=True) if cache is not None else [(None, None)] * c.num_layers
        # Only `output_positions` are read, so the last layer's position-wise work (queries,
        # attention, output projection, MLP) runs for them alone: the same logits there (to
        # the rounding of a smaller matmul), a fifth less of a diffusion request's first forward.
        fewer = output_positions is not None and output_positions.shape[1] < length and len(self.layers) > 0
        picked = output_positions if fewer else None
        last = len(self.layers) - 1
        for index, (layer, (keys, values)) in enumerate(zip(self.layers, stores, strict=True)):
            if index == last and picked is not None:
                x = layer(x, batch, length, cos, sin, select_queries(plan, picked, length), keys, values, picked)
            else:
                x = layer(x, batch, length, cos, sin, plan, keys, values)
        if cache is not None and write_cache:
            cache.lengths = cache.lengths + (valid_lengths if valid_lengths is not None else length)
        x = x.view(batch, -1, x.shape[-1])
        if output_positions is not None and picked is None:
            x = x.gather(1, output_positions[..., None].expand(-1, -1, x.shape[-1]))
        return F.linear(self.norm(x), self.output_weight())

    def _positions_rope(self, positions: Tensor | None, start: int | None, cache: KVCache | None, length: int,
                        key_slots: int, device: torch.device, positions_end: int | None = None) -> Tensor:
        """Each new token's `rotary_table` row, [B or 1, T, 2, head_dim]: a slice of the table
        when every row's positions are the same run (no cache, or one row written in place),
        else one lookup."""
        if positions is not None:
            end = positions_end if positions_end is not None else int(positions.max()) + 1
            return self.rope(end, device)[positions]
        if cache is None or start is not None:
            start = start or 0
            return self.rope(start + length, device)[None, start: start + length]
        needed = max(cache.max_tokens, key_slots + length)
        return self.rope(needed, device)[cache.lengths[:, None] + torch.arange(length, device=device)]

    def _cache_mask(self, cache: KVCache, length: int, valid_lengths: Tensor | None, write_cache: bool,
                    padded: bool = True) -> tuple[AttentionPattern, str, Tensor | slice | None, int]:
        """The pattern, where the new keys go ("slice", "ragged", "scatter" or "read", as
        `AttentionPlan.write`) and their positions, and how many cache slots attention reads."""
        device = cache.lengths.device
        prefix = cache.lengths
        if cache.batch == 1 and not padded:
            # One row, no padding (batch-1 decode, a speculative verify, a diffusion step): every
            # cached key is valid, so a bidirectional forward or one new token needs no mask at
            # all and several causal ones need only the causal tail; written, the keys go to one
            # contiguous slice. Same result, a fraction of the ops.
            start = int(prefix[0])
            if write_cache and start + length > cache.max_tokens:
                raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
            mask = None
            if length > 1 and self.config.causal:
                slot = torch.arange(start + length, device=device)
                new_index = torch.arange(length, device=device)
                mask = (slot[None, :] <= (start + new_index)[:, None])[None, None] if start else CAUSAL_FROM_START
            if write_cache:
                return mask, "slice", slice(start, start + length), start + length
            if mask is not CAUSAL_FROM_START:  # (the positions of the new tokens, not written)
                return mask, "read", slice(start, start + length), start
        new_index = torch.arange(length, device=device)
        if write_cache:
            if int((prefix + length).max()) > cache.max_tokens:
                raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
            write_positions = prefix[:, None] + new_index
            key_slots = int((prefix + length).max())
            if length == 1 and cache.keys[0].is_contiguous():
                c = self.config
                return (ragged_decode_layout(prefix, valid_lengths, c.num_kv_heads, c.num_heads // c.num_kv_heads,
                                             cache.max_tokens, key_slots, self.embed_tokens.weight.dtype),
                        "ragged", write_positions, key_slots)
            if self.config.causal and key_slots == length and length > 1 and not bool(prefix.any()):
                return CAUSAL_FROM_START, "scatter", write_positions, key_slots
            slot = torch.arange(key_slots, device=device)
            valid = slot[None, :] < (prefix + valid_lengths)[:, None]  # [B, S]
            mask = valid[:, None, :].expand(-1, length, -1)
            if self.config.causal:
                mask = mask & (slot[None, None, :] <= write_positions[:, :, None])
            return mask[:, None], "scatter", write_positions, key_slots
        key_slots = int(prefix.max())
        prefix_valid = torch.arange(key_slots, device=device)[None, :] < prefix[:, None]  # [B, P]
        new_valid = new_index[None, :] < valid_lengths[:, None]  # [B, T]
        mask = torch.cat([prefix_valid, new_valid], dim=1)[:, None, :].expand(-1, length, -1)
        if self.config.causal:
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            mask = mask.clone()
            mask[:, :, key_slots:] &= causal
        return mask[:, None], "read", None, key_slots


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
