"""Which keys each query attends to, and the kernels for the patterns a plain mask serves badly.

A forward decides its pattern once (`AttentionPattern`) and every layer follows it: the default
of the config, a boolean mask, causal from an empty cache, an isolated prefix (a diffusion
request's first forward), or a ragged decode step (one new token per row of a batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

# The attention pattern of a causal forward over an empty cache (a prompt's prefill): every
# query sees the keys up to its own, which `is_causal` gives without a mask. Right padding
# needs none either: a real token only sees earlier, real ones, and the padding's outputs and
# keys are never read. An explicit [B, 1, T, T] mask costs the CPU kernel several times more.
CAUSAL_FROM_START = "causal-from-start"


@dataclass(frozen=True)
class IsolatedPrefix:
    """The attention pattern of a diffusion request's first forward over prompt and window: the
    first `queries` new tokens (the prompt) attend only to the first `keys` slots (the cache
    before them and themselves); the later ones (the window) attend to every slot. Exactly what
    a prompt prefill followed by a window refresh computes, in one forward."""

    queries: int
    keys: int


def isolated_prefix_attention(q: Tensor, k: Tensor, v: Tensor, pattern: IsolatedPrefix, gqa: bool) -> Tensor:
    """q [B, H, T, D], k and v [B, kv_heads, S, D] -> [B, H, T, D] under `pattern`.

    Two unmasked kernels, one per part: with an explicit [T, S] mask the CPU kernel costs more
    than the two forwards this pattern replaces (measured when the merge was first tried)."""
    head = F.scaled_dot_product_attention(q[:, :, : pattern.queries], k[:, :, : pattern.keys],
                                          v[:, :, : pattern.keys], enable_gqa=gqa)
    tail = F.scaled_dot_product_attention(q[:, :, pattern.queries:], k, v, enable_gqa=gqa)
    return torch.cat([head, tail], dim=2)


@dataclass(frozen=True)
class RaggedDecode:
    """One new token per row over rows of different lengths (a continuous-batching decode step),
    laid out once per forward for every layer: `slots` [B * kv_heads], where each row's new key
    goes in the cache flattened to [B * kv_heads * max_tokens, D]; `bias` [B * kv_heads, group, S],
    0 on a row's valid keys and -inf past them (`group` query heads share a key head)."""

    slots: Tensor
    bias: Tensor


def ragged_decode_layout(prefix: Tensor, valid_lengths: Tensor, kv_heads: int, group: int, max_tokens: int,
                         key_slots: int, dtype: torch.dtype = torch.float32) -> RaggedDecode:
    """`RaggedDecode` for rows holding `prefix[b]` cached tokens plus `valid_lengths[b]` (0 or 1)
    new ones, their caches `max_tokens` slots long; the bias in the model's `dtype`."""
    batch = prefix.shape[0]
    heads = torch.arange(kv_heads, device=prefix.device)
    slots = ((torch.arange(batch, device=prefix.device)[:, None] * kv_heads + heads) * max_tokens
             + prefix[:, None]).flatten()
    valid = torch.arange(key_slots, device=prefix.device)[None, :] < (prefix + valid_lengths)[:, None]  # [B, S]
    return RaggedDecode(slots, grouped_bias(valid, kv_heads, group, dtype))


def grouped_bias(valid: Tensor, kv_heads: int, group: int, dtype: torch.dtype) -> Tensor:
    """[B, S] True where a row may attend -> the additive bias `ragged_decode_attention` takes,
    [B * kv_heads, group, S]: 0 there, -inf elsewhere."""
    batch, slots = valid.shape
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
    return bias[:, None, None, :].expand(batch, kv_heads, group, slots).reshape(batch * kv_heads, group, slots)


