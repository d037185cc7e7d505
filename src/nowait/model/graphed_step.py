"""The AR decode step over the cache pool with static shapes, replayed as CUDA Graphs.

On a GPU a decode step of a small batch is kernel launches, not arithmetic: a few hundred
kernels, each a few microseconds of CPU to launch, for a step whose math takes less. A CUDA
Graph records the step's kernels once and replays them with one launch (the technique vLLM
and SGLang use for decode, and dInfer for diffusion steps). A graph replays fixed shapes and
fixed memory, so `static_decode_logits` is the step written for that: rows [0, B) of the
engine's cache pool (which never moves), B from a few batch buckets (rows past the running
ones are padding, their writes land in free rows), keys read up to a bucket of S slots with a
mask instead of exactly each row's length, the new keys and values written at each row's
position by index (no slice whose bounds are host numbers), and no host read or branch on
the data. Token ids and positions come in through preallocated buffers that each replay reads.

The same numbers as `Transformer.forward` up to float rounding (tests compare on the CPU,
where the same static function runs eagerly). `GraphedDecode` captures on CUDA only; on the
CPU it runs the function as it is (for tests; the CPU engines never turn it on: a CPU has no
launch cost to save, and the padded shapes only add work).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from nowait.model.attention import ragged_decode_attention
from nowait.model.kv_cache import KVCache
from nowait.model.transformer import Transformer, mlp_residual, rotated_qkv

log = logging.getLogger(__name__)

# vLLM captures decode graphs for batch sizes 1, 2, 4, 8 and then every 8; powers of two keep
# the count of graphs (batch buckets x slot buckets) small at a padding cost under 2x.
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SMALLEST_SLOT_BUCKET = 64


def bucket(size: int, buckets: Sequence[int], cap: int) -> int:
    """The smallest of `buckets` that holds `size`, never above `cap` (the cap itself when
    none of them fits under it). `size` must be at most `cap`."""
    if not 0 < size <= cap:
        raise ValueError(f"size {size} outside (0, {cap}]")
    return next((b for b in buckets if size <= b <= cap), cap)


def slot_buckets(max_tokens: int) -> tuple[int, ...]:
    """Key lengths a step is compiled for: powers of two from 64, then the cache's size."""
    sizes, size = [], SMALLEST_SLOT_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_tokens)


