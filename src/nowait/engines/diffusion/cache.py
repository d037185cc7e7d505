"""Forward passes over rows of different lengths, and the KV-cache surgery the cache modes need.

Every row of a diffusion batch forwards one contiguous span of its sequence (prompt + answer
window) starting at an absolute position; the rest of the sequence, if any, is in the row's
cache slots. Spans are right-padded into one batch, their rotary positions given explicitly, so
a row's cache may hold a prefix and a suffix around the span (the dual cache).

The engine's caches are `SlotCache`s: every layer's keys and values are views of one tensor,
so the surgery of the cache modes (moving a row's slots, taking and putting rows) is one copy
for all layers instead of two per layer, and an engine's storage is kept from one request to
the next (`CacheStorage`) instead of being allocated and zeroed for each.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from nowait.model import KVCache, Transformer


class SlotCache(KVCache):
    """A KV cache whose layers are views of one tensor [layers, 2 (keys, values), batch,
    kv_heads, slots, head_dim]: the model reads and writes `keys[layer]` / `values[layer]` as
    usual, and the engine moves slots in every layer with one operation on `storage`."""

    def __init__(self, storage: Tensor, lengths: Tensor) -> None:
        # KVCache.__init__ is not called: it would allocate per-layer tensors this class replaces.
        self.storage = storage
        # One view per layer by indexing, not `unbind`: a view of a multi-view function may not be
        # written in place with grad mode on (a test, or a caller outside the engine's no_grad).
        self.keys = [storage[layer, 0] for layer in range(storage.shape[0])]
        self.values = [storage[layer, 1] for layer in range(storage.shape[0])]
        self.lengths = lengths
        self.max_tokens = storage.shape[4]

    def view(self, start: int, rows: int) -> SlotCache:
        return SlotCache(self.storage[:, :, start: start + rows], self.lengths[start: start + rows])

    def select(self, rows: Tensor) -> None:
        self.__init__(self.storage[:, :, rows], self.lengths[rows])


def _storage_shape(model: Transformer, batch: int, capacity: int) -> tuple[int, ...]:
    c = model.config
    return (c.num_layers, 2, batch, c.num_kv_heads, capacity, c.head_dim)


SLOT_BUCKET = 64  # a cache's slots are rounded up to this, so the next request's cache has the same shape


class CacheStorage:
    """An engine's cache memory, kept between requests: a request alone (the real-time case)
    gets the same tensor back, zeroed, instead of eight fresh ones. The slots are rounded up
    to `SLOT_BUCKET` so that prompts of different lengths share one shape (slots past a row's
    length are never read). Only a cache nothing reads any more is handed out again."""

    def __init__(self) -> None:
        self._free: Tensor | None = None
        self._lock = threading.Lock()  # an engine may be called from several threads

    def cache(self, model: Transformer, batch: int, capacity: int) -> SlotCache:
        shape = _storage_shape(model, batch, -(-capacity // SLOT_BUCKET) * SLOT_BUCKET)
        weight = model.output_weight()
        with self._lock:
            free, self._free = self._free, None
        if free is not None and free.shape == shape and free.dtype == weight.dtype and free.device == weight.device:
            storage = free.zero_()
        else:
            storage = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        return SlotCache(storage, torch.zeros(batch, dtype=torch.long, device=weight.device))

    def release(self, cache: KVCache | None) -> None:
        """Hand a cache's memory back once nothing reads it (its rows are done)."""
        if isinstance(cache, SlotCache) and cache.storage.is_contiguous():
            with self._lock:
                self._free = cache.storage


def pad_spans(spans: list[Tensor], starts: list[int], pad_id: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """ids [B, T] (right-padded), valid lengths [B] (None for one row: nothing is padded),
    absolute positions [B, T]."""
    device = spans[0].device
    if len(spans) == 1:  # one row (the real-time case): no padding to write, no copy
        return spans[0][None], None, torch.arange(starts[0], starts[0] + len(spans[0]), device=device)[None]
    width = max(len(span) for span in spans)
    ids = torch.full((len(spans), width), pad_id, dtype=torch.long, device=device)
    for row, span in enumerate(spans):
        ids[row, : len(span)] = span
    valid = torch.tensor([len(span) for span in spans], device=device)
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)
    return ids, valid, positions


