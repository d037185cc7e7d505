"""One decode step of one sequence as a compiled graph (torch.compile, inductor).

A batch-1 decode step of a small model is per-operation overhead, not arithmetic: eager PyTorch
dispatches some two hundred operations (and runs the forward's Python planning) for a few
MFLOP. `one_token_logits` is that step written for the compiler: one row, one new token, no
mask (the keys read are exactly the row's cached ones and the new one), no host reads and no
branch on the data, so inductor fuses the norms, the rotary and the SwiGLU into a few kernels
around the matmuls. The number of cached keys is the one size that changes from step to step;
it is compiled as a symbol (dynamic shapes), so the step compiles once, not once per length
(no padding to buckets either, so no step reads keys it then masks out).

The same numbers as `Transformer.forward` up to float rounding (a fused kernel sums in
another order); `CompiledDecode` is what `EngineConfig.compile_decode` switches on in the AR
engine. On a GPU this graph is what a CUDA-graph capture records (mode "reduce-overhead").
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from nowait.model.kv_cache import KVCache
from nowait.model.transformer import Transformer, mlp_residual, rotated_qkv

log = logging.getLogger(__name__)


def one_token_logits(model: Transformer, token: Tensor, position: Tensor, rope: Tensor,
                     keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Logits [1, vocab] after feeding `token` [1] at `position` [1] (the row's cached length).

    `keys`/`values`: each layer's cache for the row, [kv_heads, position + 1, head_dim] (views
    into the cache ending at the new slot, which this writes); `rope`: `Model.rope`'s table.
    Every slot read is valid, so attention needs no mask; the query heads sharing a key head are
    rows of one matrix product (as `ragged_decode_attention` does), reading the cache in place."""
    config = model.config
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    table = rope[position]  # [1, 2, D]: the token's cos and signed sin
    cos, sin = table[:, 0:1], table[:, 1:2]
    x = F.embedding(token, model.embed_tokens.weight)  # [1, hidden]
    for layer, layer_keys, layer_values in zip(model.layers, keys, values, strict=True):
        attn = layer.self_attn
        qk, v = rotated_qkv(layer, x, cos, sin)
        qk = qk[0]  # [heads + kv_heads, D]
        layer_keys[:, -1:] = qk[heads:, None].to(layer_keys.dtype)
        layer_values[:, -1:] = v[0, :, None].to(layer_values.dtype)
        grouped = qk[:heads].reshape(kv_heads, heads // kv_heads, dim)
        scores = torch.bmm(grouped, layer_keys.to(grouped.dtype).transpose(1, 2)) * dim**-0.5
        out = torch.bmm(scores.softmax(-1), layer_values.to(grouped.dtype)).reshape(1, heads * dim)
        x = x + F.linear(out, attn.o_proj.weight)
        x = mlp_residual(layer, x)
    return F.linear(model.norm(x), model.output_weight())


def compile_for_one_model(step: Callable[..., Tensor], backend: str | Callable, tag: str) -> Callable[..., Tensor]:
    """`step` (a function of a model and tensors) under torch.compile, with dynamic shapes and
    no graph breaks, for one caller that only ever passes it one model.

    The compiler keeps its compiled graphs per code object, so each caller compiles a copy of
    its own (`tag` names it): no graph is looked up for another model (nor counts against the
    compiler's limit of graphs per function), and the guards on the model's modules can be left
    out, since the copy only ever sees that one model: 0.3-0.5 ms less a decode step, measured.
    With inductor, its C++ wrapper runs the graph's buffer and view bookkeeping (about a hundred
    calls) outside Python: 0.2-0.4 ms less a step, for a longer first compile."""
    code = step.__code__.replace(co_name=f"{step.__name__}_{tag}")
    own = types.FunctionType(code, step.__globals__, code.co_name)
    options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if backend == "inductor":
        options["cpp_wrapper"] = True
    return torch.compile(own, backend=backend, dynamic=True, fullgraph=True, options=options)


class CompiledDecode:
    """`one_token_logits` compiled once for `model`, called on a one-row `KVCache`.

    `backend`: torch.compile's ("inductor" generates fused C++/Triton kernels; "eager" runs the
    same graph uncompiled, for tests of the plumbing). The first call compiles (seconds to a
    minute on a CPU: `warm_up` does it up front and returns the time it took)."""

    def __init__(self, model: Transformer, backend: str | Callable = "inductor") -> None:
        if not model.config.causal:
            raise ValueError("a compiled decode step needs a causal (AR) model")
        self.model = model
        self.backend = backend
        self.compile_seconds: float | None = None
        self._step = compile_for_one_model(one_token_logits, backend, tag=f"{id(self):x}")

    @torch.no_grad()
    def __call__(self, token: int, cache: KVCache) -> Tensor:
        """Logits [1, 1, vocab] for `token` after the cache's one row; the token's keys and
        values written after the row's cached ones and `cache.lengths` replaced (as the model's
        forward does)."""
        if cache.batch != 1:
            raise ValueError(f"a compiled decode step feeds one row; this cache holds {cache.batch}")
        cached = int(cache.lengths[0])
        if cached + 1 > cache.max_tokens:
            raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
        device = cache.lengths.device
        keys = [k[0, :, : cached + 1] for k in cache.keys]
        values = [v[0, :, : cached + 1] for v in cache.values]
        rope = self.model.rope(cache.max_tokens, device)
        position = cache.lengths[:1]
        logits = self._step(self.model, torch.tensor([token], device=device), position, rope, keys, values)
        cache.lengths = cache.lengths + 1
        return logits[None]

    def warm_up(self) -> float:
        """Compile now, on a scratch cache: the seconds it took, also kept in `compile_seconds`."""
        weight = self.model.output_weight()
        first = warm_up_length(self.model)
        cache = KVCache(self.model.config, 1, first + 2, dtype=weight.dtype, device=weight.device)
        started = time.perf_counter()
        for filled in (first - 1, first):  # the second call runs the graph the first compiled
            cache.lengths.fill_(filled)
            self(0, cache)
        self.compile_seconds = time.perf_counter() - started
        log.info("compiled the decode step (%s) in %.1f s", self.backend, self.compile_seconds)
        return self.compile_seconds


def warm_up_length(model: Transformer) -> int:
    """A number of keys to compile with that equals no other size the step sees (and is not 0
    or 1): the compiler takes two inputs that happen to be the same size for the same symbol
    (duck sizing) and would then compile again for every length that breaks the coincidence."""
    c = model.config
    taken = {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
             c.num_heads // c.num_kv_heads, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, 2 * c.intermediate_size,
             c.num_heads * c.head_dim, max(c.max_position, 1)}
    length = 5
    while length in taken or length - 1 in taken:
        length += 1
    return length
