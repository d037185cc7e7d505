"""One diffusion block step of one row as a compiled graph (torch.compile, inductor).

At batch 1 the diffusion engine's fast default (dual cache) forwards a span of a few dozen
tokens per step: the open range of the block (and the token before it, under the logit shift)
after the row's cached prompt, window prefix and suffix, attending to all of them and to
itself (bidirectional), its keys and values written after the cached slots (the engine keeps
the settled ones), logits read at the block's positions only. Eager PyTorch spends a good part
of that step dispatching some two hundred small operations and planning the attention;
`span_logits` is the step written for the compiler: one row, no mask (every key read is a
valid slot or a new token), no host reads and no branch on the data, so inductor fuses the
norms, the rotary, the residuals and the SwiGLU around the matmuls and the attention kernel. The sizes that change from
step to step (the cached slots, the span, the read positions) are compiled as symbols
(dynamic shapes), so the step compiles once for every request.

The same numbers as `Transformer.forward` up to float rounding; `CompiledBlock` is what the
diffusion engine's `compile` switches on (`nowait.engines.diffusion.engine`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from nowait.model.compiled_step import compile_for_one_model
from nowait.model.kv_cache import KVCache
from nowait.model.transformer import Transformer, mlp_residual, rotated_qkv

log = logging.getLogger(__name__)


def span_logits(model: Transformer, tokens: Tensor, positions: Tensor, rope: Tensor, keys: list[Tensor],
                values: list[Tensor], outputs: Tensor) -> Tensor:
    """Logits [K, vocab] at span offsets `outputs` [K] after feeding `tokens` [T] at `positions` [T].

    `keys`/`values`: each layer's cache for the row, [kv_heads, S, head_dim], views ending at
    the span's T slots (which this writes); the span attends to all S. `rope`: `Model.rope`'s
    table. Attention is the eager forward's kernel (scaled_dot_product_attention, grouped
    heads, no mask): written as matrix products with the softmax between them it measured
    slower on this CPU. As the model's forward, the last layer computes queries, attention
    output and MLP at the read positions only (every position's keys and values are still
    written)."""
    config = model.config
    heads, dim = config.num_heads, config.head_dim
    length = tokens.shape[0]
    table = rope[positions]  # [T, 2, D]: each token's cos and signed sin
    cos, sin = table[:, 0:1], table[:, 1:2]
    x = F.embedding(tokens, model.embed_tokens.weight)  # [T, hidden]
    last = len(model.layers) - 1
    for index, (layer, layer_keys, layer_values) in enumerate(zip(model.layers, keys, values, strict=True)):
        attn = layer.self_attn
        qk, v = rotated_qkv(layer, x, cos, sin)  # [T, heads + kv_heads, D], [T, kv_heads, D]
        layer_keys[:, -length:] = qk[:, heads:].transpose(0, 1).to(layer_keys.dtype)
        layer_values[:, -length:] = v.transpose(0, 1).to(layer_values.dtype)
        q = qk[:, :heads]
        if index == last:  # position-wise from here on: only the read rows
            q, x = q[outputs], x[outputs]
        rows = q.shape[0]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], layer_keys[None].to(q.dtype),
                                             layer_values[None].to(q.dtype), enable_gqa=True)
        out = out[0].transpose(0, 1).reshape(rows, heads * dim)
        x = x + F.linear(out, attn.o_proj.weight)
        x = mlp_residual(layer, x)
    if not model.layers:
        x = x[outputs]
    return F.linear(model.norm(x), model.output_weight())


class CompiledBlock:
    """`span_logits` compiled once for `model` (bidirectional), called on a one-row cache.

    `backend`: torch.compile's ("inductor" generates fused C++/Triton kernels; "eager" runs the
    same graph uncompiled, for tests of the plumbing). The first call compiles (tens of seconds
    on a CPU: `warm_up` does it up front and returns the time it took)."""

    def __init__(self, model: Transformer, backend: str | Callable = "inductor") -> None:
        if model.config.causal:
            raise ValueError("a compiled block step needs a bidirectional (diffusion) model")
        self.model = model
        self.backend = backend
        self.compile_seconds: float | None = None
        self._step = compile_for_one_model(span_logits, backend, tag=f"{id(self):x}")

    @torch.inference_mode()
    def __call__(self, span: Tensor, start: int, cache: KVCache, outputs: Tensor) -> Tensor:
        """Logits [1, K, vocab] at offsets `outputs` [1, K] of `span` [T] (its first token at
        absolute position `start`), attending to the cache's one row's cached slots and to
        itself; the span's keys and values written after the cached slots and `cache.lengths`
        advanced by T, as the model's forward with `write_cache=True` does. Run in inference
        mode, as the engine runs: the graph is compiled for inference tensors (another kind of
        tensor would compile another graph)."""
        if cache.batch != 1:
            raise ValueError(f"a compiled block step forwards one row; this cache holds {cache.batch}")
        cached, length, count = int(cache.lengths[0]), span.shape[0], outputs.shape[-1]
        if cached + length > cache.max_tokens:
            raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
        if length < 2:
            raise ValueError("a compiled block step forwards at least two tokens")
        device = cache.lengths.device
        # Detached: a view's base is a graph input too (its guards), and bases differ between
        # callers (a batch's cache or a row's, a slot tensor for all layers or one per layer);
        # without it each kind of cache would compile its own graph.
        keys = [k[0, :, : cached + length].detach() for k in cache.keys]
        values = [v[0, :, : cached + length].detach() for v in cache.values]
        positions = torch.arange(start, start + length, device=device)
        rope = self.model.rope(start + length, device)
        read = outputs.reshape(-1)
        # A row's tokens are made when its request is planned, outside inference mode: an
        # ordinary tensor's dispatch keys differ, and the graph (compiled for inference tensors)
        # would be compiled again, seconds in a server's first request. An inference copy of
        # the few ids is free.
        span, read = (t if t.is_inference() else t.clone() for t in (span, read))
        if count < 2:  # a size of 1 is a constant to the compiler: read the one row twice, keep one
            read = read.repeat(2)
        logits = self._step(self.model, span.detach(), positions, rope, keys, values, read)
        cache.lengths = cache.lengths + length
        return logits[None, :count]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile now, on a scratch cache: the seconds it took, also kept in `compile_seconds`."""
        weight = self.model.output_weight()
        cached, length, count = warm_up_sizes(self.model)
        # A cache's slot count is a stride of the keys, and strides are sized by symbols too:
        # one that equals the rotary table's length, or any size above, would tie them.
        dim, rows = self.model.config.head_dim, self.model.rope(cached + length, weight.device).shape[0]
        sizes = {cached + length, cached + length - 2, length, length - 1, count, count - 1, rows, dim}
        slots = cached + length + 1
        while slots * dim in sizes or slots in sizes or slots * dim * self.model.config.num_kv_heads in sizes:
            slots += 1
        cache = KVCache(self.model.config, 1, slots, dtype=weight.dtype, device=weight.device)
        span = torch.arange(2, 2 + length, device=weight.device) % self.model.config.vocab_size
        started = time.perf_counter()
        for extra in (0, 1):  # the second call runs the graph the first compiled
            cache.lengths.fill_(cached - extra)
            self(span[: length - extra], cached - extra, cache, torch.arange(count - extra, device=weight.device)[None])
        self.compile_seconds = time.perf_counter() - started
        log.info("compiled the block step (%s) in %.1f s", self.backend, self.compile_seconds)
        return self.compile_seconds


def warm_up_sizes(model: Transformer) -> tuple[int, int, int]:
    """(cached slots, span tokens, read positions) to compile with. The compiler takes two
    inputs that happen to be the same size for one symbol (duck sizing) and would compile again
    for every step that breaks the coincidence, so the span (T), the read positions (K) and the
    slots read (S = cached + T), in both warm-up calls (T - 1, K - 1, S - 2), are each a size
    no other of them has, no model dimension has, and neither 0 nor 1."""
    c = model.config
    taken = {0, 1, 2, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
             c.num_heads // c.num_kv_heads, c.num_heads + 2 * c.num_kv_heads, max(c.max_position, 1)}
    free = [n for n in range(5, 10_000) if not {n, n - 1, n - 2} & taken]
    count = free[0]
    length = next(n for n in free if n - 1 > count)
    slots = next(n for n in free if n - 2 > length)
    return slots - length, length, count
