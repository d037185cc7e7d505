"""Forward passes over rows of different lengths, and the KV-cache surgery the cache modes need.

Every row of a diffusion batch forwards one contiguous span of its sequence (prompt + answer
window) starting at an absolute position; the rest of the sequence, if any, is in the row's
cache slots. Spans are right-padded into one batch, their rotary positions given explicitly, so
a row's cache may hold a prefix and a suffix around the span (the dual cache).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nowait.model import KVCache, Transformer


def pad_spans(spans: list[Tensor], starts: list[int], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [B, T] (right-padded), valid lengths [B], absolute positions [B, T]."""
    device = spans[0].device
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
    ids, valid, positions = pad_spans(spans, starts, pad_id)
    if len(spans) == 1:
        valid = None  # one row has no padding: the model takes its unmasked, slice-written path
    if cache is None:
        return model(ids, valid_lengths=valid, output_positions=outputs)
    return model(ids, cache, valid_lengths=valid, write_cache=write, positions=positions, output_positions=outputs,
                 isolated_prefix=isolated_prefix)


def output_window(firsts: list[int], counts: list[int], device: torch.device) -> Tensor:
    """[B, max(counts)] span offsets first, first + 1, ... of each row (a row with fewer repeats
    its first offset; those logits are never read)."""
    width = max(counts, default=0)
    offsets = torch.arange(width, device=device)[None, :]
    first = torch.tensor(firsts, device=device)[:, None]
    return torch.where(offsets < torch.tensor(counts, device=device)[:, None], first + offsets, first)


def empty_cache(model: Transformer, batch: int, capacity: int) -> KVCache:
    weight = model.output_weight()
    return KVCache(model.config, batch, capacity, dtype=weight.dtype, device=weight.device)


def prefill(model: Transformer, prefixes: list[Tensor], capacity: int, pad_id: int,
            one_by_one: bool = False) -> KVCache:
    """A cache of the given prefixes (the prompts' keys/values, computed once).

    An empty prefix stays out of the forward: a row with no valid key would attend to nothing
    and write NaN keys that later poison its masked-out slots. `one_by_one`: a forward per
    prefix, each through a view of its row (unpadded, unmasked), instead of one padded forward.
    """
    cache = empty_cache(model, len(prefixes), capacity)
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


def take_rows(model: Transformer, cache: KVCache, rows: list[int], slots: int, capacity: int) -> KVCache:
    """A new cache holding the first `slots` slots of the given rows (a copy)."""
    part = empty_cache(model, len(rows), capacity)
    index = torch.tensor(rows, device=cache.lengths.device)
    for layer in range(len(cache.keys)):
        part.keys[layer][:, :, :slots] = cache.keys[layer][index, :, :slots]
        part.values[layer][:, :, :slots] = cache.values[layer][index, :, :slots]
    part.lengths = cache.lengths[index].clone()
    return part


def put_rows(cache: KVCache, rows: list[int], part: KVCache, slots: int) -> None:
    """Copy the first `slots` slots of `part`'s rows back into `cache` rows `rows`."""
    index = torch.tensor(rows, device=cache.lengths.device)
    for layer in range(len(cache.keys)):
        cache.keys[layer][index, :, :slots] = part.keys[layer][:, :, :slots]
        cache.values[layer][index, :, :slots] = part.values[layer][:, :, :slots]
    cache.lengths[index] = part.lengths


def stack_caches(model: Transformer, first: KVCache | None, second: KVCache, capacity: int) -> KVCache:
    """Rows of `first` then rows of `second`, in a cache of `capacity` slots (requests joining)."""
    parts = [c for c in (first, second) if c is not None and c.batch]
    out = empty_cache(model, sum(p.batch for p in parts), capacity)
    at = 0
    for part in parts:
        used = min(capacity, int(part.lengths.max()))
        for layer in range(len(out.keys)):
            out.keys[layer][at: at + part.batch, :, :used] = part.keys[layer][:, :, :used]
            out.values[layer][at: at + part.batch, :, :used] = part.values[layer][:, :, :used]
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
    if len(runs) == 1:  # one slice moves down (a copy first: source and destination may overlap)
        start, stop = runs[0]
        for layer in range(len(cache.keys)):
            for store in (cache.keys[layer], cache.values[layer]):
                store[row, :, settled:total] = store[row, :, start:stop].clone()
    elif runs:
        index = torch.cat([torch.arange(start, stop, device=cache.lengths.device) for start, stop in runs])
        for layer in range(len(cache.keys)):
            for store in (cache.keys[layer], cache.values[layer]):
                store[row, :, settled:total] = store[row, :, index]  # advanced indexing gathers first
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
