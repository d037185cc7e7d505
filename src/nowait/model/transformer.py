"""The transformer's layers and forward: RMSNorm, rotary embeddings, attention, SwiGLU.

The forward places new tokens after each row's cached prefix and picks the attention pattern
(`nowait.model.attention`) once for every layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nowait.model.attention import (
    CAUSAL_FROM_START,
    AttentionPattern,
    IsolatedPrefix,
    RaggedDecode,
    grouped_bias,
    isolated_prefix_attention,
    key_padding_mask,
    ragged_decode_attention,
    ragged_decode_layout,
)
from nowait.model.config import ModelConfig
from nowait.model.kv_cache import KVCache

# Inference (no gradients) reuses each fresh intermediate in place: the same operations on the
# same numbers, bit for bit, without allocating and writing another tensor. At prefill sizes
# ([4096 tokens, 512]) the MLP alone ran a quarter faster; a 64-prompt prefill 11% faster.
# Training keeps the out-of-place form that autograd needs.


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Computed in fp32: the reduction over the hidden size loses precision in 16-bit.
    x32 = x.float()
    if torch.is_grad_enabled() or weight.dtype != x.dtype:  # (a weight of another dtype promotes)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return (x32 * x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype).mul_(weight)


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


def rotary_tables(positions: Tensor, head_dim: int, theta: float,
                  scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin of RoFormer's rotary embedding at integer positions [B, T] -> [B, T, 1, head_dim]."""
    inverse_frequency = inverse_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.float()[..., None] * inverse_frequency
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (the Llama/Hugging Face layout, not interleaved)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if torch.is_grad_enabled():
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)
    # In place, cos/sin must broadcast into x's shape (they always do: built from x's positions).
    return (x.float() * cos).add_(rotated.float().mul_(sin)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: AttentionPattern, layer: int,
                cache: KVCache | None, write_positions: Tensor | slice | None, key_slots: int) -> Tensor:
        batch, length, _ = x.shape
        c = self.config
        q = self.q_proj(x).view(batch, length, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(batch, length, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(batch, length, c.num_kv_heads, c.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, L, D], the cache's layout
        if cache is not None:
            keys, values = cache.keys[layer], cache.values[layer]
            if isinstance(mask, RaggedDecode):  # one new key per row: one flat copy per tensor
                dim = keys.shape[-1]
                keys.view(-1, dim).index_copy_(0, mask.slots, k.reshape(-1, dim).to(keys.dtype))
                values.view(-1, dim).index_copy_(0, mask.slots, v.reshape(-1, dim).to(values.dtype))
                k, v = keys[:, :, :key_slots].to(q.dtype), values[:, :, :key_slots].to(q.dtype)
            elif isinstance(write_positions, slice):  # one row: a contiguous write, no scatter
                keys[:, :, write_positions] = k.to(keys.dtype)
                values[:, :, write_positions] = v.to(values.dtype)
                k, v = keys[:, :, :key_slots].to(q.dtype), values[:, :, :key_slots].to(q.dtype)
            elif write_positions is not None:
                rows = torch.arange(batch, device=x.device)[:, None].expand_as(write_positions)
                # Advanced indices around a slice put their dimensions first: [B, L, kv_heads, D].
                keys[rows, :, write_positions] = k.transpose(1, 2).to(keys.dtype)
                values[rows, :, write_positions] = v.transpose(1, 2).to(values.dtype)
                k, v = keys[:, :, :key_slots].to(q.dtype), values[:, :, :key_slots].to(q.dtype)
            else:  # read the prefix, keep the new keys out of the cache
                k = torch.cat([keys[:, :, :key_slots].to(q.dtype), k], dim=2)
                v = torch.cat([values[:, :, :key_slots].to(q.dtype), v], dim=2)
        from_start = isinstance(mask, str)  # CAUSAL_FROM_START
        if isinstance(mask, IsolatedPrefix):
            gqa = c.num_kv_heads != c.num_heads
            out = isolated_prefix_attention(q.transpose(1, 2), k, v, mask, gqa).transpose(1, 2)
        elif isinstance(mask, RaggedDecode):
            out = ragged_decode_attention(q, k, v, mask.bias)
        elif length == 1 and mask is not None and not from_start:  # [B, 1, 1, S], True = may attend
            bias = grouped_bias(mask[:, 0, 0], c.num_kv_heads, c.num_heads // c.num_kv_heads, q.dtype)
            out = ragged_decode_attention(q, k, v, bias)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v,
                attn_mask=None if from_start else mask,
                is_causal=from_start or (mask is None and c.causal and cache is None),
                enable_gqa=c.num_kv_heads != c.num_heads,
            ).transpose(1, 2)
        return self.o_proj(out.reshape(batch, length, -1))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(gate.mul_(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: AttentionPattern, layer: int,
                cache: KVCache | None, write_positions: Tensor | slice | None, key_slots: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache, write_positions, key_slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Parameter names follow Hugging Face Llama (`model.layers.0.self_attn.q_proj.weight`)
    minus the `model.` prefix, so checkpoints map by a prefix alone."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def output_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, valid_lengths: Tensor | None = None,
                write_cache: bool = True, attention_mask: Tensor | None = None,
                positions: Tensor | None = None, output_positions: Tensor | None = None,
                isolated_prefix: int = 0) -> Tensor:
        """Logits [B, T, vocab] for `input_ids` [B, T].

        Without a cache: a plain forward, causal or bidirectional per the config; an optional
        boolean `attention_mask` [B, T, T] (True = may attend) replaces the default pattern.
        With a cache: the new tokens sit after each row's cached prefix. `valid_lengths[b]`
        counts the real tokens of row b (the rest is right padding). `write_cache=True`
        appends them to the cache (AR prefill/decode); False lets them attend to the prefix and
        to each other without being stored (a diffusion step over a cached prompt).
        `output_positions` [B, K]: logits only at those positions, [B, K, vocab] (a prefill
        needs each row's last one; projecting every position onto the vocabulary is waste).
        `isolated_prefix` (bidirectional, one unpadded row written to a cache): the first that
        many new tokens attend only to the cache and themselves (`IsolatedPrefix`).
        """
        batch, length = input_ids.shape
        device = input_ids.device
        c = self.config
        padded = valid_lengths is not None
        if valid_lengths is None:
            valid_lengths = torch.full((batch,), length, dtype=torch.long, device=device)
        offsets = cache.lengths if cache is not None else torch.zeros(batch, dtype=torch.long, device=device)
        if positions is None:
            positions = offsets[:, None] + torch.arange(length, device=device)
        cos, sin = rotary_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)
        mask, write_positions, key_slots = attention_mask, None, 0
        if mask is not None:
            mask = mask[:, None]
        if cache is not None:
            mask, write_positions, key_slots = self._cache_mask(cache, length, valid_lengths, write_cache, padded)
        if isolated_prefix:
            if c.causal or not isinstance(write_positions, slice) or not 0 < isolated_prefix < length:
                raise ValueError("isolated_prefix needs a bidirectional model, one unpadded row written to a cache, "
                                 f"and 0 < isolated_prefix < {length} new tokens")
            mask = IsolatedPrefix(isolated_prefix, write_positions.start + isolated_prefix)
        elif mask is None and (not c.causal) and bool((valid_lengths < length).any()):
            mask = key_padding_mask(valid_lengths, length)[:, None, None, :].expand(batch, 1, length, length)
        x = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, index, cache, write_positions, key_slots)
        if cache is not None and write_cache:
            cache.lengths = cache.lengths + valid_lengths
        if output_positions is not None:
            x = x.gather(1, output_positions[..., None].expand(-1, -1, x.shape[-1]))
        return F.linear(self.norm(x), self.output_weight())

    def _cache_mask(self, cache: KVCache, length: int, valid_lengths: Tensor, write_cache: bool,
                    padded: bool = True) -> tuple[AttentionPattern, Tensor | slice | None, int]:
        device = cache.lengths.device
        prefix = cache.lengths
        new_index = torch.arange(length, device=device)
        if write_cache and cache.batch == 1 and not padded:
            # One row, no padding (batch-1 decode, a speculative verify, a diffusion step): every
            # cached key is valid, so a bidirectional forward or one new token needs no mask at
            # all and several causal ones need only the causal tail; the keys go to one
            # contiguous slice. Same result, a fraction of the ops.
            start = int(prefix[0])
            if start + length > cache.max_tokens:
                raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
            mask = None
            if length > 1 and self.config.causal:
                slot = torch.arange(start + length, device=device)
                mask = (slot[None, :] <= (start + new_index)[:, None])[None, None] if start else CAUSAL_FROM_START
            return mask, slice(start, start + length), start + length
        if write_cache:
            if int((prefix + length).max()) > cache.max_tokens:
                raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
            write_positions = prefix[:, None] + new_index
            key_slots = int((prefix + length).max())
            if length == 1 and cache.keys[0].is_contiguous():
                c = self.config
                return (ragged_decode_layout(prefix, valid_lengths, c.num_kv_heads, c.num_heads // c.num_kv_heads,
                                             cache.max_tokens, key_slots, self.embed_tokens.weight.dtype),
                        write_positions, key_slots)
            if self.config.causal and key_slots == length and length > 1 and not bool(prefix.any()):
                return CAUSAL_FROM_START, write_positions, key_slots
            slot = torch.arange(key_slots, device=device)
            valid = slot[None, :] < (prefix + valid_lengths)[:, None]  # [B, S]
            mask = valid[:, None, :].expand(-1, length, -1)
            if self.config.causal:
                mask = mask & (slot[None, None, :] <= write_positions[:, :, None])
            return mask[:, None], write_positions, key_slots
        key_slots = int(prefix.max())
        prefix_valid = torch.arange(key_slots, device=device)[None, :] < prefix[:, None]  # [B, P]
        new_valid = new_index[None, :] < valid_lengths[:, None]  # [B, T]
        mask = torch.cat([prefix_valid, new_valid], dim=1)[:, None, :].expand(-1, length, -1)
        if self.config.causal:
            causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            mask = mask.clone()
            mask[:, :, key_slots:] &= causal
        return mask[:, None], None, key_slots


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