def forward_spans(model: Transformer, spans: list[Tensor], starts: list[int], pad_id: int,
                  cache: KVCache | None = None, write: bool = False, outputs: Tensor | None = None,
                  isolated_prefix: int = 0) -> Tensor:
    """Logits [B, T, vocab] of each row's span, or [B, K, vocab] at `outputs` [B, K] (offsets
    into each span: only the positions a step decides are projected onto the vocabulary).

    No cache: the spans are whole sequences (start 0), attended bidirectionally. With a cache:
    each span attends to its row's cached slots and to itself; `write` also stores its keys and
    values after the row's cached slots (the caller sets `cache.lengths` afterwards).
    `isolated_prefix` (one span, written): its first that many tokens attend only to the cache
    and themselves, the prompt of a first forward that is also the window's refresh.
    """
    # One row has no padding (valid None): the model takes its unmasked, slice-written path.
    ids, valid, positions = pad_spans(spans, starts, pad_id)
    if cache is None:
        return model(ids, valid_lengths=valid, output_positions=outputs)
    # The positions' end is known here, from the host's starts: the model need not read it.
    return model(ids, cache, valid_lengths=valid, write_cache=write, positions=positions, output_positions=outputs,
                 isolated_prefix=isolated_prefix, positions_end=max(starts) + ids.shape[1])


def output_window(firsts: list[int], counts: list[int], device: torch.device) -> Tensor:
    """[B, max(counts)] span offsets first, first + 1, ... of each row (a row with fewer repeats
    its first offset; those logits are never read)."""
    if len(firsts) == 1:
        return torch.arange(firsts[0], firsts[0] + counts[0], device=device)[None]
    width = max(counts, default=0)
    offsets = torch.arange(width, device=device)[None, :]
    first = torch.tensor(firsts, device=device)[:, None]
    return torch.where(offsets < torch.tensor(counts, device=device)[:, None], first + offsets, first)


def empty_cache(model: Transformer, batch: int, capacity: int, storage: CacheStorage | None = None) -> SlotCache:
    if storage is not None:
        return storage.cache(model, batch, capacity)
    weight = model.output_weight()
    zeros = torch.zeros(_storage_shape(model, batch, capacity), dtype=weight.dtype, device=weight.device)
    return SlotCache(zeros, torch.zeros(batch, dtype=torch.long, device=weight.device))


def prefill(model: Transformer, prefixes: list[Tensor], capacity: int, pad_id: int,
            one_by_one: bool = False, storage: CacheStorage | None = None) -> SlotCache:
    """A cache of the given prefixes (the prompts' keys/values, computed once).

    An empty prefix stays out of the forward: a row with no valid key would attend to nothing
    and write NaN keys that later poison its masked-out slots. `one_by_one`: a forward per
    prefix, each through a view of its row (unpadded, unmasked), instead of one padded forward.
    """
    cache = empty_cache(model, len(prefixes), capacity, storage)
    rows = [row for row, prefix in enumerate(prefixes) if len(prefix)]
    if not rows:
        return cache
    if one_by_one:
        nothing = torch.zeros(1, 0, dtype=torch.long, device=cache.lengths.device)  # keys/values only
        for row in rows:
            forward_spans(model, [prefixes[row]], [0], pad_id, cache.view(row, 1), write=True, outputs=nothing)
    else:
        part = cache if len(rows) == len(prefixes) else empty_cache(model, len(rows), capacity)
        nothing = torch.zeros(len(rows), 0, dtype=torch.long, device=part.lengths.device)  # keys/values only
        forward_spans(model, [prefixes[row] for row in rows], [0] * len(rows), pad_id, part, write=True,
                      outputs=nothing)
        if part is not cache:
            put_rows(cache, rows, part, int(part.lengths.max()))
    cache.lengths = torch.tensor([len(p) for p in prefixes], device=cache.lengths.device)
    return cache