def static_decode_logits(model: Transformer, tokens: Tensor, positions: Tensor, rope: Tensor,
                         keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Logits [B, vocab] after feeding `tokens[b]` [B] at `positions[b]` [B] to row b.

    `keys`/`values`: each layer's cache rows, [B, kv_heads, S, head_dim], S > every position;
    the new key and value are written at slot `positions[b]` of row b and the row attends to
    slots [0, positions[b]]. `rope`: `Model.rope`'s table, at least S rows."""
    config = model.config
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    batch, slots = tokens.shape[0], keys[0].shape[2] if keys else 0
    rows = torch.arange(batch, device=tokens.device)
    # An additive mask [B * kv_heads, group, S] for `ragged_decode_attention`, the eager decode's
    # kernel: scaled_dot_product_attention with a mask and grouped heads copies the keys and values
    # per query head (no fused kernel takes both), which at 64 rows was most of a step.
    visible = torch.arange(slots, device=tokens.device)[None] <= positions[:, None]  # [B, S]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=tokens.device).masked_fill_(~visible, float("-inf"))
    bias = bias[:, None, None].expand(batch, kv_heads, heads // kv_heads, slots).reshape(-1, heads // kv_heads, slots)
    table = rope[positions]  # [B, 2, D]: each row's cos and signed sin
    cos, sin = table[:, 0:1], table[:, 1:2]
    x = F.embedding(tokens, model.embed_tokens.weight)  # [B, hidden]
    for layer, layer_keys, layer_values in zip(model.layers, keys, values, strict=True):
        attn = layer.self_attn
        qk, v = rotated_qkv(layer, x, cos, sin)  # [B, heads + kv_heads, D], [B, kv_heads, D]
        # keys[rows, :, positions] is [B, kv_heads, D]: the advanced indices' dimension first.
        layer_keys[rows, :, positions] = qk[:, heads:].to(layer_keys.dtype)
        layer_values[rows, :, positions] = v.to(layer_values.dtype)
        q = qk[:, None, :heads]  # [B, 1, heads, D]
        out = ragged_decode_attention(q, layer_keys.to(q.dtype), layer_values.to(q.dtype), bias)
        x = x + F.linear(out.reshape(batch, heads * dim), attn.o_proj.weight)
        x = mlp_residual(layer, x)
    return F.linear(model.norm(x), model.output_weight())


class GraphedDecode:
    """Decode steps over the first rows of `cache` (an engine's pool), one CUDA Graph per
    (batch bucket, slot bucket), captured the first time that pair is needed.

    `capture`: record graphs (default: when the cache is on a CUDA device). Without, each call
    runs `static_decode_logits` eagerly on the same buckets: what the CPU tests compare. Each
    new graph's first replay is checked against an eager run of the same step on the same
    inputs; when it disagrees, or the capture fails, that call returns the eager step's numbers
    and `failed` is set: the engine then runs its own forward (`ModelRunner.forward_rows`)."""

    def __init__(self, model: Transformer, cache: KVCache, capture: bool | None = None,
                 batch_buckets: Sequence[int] = BATCH_BUCKETS) -> None:
        if not model.config.causal:
            raise ValueError("a graphed decode step needs a causal (AR) model")
        device = cache.keys[0].device if cache.keys else cache.lengths.device
        self.model = model
        self.cache = cache
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA Graphs need a CUDA device; this cache is on {device}")
        self.failed = False
        self.batch_buckets = tuple(batch_buckets)
        self.slot_buckets = slot_buckets(cache.max_tokens)
        # Inputs every replay reads: written in place before each one.
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(cache.batch, dtype=torch.long, device=device)
        # Held here: a graph reads the table's memory, which a later, longer `model.rope`
        # call would otherwise replace and free.
        self.rope = model.rope(cache.max_tokens, device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        # One memory pool for all the graphs, replayed in any order: safe because no graph reads
        # memory it wrote in an earlier replay (its temporaries are written before they are read,
        # and its output is copied out before another graph runs); the cache is outside the pool.
        self._memory_pool = graph_memory_pool(device) if self.capture else None

    @property
    def captured_graphs(self) -> int:
        return len(self.graphs)

    @torch.no_grad()
    def warm_up(self) -> int:
        """Run (on CUDA: capture) the step at every bucket the cache allows, before any request
        does: a capture on first use costs that request a warm-up and a synchronize. Only for
        a pool no sequence holds yet: every bucket's rows write slot 0. Returns the buckets run."""
        batches = sorted({bucket(b, self.batch_buckets, self.cache.batch) for b in range(1, self.cache.batch + 1)})
        self.tokens.zero_()
        self.positions.zero_()
        for batch in batches:
            for slots in self.slot_buckets:
                if self.failed:
                    return 0
                self._run(batch, slots)
        return len(batches) * len(self.slot_buckets)

    def buckets(self, rows: int, longest: int) -> tuple[int, int]:
        """(batch, slots) a step over `rows` rows whose longest holds `longest` keys runs at."""
        return (bucket(rows, self.batch_buckets, self.cache.batch),
                bucket(longest, self.slot_buckets, self.cache.max_tokens))

    @torch.no_grad()
    def __call__(self, tokens: list[int], view: KVCache, longest: int | None = None) -> Tensor:
        """Logits [rows, 1, vocab] for `tokens[r]` fed to row r of `view` (the pool's first
        rows); `view.lengths` advanced by one, as the model's forward does. `longest`: the most
        keys a row holds after this step, when the caller knows it (else read from the
        lengths: one host sync). It must be right: a slot bucket too small for a row would
        write past it (checked here on a CPU, where the check costs no sync)."""
        rows = len(tokens)
        if rows != view.batch:
            raise ValueError(f"{rows} tokens for a view of {view.batch} rows")
        if longest is None or self.device.type == "cpu":
            actual = int(view.lengths.max()) + 1
            if longest is not None and longest < actual:
                raise ValueError(f"longest is {longest}; a row holds {actual} keys after this step")
            longest = actual
        if longest > self.cache.max_tokens:
            raise ValueError(f"KV cache holds {self.cache.max_tokens} tokens; this step needs {longest}")
        batch, slots = self.buckets(rows, longest)
        self.tokens[:rows].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.tokens[rows:batch].zero_()
        self.positions[:rows].copy_(view.lengths)
        self.positions[rows:batch].zero_()  # padding rows write slot 0 of a free row
        logits = self._run(batch, slots)[:rows]
        view.lengths = view.lengths + 1
        return logits[:, None]

    def _inputs(self, batch: int, slots: int) -> tuple:
        keys = [k[:batch, :, :slots] for k in self.cache.keys]
        values = [v[:batch, :, :slots] for v in self.cache.values]
        return self.model, self.tokens[:batch], self.positions[:batch], self.rope, keys, values

    def _run(self, batch: int, slots: int) -> Tensor:
        if not self.capture:
            return static_decode_logits(*self._inputs(batch, slots))
        found = self.graphs.get((batch, slots))
        if found is not None:
            with torch.cuda.device(self.device):
                found[0].replay()
            return found[1].clone()  # the graph's output buffer: the next replay overwrites it
        graph, output, eager = capture_checked(static_decode_logits, self._inputs(batch, slots), self._memory_pool,
                                               self.device, f"the decode step (batch {batch}, {slots} slots)")
        if graph is None:
            self.failed = True
            return eager
        self.graphs[(batch, slots)] = (graph, output)
        return output.clone()


# One capture at a time in the process: a capture in one engine's thread while another thread
# captures too would record into the wrong graph.
_CAPTURE_LOCK = threading.Lock()


def graph_memory_pool(device: torch.device) -> object:
    with torch.cuda.device(device):
        return torch.cuda.graph_pool_handle()


def capture_checked(step: Callable[..., Tensor], inputs: tuple, memory_pool: object, device: torch.device,
                    what: str) -> tuple[torch.cuda.CUDAGraph | None, Tensor, Tensor]:
    """(graph, its output buffer, the eager output) of `step(*inputs)` recorded as a CUDA Graph
    on `device` and replayed once; graph None (logged) when the capture fails or the replay
    disagrees with the eager run. The step's writes into caches are the same numbers each time,
    so running it eagerly, then replaying it, leaves them as one step would.

    The capture runs in `thread_local` mode: the gateway drives each engine from its own
    thread, and in the default (global) mode another engine's allocation or sync during the
    capture would fail it. The output buffer is filled with NaN before the checking replay, so
    a graph that recorded nothing (a capture on another device than the tensors') fails the
    check instead of returning the eager run's numbers left in the buffer."""
    with _CAPTURE_LOCK, torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (lazy library init, workspaces)
            for _ in range(2):
                eager = step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool, capture_error_mode="thread_local"):
                output = step(*inputs)
            output.fill_(float("nan"))
            graph.replay()
        except RuntimeError as error:
            log.warning("capturing %s as a CUDA Graph failed (%s); the engine runs it eagerly", what, error)
            return None, eager, eager
        tolerance = 1e-3 if output.dtype == torch.float32 else 3e-2  # 16-bit logits round at the 3rd digit
        if not torch.allclose(output.float(), eager.float(), rtol=tolerance, atol=tolerance):
            log.warning("a CUDA Graph of %s disagrees with the eager step; the engine runs it eagerly", what)
            return None, output, eager
        log.info("captured %s as a CUDA Graph", what)
        return graph, output, eager
