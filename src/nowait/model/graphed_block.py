"""The diffusion block step of one row with static shapes, replayed as CUDA Graphs.

The real-time path's diffusion step (one request, dual cache) forwards a span of a few dozen
tokens after the row's cached slots, every step of every block: on a GPU, kernel launches,
as the AR decode step (`nowait.model.graphed_step`; dInfer replays its diffusion steps the
same way). A graph replays fixed shapes and fixed memory, while the engine's caches differ
from request to request and the span, the read positions and the cached slots change from
step to step. So the step runs on a staging cache the graph owns: the row's cached slots are
copied in (one copy for all layers of the engine's `SlotCache`), the span is padded to a
bucket of tokens, the read positions to a bucket of reads, the keys to a bucket of slots with
a mask past the real ones, and the span's keys and values are copied back after the replay.

`static_span_logits` gives `span_logits`' numbers (nowait.model.compiled_block) up to float
rounding; on the CPU `GraphedBlock` runs it eagerly on the same staging (for tests; the CPU
engine never turns it on).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from nowait.model.graphed_step import bucket, capture_checked, graph_memory_pool, slot_buckets
from nowait.model.kv_cache import KVCache
from nowait.model.transformer import Transformer, mlp_residual, rotated_qkv

log = logging.getLogger(__name__)

# Span tokens and read positions: a step's span is a block or less, a refresh's the whole window;
# powers of two keep the graphs few (a span longer than the last is run eagerly as it is).
SPAN_BUCKETS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)


def static_span_logits(model: Transformer, tokens: Tensor, positions: Tensor, rope: Tensor, keys: list[Tensor],
                       values: list[Tensor], outputs: Tensor, bounds: Tensor) -> Tensor:
    """Logits [K, vocab] at span offsets `outputs` [K] after feeding `tokens` [T] at
    `positions` [T], the span's keys and values written at slots bounds[0] + [0, T).

    `keys`/`values`: each layer's staging, [kv_heads, S, head_dim], S >= bounds[0] + T. The
    span attends to slots [0, bounds[1]) (the cached ones and its real tokens; padding tokens
    past them are written, never read). As the model's forward, the last layer computes
    queries, attention output and MLP at the read positions only."""
    config = model.config
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    length, slots = tokens.shape[0], keys[0].shape[1] if keys else 0
    group = heads // kv_heads
    written = bounds[0] + torch.arange(length, device=tokens.device)
    # An additive mask over the slots, one for every query (the span attends as a whole): with a
    # mask and grouped heads scaled_dot_product_attention copies the keys per query head, so the
    # query heads sharing a key head are rows of one matrix product instead (as the AR decode's).
    bias = torch.zeros(slots, dtype=torch.float32, device=tokens.device)
    bias = bias.masked_fill_(torch.arange(slots, device=tokens.device) >= bounds[1], float("-inf"))
    table = rope[positions]  # [T, 2, D]
    cos, sin = table[:, 0:1], table[:, 1:2]
    x = F.embedding(tokens, model.embed_tokens.weight)  # [T, hidden]
    last = len(model.layers) - 1
    for index, (layer, layer_keys, layer_values) in enumerate(zip(model.layers, keys, values, strict=True)):
        attn = layer.self_attn
        qk, v = rotated_qkv(layer, x, cos, sin)  # [T, heads + kv_heads, D], [T, kv_heads, D]
        layer_keys[:, written] = qk[:, heads:].transpose(0, 1).to(layer_keys.dtype)
        layer_values[:, written] = v.transpose(0, 1).to(layer_values.dtype)
        q = qk[:, :heads]
        if index == last:  # position-wise from here on: only the read rows
            q, x = q[outputs], x[outputs]
        rows = q.shape[0]
        grouped = q.transpose(0, 1).reshape(kv_heads, group * rows, dim)  # head h reads key head h // group
        scores = torch.baddbmm(bias.to(q.dtype), grouped, layer_keys.to(q.dtype).transpose(1, 2), alpha=dim**-0.5)
        out = torch.bmm(scores.softmax(-1), layer_values.to(q.dtype)).reshape(heads, rows, dim)
        x = x + F.linear(out.transpose(0, 1).reshape(rows, heads * dim), attn.o_proj.weight)
        x = mlp_residual(layer, x)
    if not model.layers:
        x = x[outputs]
    return F.linear(model.norm(x), model.output_weight())


class _Graph:
    """One (span, reads, slots) bucket: its input buffers, and its graph once captured."""

    def __init__(self, span: int, reads: int, device: torch.device) -> None:
        self.tokens = torch.zeros(span, dtype=torch.long, device=device)
        self.positions = torch.zeros(span, dtype=torch.long, device=device)
        self.outputs = torch.zeros(reads, dtype=torch.long, device=device)
        self.bounds = torch.zeros(2, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None


class GraphedBlock:
    """The block step of one row (the call of `CompiledBlock`), on a staging cache, one CUDA
    Graph per (span bucket, read bucket, slot bucket), captured the first time it is needed.

    `capture`: record graphs (default: when the model is on a CUDA device); without, the same
    static step runs eagerly. When a graph's first replay disagrees with the eager step, or its
    capture fails, that call returns the eager step's numbers and `failed` is set: the engine
    then runs its own forward. A span or a read count past the last bucket runs eagerly."""

    def __init__(self, model: Transformer, capture: bool | None = None) -> None:
        if model.config.causal:
            raise ValueError("a graphed block step needs a bidirectional (diffusion) model")
        weight = model.output_weight()
        self.model = model
        self.device = weight.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA Graphs need a CUDA device; this model is on {self.device}")
        self.dtype = weight.dtype
        self.failed = False
        self.staging: Tensor | None = None  # [layers, 2, kv_heads, slots, head_dim], grown on demand
        # Room for a padded span past the last position, so the table is not regrown (which drops the graphs).
        self.rope = model.rope(model.config.max_position + SPAN_BUCKETS[-1], self.device)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        # One pool for all the graphs, as `GraphedDecode`'s (outputs copied out at once).
        self._memory_pool = graph_memory_pool(self.device) if self.capture else None

    @property
    def captured_graphs(self) -> int:
        return sum(entry.graph is not None for entry in self.graphs.values())

    @torch.inference_mode()
    def __call__(self, span: Tensor, start: int, cache: KVCache, outputs: Tensor) -> Tensor:
        """Logits [1, K, vocab] at offsets `outputs` [1, K] of `span` [T] (its first token at
        absolute position `start`), attending to the cache's one row's cached slots and to
        itself; the span's keys and values written after the cached slots and `cache.lengths`
        advanced by T, as `CompiledBlock` does."""
        if cache.batch != 1:
            raise ValueError(f"a graphed block step forwards one row; this cache holds {cache.batch}")
        cached, length, count = int(cache.lengths[0]), span.shape[0], outputs.shape[-1]
        if cached + length > cache.max_tokens:
            raise ValueError(f"KV cache holds {cache.max_tokens} tokens; this forward needs more")
        longest = SPAN_BUCKETS[-1]
        if length > longest or count > longest:  # no bucket: this one forward eagerly, as it is
            span_bucket, reads = length, max(count, 1)
        else:
            span_bucket, reads = bucket(length, SPAN_BUCKETS, longest), bucket(max(count, 1), SPAN_BUCKETS, longest)
        needed = cached + span_bucket
        limit = max(needed, self.model.config.max_position)
        slots = bucket(needed, slot_buckets(limit), limit)
        self._stage(cache, cached, slots, cache.max_tokens + SPAN_BUCKETS[-1])
        if start + span_bucket > self.rope.shape[0]:  # a longer table: the graphs read the old one
            self.rope, self.graphs = self.model.rope(start + span_bucket, self.device), {}
        key = (span_bucket, reads, slots)
        entry = self.graphs.get(key)
        if entry is None:
            entry = _Graph(span_bucket, reads, self.device)
            if span_bucket <= longest and reads <= longest:
                self.graphs[key] = entry
        entry.tokens[:length] = span
        entry.tokens[length:] = span[-1]  # padding: any id, written past the real slots, never read
        entry.positions.copy_(torch.arange(start, start + span_bucket, device=self.device))
        read = outputs.reshape(-1)
        entry.outputs[:count] = read
        entry.outputs[count:] = read[0] if count else 0
        entry.bounds[0], entry.bounds[1] = cached, cached + length
        logits = self._run(entry, slots, graphed=key in self.graphs)[:count]
        self._unstage(cache, cached, length)
        cache.lengths = cache.lengths + length
        return logits[None]

    def _stage(self, cache: KVCache, cached: int, slots: int, room: int) -> None:
        """The row's cached slots into the staging. Grown when short (the graphs read the old
        one: dropped), to `room` slots at once (the cache's, and a padded span past them), so
        that a request's later steps do not grow it again."""
        c = self.model.config
        if self.staging is None or self.staging.shape[3] < slots:
            size = max(slots, room)
            self.staging = torch.zeros((c.num_layers, 2, c.num_kv_heads, size, c.head_dim), dtype=self.dtype,
                                       device=self.device)
            self.graphs = {}
        storage = getattr(cache, "storage", None)  # a SlotCache: every layer in one tensor
        if storage is not None:
            self.staging[:, :, :, :cached] = storage[:, :, 0, :, :cached]
            return
        for layer, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            self.staging[layer, 0, :, :cached] = keys[0, :, :cached]
            self.staging[layer, 1, :, :cached] = values[0, :, :cached]

    def _unstage(self, cache: KVCache, cached: int, length: int) -> None:
        """The span's keys and values from the staging into the row's slots after its cached ones."""
        end = cached + length
        storage = getattr(cache, "storage", None)
        if storage is not None:
            storage[:, :, 0, :, cached:end] = self.staging[:, :, :, cached:end]
            return
        for layer, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            keys[0, :, cached:end] = self.staging[layer, 0, :, cached:end]
            values[0, :, cached:end] = self.staging[layer, 1, :, cached:end]

    def _inputs(self, entry: _Graph, slots: int) -> tuple:
        staged = self.staging[:, :, :, :slots]
        keys = [staged[layer, 0] for layer in range(staged.shape[0])]
        values = [staged[layer, 1] for layer in range(staged.shape[0])]
        return (self.model, entry.tokens, entry.positions, self.rope, keys, values, entry.outputs, entry.bounds)

    def _run(self, entry: _Graph, slots: int, graphed: bool) -> Tensor:
        if not self.capture or not graphed:
            return static_span_logits(*self._inputs(entry, slots))
        if entry.graph is not None:
            with torch.cuda.device(self.device):
                entry.graph.replay()
            return entry.output.clone()  # the graph's output buffer: the next replay overwrites it
        what = f"the block step ({entry.tokens.shape[0]} tokens, {entry.outputs.shape[0]} reads, {slots} slots)"
        graph, output, eager = capture_checked(static_span_logits, self._inputs(entry, slots), self._memory_pool,
                                               self.device, what)
        if graph is None:
            self.failed = True
            return eager
        entry.graph, entry.output = graph, output
        return output.clone()