def _stores(*caches: KVCache) -> list[list[Tensor]]:
    """For each cache, tensors with the batch row first and the slot last but one: a
    `SlotCache`'s storage seen rows first (one copy moves every layer), or, for a plain
    `KVCache`, each layer's keys and values."""
    if all(isinstance(cache, SlotCache) for cache in caches):
        return [[cache.storage.transpose(0, 2)] for cache in caches]  # [batch, 2, layers, heads, slots, dim]
    return [[store for layer in range(len(cache.keys)) for store in (cache.keys[layer], cache.values[layer])]
            for cache in caches]


def take_rows(model: Transformer, cache: KVCache, rows: list[int], slots: int, capacity: int) -> KVCache:
    """A new cache holding the first `slots` slots of the given rows (a copy)."""
    part = empty_cache(model, len(rows), capacity)
    index = torch.tensor(rows, device=cache.lengths.device)
    for source, target in zip(*_stores(cache, part), strict=True):
        target[..., :slots, :] = source[index][..., :slots, :]
    part.lengths = cache.lengths[index].clone()
    return part


def put_rows(cache: KVCache, rows: list[int], part: KVCache, slots: int) -> None:
    """Copy the first `slots` slots of `part`'s rows back into `cache` rows `rows`."""
    index = torch.tensor(rows, device=cache.lengths.device)
    for target, source in zip(*_stores(cache, part), strict=True):
        target[index, ..., :slots, :] = source[..., :slots, :]
    cache.lengths[index] = part.lengths


def stack_caches(model: Transformer, first: KVCache | None, second: KVCache, capacity: int,
                 storage: CacheStorage | None = None) -> KVCache:
    """Rows of `first` then rows of `second`, in a cache of `capacity` slots (requests joining)."""
    parts = [c for c in (first, second) if c is not None and c.batch]
    out = empty_cache(model, sum(p.batch for p in parts), capacity, storage)
    at = 0
    for part in parts:
        used = min(capacity, int(part.lengths.max()))
        for target, source in zip(*_stores(out, part), strict=True):
            target[at: at + part.batch, ..., :used, :] = source[..., :used, :]
        at += part.batch
    out.lengths = torch.cat([p.lengths for p in parts])
    return out


def keep_slot_runs(cache: KVCache, row: int, runs: list[tuple[int, int]]) -> None:
    """Keep only slots [start, stop) of each run of one row, in the order given, packed from
    slot 0; the row's length becomes their total.

    A bidirectional forward attends to every valid slot of its row whatever their order, and
    rotary positions were applied when the keys were written, so moving slots moves no
    positions: the cache modes rearrange a row's slots freely.
    """
    runs = [(start, stop) for start, stop in runs if stop > start]
    settled = 0  # leading runs already in place are not copied (the usual case: a short tail moves)
    while runs and runs[0][0] == settled:
        settled = runs.pop(0)[1]
    total = settled + sum(stop - start for start, stop in runs)
    [stores] = _stores(cache)
    if len(runs) == 1:  # one slice moves down (a copy first: source and destination may overlap)
        start, stop = runs[0]
        for store in stores:
            store[row, ..., settled:total, :] = store[row, ..., start:stop, :].clone()
    elif runs:
        index = torch.cat([torch.arange(start, stop, device=cache.lengths.device) for start, stop in runs])
        for store in stores:
            store[row, ..., settled:total, :] = store[row].index_select(-2, index)  # gathered first
    cache.lengths[row] = total


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """Slot indices as runs [start, stop) of consecutive slots, in the order given."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs


def cut_slots(cache: KVCache, row: int, start: int, stop: int, length: int) -> None:
    """Remove slots [start, stop) of one row, moving slots [stop, length) down to `start`.

    The dual cache keeps the prefix and the suffix of the current block contiguous, so one
    forward over the block reads both as an ordinary cached prefix.
    """
    keep_slot_runs(cache, row, [(0, start), (stop, max(stop, length))])