def ragged_decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """One new token per row over its cached keys: q [B, 1, H, D], k and v [B, kv_heads, S, D]
    (slices of the cache), bias [B * kv_heads, group, S] (`RaggedDecode`) -> [B, 1, H, D].

    The query heads that share a key head are stacked as rows of one matrix product, so the
    cache is read where it lies (scaled_dot_product_attention with a mask and grouped heads
    copies the keys and values per query head first, which at 64 rows was most of a step),
    and the mask, the scale and the product are one kernel (baddbmm): at 64 rows the step
    reads the cache from memory, and every extra pass over the scores costs a visible share.
    """
    batch, _, heads, dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    grouped = q.reshape(batch * kv_heads, heads // kv_heads, dim)
    scores = torch.baddbmm(bias.to(q.dtype), grouped, k.reshape(batch * kv_heads, slots, dim).transpose(1, 2),
                           alpha=dim**-0.5)
    out = torch.bmm(scores.softmax(-1), v.reshape(batch * kv_heads, slots, dim))
    return out.reshape(batch, 1, heads, dim)


# What a forward's attention follows, decided once for every layer: None (the config's default),
# a boolean mask [B, 1, T, S] (True = may attend), CAUSAL_FROM_START, IsolatedPrefix, RaggedDecode.
AttentionPattern = Tensor | str | IsolatedPrefix | RaggedDecode | None


@dataclass(frozen=True)
class AttentionPlan:
    """Everything a layer's attention needs, decided once per forward (every layer follows it,
    and per-layer Python is a visible share of a small model's decode step).

    `write`: where the new keys go: "ragged" (one per row, `pattern.slots`), "slice" (one row,
    contiguous `positions`), "scatter" (`positions` [B, T]), "read" (attend to the cache's first
    `key_slots` slots and the new keys, store nothing) or None (no cache). `kernel`: "isolated",
    "ragged" (`bias`), or "sdpa" with `sdpa_mask` and `causal`."""

    write: str | None
    positions: Tensor | slice | None
    key_slots: int
    pattern: AttentionPattern
    kernel: str
    bias: Tensor | None
    sdpa_mask: Tensor | None
    causal: bool
    gqa: bool


def plan_attention(pattern: AttentionPattern, write: str | None, positions: Tensor | slice | None, key_slots: int,
                   length: int, causal_default: bool, kv_heads: int, heads: int, dtype: torch.dtype) -> AttentionPlan:
    """The kernel for `pattern` (see `attend`); `causal_default`: the config is causal and no
    cache is read, so no pattern means causal."""
    from_start = isinstance(pattern, str)  # CAUSAL_FROM_START
    bias, kernel = None, "sdpa"
    if isinstance(pattern, IsolatedPrefix):
        kernel = "isolated"
    elif isinstance(pattern, RaggedDecode):
        kernel, bias = "ragged", pattern.bias
    elif length == 1 and pattern is not None and not from_start:  # [B, 1, 1, S], True = may attend
        kernel, bias = "ragged", grouped_bias(pattern[:, 0, 0], kv_heads, heads // kv_heads, dtype)
    return AttentionPlan(write, positions, key_slots, pattern, kernel, bias,
                         None if from_start or kernel != "sdpa" else pattern,
                         from_start or (pattern is None and causal_default), kv_heads != heads)


def select_queries(plan: AttentionPlan, picked: Tensor, length: int) -> AttentionPlan:
    """`plan` for the queries at `picked` [B, K] of the forward's `length` new tokens only (the
    last layer, where only the positions projected onto the vocabulary are read): the same keys,
    stored as before, and each picked query attending to exactly the keys it attended to.

    A mask shrinks to the picked rows; a causal pattern or an isolated prefix becomes a mask,
    or no mask where every picked query sees every key (a prefill's last token, a diffusion
    window after its prompt). The checks read `picked` on the host once per forward."""
    if plan.kernel == "ragged":  # one new token per row: nothing to leave out
        return plan
    mask = plan.sdpa_mask
    slots = length if plan.write is None else plan.key_slots + (length if plan.write == "read" else 0)
    if plan.kernel == "isolated":
        prefix = plan.pattern
        if not bool((picked >= prefix.queries).all()):
            keys = torch.arange(slots, device=picked.device) < prefix.keys
            mask = (keys[None, None, :] | (picked >= prefix.queries)[:, :, None])[:, None]
    elif mask is not None:  # [B or 1, 1, T, S] -> [B, 1, K, S]
        mask = mask.expand(picked.shape[0], -1, -1, -1).gather(
            2, picked[:, None, :, None].expand(-1, -1, -1, mask.shape[-1]))
    elif plan.causal and not bool((picked == length - 1).all()):  # here the keys are the new tokens
        mask = (torch.arange(length, device=picked.device)[None, None, :] <= picked[:, :, None])[:, None]
    return replace(plan, kernel="sdpa", sdpa_mask=mask, causal=False)


def attend(plan: AttentionPlan, q: Tensor, k: Tensor, v: Tensor, keys: Tensor | None, values: Tensor | None) -> Tensor:
    """One layer's attention under `plan`: q [B, T, H, D], k and v [B, T, kv_heads, D] (the new
    tokens'), `keys`/`values` the layer's cache [B, kv_heads, slots, D] (None without one);
    the new keys stored as the plan says. Returns [B, T, H, D]; q may hold fewer queries than k
    and v hold new keys, [B, K, H, D] (`select_queries`), and then so does the result."""
    write, where, slots = plan.write, plan.positions, plan.key_slots
    if write is not None:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, T, D], the cache's layout
        if write == "slice":  # one row: a contiguous write, no scatter
            keys[:, :, where] = k
            values[:, :, where] = v
        elif write == "ragged":  # one new key per row: one flat copy per tensor
            dim = keys.shape[-1]
            keys.view(-1, dim).index_copy_(0, plan.pattern.slots, k.reshape(-1, dim).to(keys.dtype))
            values.view(-1, dim).index_copy_(0, plan.pattern.slots, v.reshape(-1, dim).to(values.dtype))
        elif write == "scatter":
            rows = torch.arange(where.shape[0], device=where.device)[:, None].expand_as(where)
            # Advanced indices around a slice put their dimensions first: [B, L, kv_heads, D].
            keys[rows, :, where] = k.transpose(1, 2).to(keys.dtype)
            values[rows, :, where] = v.transpose(1, 2).to(values.dtype)
        if write == "read":  # the prefix, then the new keys, kept out of the cache
            k = torch.cat([keys[:, :, :slots].to(q.dtype), k], dim=2)
            v = torch.cat([values[:, :, :slots].to(q.dtype), v], dim=2)
        else:
            k, v = keys[:, :, :slots].to(q.dtype), values[:, :, :slots].to(q.dtype)
    else:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if q.shape[1] == 0:  # no output read (a prefill that only fills the cache): the keys were the work
        return q
    if plan.kernel == "ragged":
        return ragged_decode_attention(q, k, v, plan.bias)
    if plan.kernel == "isolated":
        return isolated_prefix_attention(q.transpose(1, 2), k, v, plan.pattern, plan.gqa).transpose(1, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=plan.sdpa_mask, is_causal=plan.causal,
                                          enable_gqa=plan.gqa).transpose(1, 2)


def key_padding_mask(valid_lengths: Tensor, length: int) -> Tensor:
    """[B, T] True where a key is a real token, False on right padding."""
    return torch.arange(length, device=valid_lengths.device)[None, :] < valid_lengths[:, None]


def block_causal_mask(prefix_length: int, total_length: int, device: torch.device | str = "cpu") -> Tensor:
    """[T, T]: the prefix attends only to itself; the tokens after it attend to everything.

    This is the attention pattern under which caching a prompt's keys/values once and reusing
    them for every diffusion step over the answer is exact rather than an approximation.
    """
    mask = torch.ones(total_length, total_length, dtype=torch.bool, device=device)
    mask[:prefix_length, prefix_length:] = False
    return mask
