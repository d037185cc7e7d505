"""The layers of DiffusionGemma (Gemma 4's text blocks), each as transformers' reference computes it.

Source: transformers 5.x, models/diffusion_gemma/modeling_diffusion_gemma.py (the "reference"
below). Where Gemma departs from the Llama family of `nowait.model.transformer`:

- RMSNorm multiplies by its weight as is (Gemma 4; Gemma 1-3's was (1 + w)), all in fp32, and
  some norms have no weight at all (the value norm, the router's, self-conditioning's last one).
- q and k are RMS-normed per head before the rotary embedding, v is RMS-normed without a weight,
  and the attention scale is 1 (the norms fix the logits' size instead of 1/sqrt(d)).
- Global ("full_attention") layers have their own head size and key heads, no v_proj (the
  values are the keys' projection, before k_norm), and "proportional" RoPE: only the first
  `partial_rotary_factor` of the frequencies turn, at base^(-2i/head_dim), the rest are 0.
- Every layer runs a dense GeGLU MLP and a routed mixture of experts side by side on the same
  residual, each with its own norms, their sum normed once more, and the layer's output scaled
  by a stored scalar.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def gemma_rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """DiffusionGemmaRMSNorm: x * (mean(x^2) + eps)^-0.5 [* weight], in fp32, back to x's dtype."""
    x32 = x.float()
    normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(x)


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, with_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if with_weight else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def gemma_inverse_frequencies(head_dim: int, theta: float, rope_type: str, rotated_fraction: float) -> Tensor:
    """[head_dim / 2] RoPE frequencies. "default": theta^(-2i/d') over d' = head_dim * fraction
    (compute_default_rope_parameters); "proportional": the first int(fraction * head_dim / 2)
    pairs at theta^(-2i/head_dim), the others 0 so they do not turn (_compute_proportional_rope_parameters)."""
    if rope_type == "default":
        dim = int(head_dim * rotated_fraction)
        return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    turning = int(rotated_fraction * head_dim // 2)
    rotated = 1.0 / theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / head_dim)
    return torch.cat([rotated, torch.zeros(head_dim // 2 - turning)])


def rotary(positions: Tensor, inverse_frequency: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, 1, head_dim] (the halves repeated, Hugging Face's layout), in `dtype`."""
    angles = positions[..., None].float() * inverse_frequency.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class GemmaAttention(nn.Module):
    """DiffusionGemma{Encoder,Decoder}TextAttention for one layer: `head_dim` and `kv_heads` are
    that layer's; `values_from_keys` (the global layers) drops v_proj."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, values_from_keys: bool,
                 eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = None if values_from_keys else nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = GemmaRMSNorm(head_dim, eps)
        self.k_norm = GemmaRMSNorm(head_dim, eps)
        self.eps = eps

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, T, D], k and v [B, kv_heads, T, D], normed and rotated as the reference does."""
        batch, length, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)), cos, sin)
        raw_k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        raw_v = raw_k if self.v_proj is None else self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        k = rotate(self.k_norm(raw_k), cos, sin)
        v = gemma_rms_norm(raw_v, None, self.eps)  # v_norm: no weight
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> Tensor:
        """Attention with scale 1 (the reference's `self.scaling = 1.0`); `allowed` [T, S] or None."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0,
                                             enable_gqa=self.kv_heads != self.heads)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class GeGLU(nn.Module):
    """DiffusionGemmaText4MLP and the self-conditioning block: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    """DiffusionGemmaTextRouter: scores the experts from the unweighted-RMS-normed residual times
    a learned scale and hidden^-0.5; keeps the top k, renormalized, times a per-expert scale."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))
        self.top_k, self.eps, self.root = top_k, eps, hidden**-0.5

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = self.proj(gemma_rms_norm(x, None, self.eps) * self.scale * self.root)
        weights, index = torch.topk(scores.softmax(-1, dtype=torch.float32), k=self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Experts(nn.Module):
    """DiffusionGemmaTextExperts: per expert, GeGLU with gate and up packed in one [2I, H] matrix;
    each token's output is the routing-weighted sum over its top-k experts."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def forward(self, x: Tensor, weights: Tensor, index: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for expert in index.unique().tolist():  # only the experts some token chose run at all
            token, slot = torch.where(index == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            hidden = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out.index_add_(0, token, (hidden * weights[token, slot, None]).to(out.dtype))
        return out


class GemmaLayer(nn.Module):
    """One DiffusionGemma layer, shared by the encoder and the denoiser (their weights are tied);
    only the stored output scalar is each side's own."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 values_from_keys: bool, experts: int, top_k: int, expert_intermediate: int, eps: float) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(hidden, heads, kv_heads, head_dim, values_from_keys, eps)
        self.mlp = GeGLU(hidden, intermediate)
        self.router = Router(hidden, experts, top_k, eps)
        self.experts = Experts(experts, hidden, expert_intermediate)
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                 "pre_feedforward_layernorm_2")
        for name in names:
            setattr(self, name, GemmaRMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)  # the denoiser's
        self.encoder_layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def feed_forward(self, x: Tensor, attention_out: Tensor, scalar: Tensor) -> Tensor:
        """Everything after attention: the residual, the dense and routed branches, the scalar."""
        residual = x + self.post_attention_layernorm(attention_out)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(residual)))
        flat = residual.reshape(-1, residual.shape[-1])
        weights, index = self.router(flat)  # routed on the residual itself, not on a normed copy
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index).reshape(residual.shape)
        combined = self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return (residual + combined) * scalar
