"""DiffusionGemma (google/diffusiongemma-*): a block-diffusion LM as an encoder and a denoiser.

The reference is transformers 5.x `DiffusionGemmaForBlockDiffusion` (text input only). One stack
of Gemma layers (`nowait.model.gemma_layers`) is used two ways, with tied weights:

- the encoder (`encode`) runs causally over the prompt, and after each block over the block's
  committed tokens, appending their keys and values to the cache; sliding layers see the last
  `sliding_window` positions (q - W < k <= q), global layers every earlier one;
- the denoiser (`denoise`) runs over a canvas of `canvas_length` tokens bidirectionally: each
  canvas token attends to the whole canvas and to the cache, where a sliding layer reads only
  the last `sliding_window - 1` cached positions (what transformers' sliding cache layer keeps),
  without writing it. Its input is the canvas embeddings plus a self-conditioning signal (the
  previous step's logits as a softmax-weighted embedding, through a GeGLU block), RMS-normed;
  its logits are soft-capped: cap * tanh(logits / cap).

Embeddings are scaled by sqrt(hidden) (in the weights' dtype, as the reference does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from nowait.model.gemma_layers import (
    GeGLU,
    GemmaLayer,
    GemmaRMSNorm,
    gemma_inverse_frequencies,
    gemma_rms_norm,
    rotary,
)

SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclass
class DiffusionGemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: list[str]
    head_dims: list[int]  # per layer (global layers have their own)
    kv_heads: list[int]  # per layer
    rope: dict[str, dict]  # per layer type: rope_type, rope_theta, partial_rotary_factor
    sliding_window: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    max_position: int = 131072
    extra: dict = field(default_factory=dict)
    # What callers ask of any nowait model config: a diffusion model, with no mask token (its
    # canvas is random tokens) and no logit shift.
    causal: bool = False
    mask_token_id: int | None = None
    logits_shift: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def inverse_frequencies(self, layer: int) -> Tensor:
        rope = self.rope[self.layer_types[layer]]
        fraction = float(rope.get("partial_rotary_factor", 1.0))
        return gemma_inverse_frequencies(self.head_dims[layer], float(rope["rope_theta"]),
                                         rope.get("rope_type", "default"), fraction)


class PromptCache:
    """Keys and values the encoder wrote, per layer [B, kv_heads, S, D]: a global layer's for every
    position so far, a sliding layer's for the last `sliding_window - 1` only (all that a later
    query can see, as transformers' sliding cache layer keeps them)."""

    def __init__(self, layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * layers
        self.values: list[Tensor | None] = [None] * layers
        self.length = 0

    def append(self, layer: int, keys: Tensor, values: Tensor) -> None:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = keys, values
        else:
            self.keys[layer] = torch.cat([self.keys[layer], keys], dim=2)
            self.values[layer] = torch.cat([self.values[layer], values], dim=2)

    def keep_last(self, layer: int, count: int) -> None:
        first = max(self.keys[layer].shape[2] - count, 0)
        self.keys[layer], self.values[layer] = self.keys[layer][:, :, first:], self.values[layer][:, :, first:]


class SelfConditioning(GeGLU):
    """DiffusionGemmaSelfConditioning's GeGLU and its input norm; the norm after the sum has no weight."""

    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__(hidden, intermediate)
        self.pre_norm = GemmaRMSNorm(hidden, eps)
        self.eps = eps

    def combine(self, embeddings: Tensor, soft_embeddings: Tensor) -> Tensor:
        return gemma_rms_norm(embeddings + self(self.pre_norm(soft_embeddings)), None, self.eps)


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """Gemma's final logit soft-capping, in fp32 (the reference casts before capping)."""
    logits = logits.float()
    return logits if cap is None else torch.tanh(logits / cap) * cap


def encoder_mask(start: int, length: int, sliding_window: int | None, device: torch.device,
                 first_key: int = 0) -> Tensor:
    """[T, S] True where query start + i may see the key at position first_key + j (the keys held
    run from `first_key` to start + T - 1): causal, and within the window."""
    query = torch.arange(start, start + length, device=device)[:, None]
    key = torch.arange(first_key, start + length, device=device)[None, :]
    allowed = key <= query
    return allowed & (key > query - sliding_window) if sliding_window is not None else allowed


class DiffusionGemma(nn.Module):
    """Parameter names follow the checkpoint's denoiser (`model.decoder.` + name), whose weights
    the encoder shares; `layers.N.encoder_layer_scalar` is the encoder's own stored scalar."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            GemmaLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.kv_heads[i], c.head_dims[i],
                       c.layer_types[i] == GLOBAL, c.num_experts, c.top_k_experts, c.moe_intermediate_size,
                       c.rms_norm_eps)
            for i in range(c.num_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_conditioning = SelfConditioning(c.hidden_size, c.intermediate_size, c.rms_norm_eps)
        for index in range(c.num_layers):
            self.register_buffer(f"inverse_frequency_{index}", c.inverse_frequencies(index), persistent=False)

    def embed(self, ids: Tensor) -> Tensor:
        weight = self.embed_tokens.weight
        return self.embed_tokens(ids) * torch.tensor(self.config.hidden_size**0.5).to(weight.dtype)

    def _rotary(self, layer: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rotary(positions, getattr(self, f"inverse_frequency_{layer}"), dtype)

    def encode(self, ids: Tensor, cache: PromptCache) -> Tensor:
        """Run the encoder over `ids` [B, T] placed after the cache; append their keys and values.
        Returns the encoder's final hidden states (normed), [B, T, hidden]."""
        batch, length = ids.shape
        start = cache.length
        positions = torch.arange(start, start + length, device=ids.device)[None].expand(batch, -1)
        x = self.embed(ids)
        for index, layer in enumerate(self.layers):
            sliding = self.config.layer_types[index] == SLIDING
            cos, sin = self._rotary(index, positions, x.dtype)
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            cache.append(index, k, v)
            held = cache.keys[index].shape[2]
            mask = encoder_mask(start, length, self.config.sliding_window if sliding else None, ids.device,
                                first_key=start + length - held)
            out = layer.self_attn.attend(q, cache.keys[index], cache.values[index], mask)
            if sliding:
                cache.keep_last(index, self.config.sliding_window - 1)
            x = layer.feed_forward(x, out, layer.encoder_layer_scalar)
        cache.length += length
        return self.norm(x)

    def denoise(self, canvas: Tensor, cache: PromptCache, self_conditioning_logits: Tensor | None = None) -> Tensor:
        """Soft-capped fp32 logits [B, L, vocab] for the canvas [B, L] over the cached prefix.

        `self_conditioning_logits`: the previous step's (processed) logits, or None on a block's
        first step (the reference's zero signal then)."""
        batch, length = canvas.shape
        c = self.config
        x = self.embed(canvas)
        if self_conditioning_logits is None:
            soft = torch.zeros_like(x)
        else:
            weight = self.embed_tokens.weight
            probabilities = self_conditioning_logits.softmax(-1, dtype=torch.float32).to(weight.dtype)
            soft = (probabilities @ weight) * torch.tensor(c.hidden_size**0.5).to(weight.dtype).to(x.dtype)
        x = self.self_conditioning.combine(x, soft)
        positions = torch.arange(cache.length, cache.length + length, device=canvas.device)[None].expand(batch, -1)
        for index, layer in enumerate(self.layers):
            cos, sin = self._rotary(index, positions, x.dtype)
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            keys, values = cache.keys[index], cache.values[index]
            if keys is not None:
                if c.layer_types[index] == SLIDING:
                    first = max(keys.shape[2] - (c.sliding_window - 1), 0)
                    keys, values = keys[:, :, first:], values[:, :, first:]
                k, v = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
            out = layer.self_attn.attend(q, k, v, None)
            x = layer.feed_forward(x, out, layer.layer_scalar)
        return soft_cap(nn.functional.linear(self.norm(x), self.embed_tokens.weight), c.final_logit_softcapping)
