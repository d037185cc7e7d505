"""Model runner: the sequences' keys/values in a pool of cache rows, and the forwards over them.

The pool is one `KVCache` of `max_num_seqs` rows. Running sequences occupy rows [0, n), with no
holes: a retired sequence's row is filled by moving the last row into it (one row copy), so a
decode step over every running sequence is a forward over a view of the first n rows, written
in place. Prefill chunks go through a small temporary cache and are copied into their rows,
because the sequences being prefilled need not be adjacent.

The pool can hold several caches with the same row layout (the speculative engine keeps the
draft model's cache beside the target's), and moves rows in all of them together.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nowait.engines.ar.sequence import Sequence
from nowait.model import KVCache, Transformer
from nowait.model.compiled_step import CompiledDecode
from nowait.model.graphed_step import GraphedDecode


def length_groups(lengths: list[int], max_padding: float = 0.1) -> list[list[int]]:
    """Indices of `lengths` in groups of similar length, shortest first, each padded to its
    longest row with at most `max_padding` of its positions on padding (a row alone is
    always a group). Fewer, larger groups use the matmuls better; padding is wasted compute.
    """
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        group = groups[-1] if groups else None
        if group is not None and 1 - (real + lengths[i]) / ((len(group) + 1) * lengths[i]) <= max_padding:
            group.append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


class CachePool:
    """Rows of one or more KV caches, handed out densely to running sequences."""

    def __init__(self, models: list[Transformer], rows: int, max_tokens: int) -> None:
        self.caches = [KVCache(m.config, rows, max_tokens, dtype=m.output_weight().dtype,
                               device=m.output_weight().device) for m in models]
        self.rows = rows
        self.max_tokens = max_tokens
        self.owners: list[Sequence] = []
        # Views by (cache, rows), built once: slicing every layer anew costs a visible share
        # of a small model's decode step. The slices stay valid: rows move in place.
        self._views: dict[tuple[int, int], KVCache] = {}

    @property
    def used(self) -> int:
        return len(self.owners)

    def allocate(self, seq: Sequence) -> None:
        if self.used >= self.rows:
            raise RuntimeError("no free cache row (the scheduler admitted more than max_num_seqs)")
        seq.row = self.used
        self.owners.append(seq)
        for cache in self.caches:
            cache.lengths[seq.row] = 0

    def release(self, seq: Sequence) -> None:
        """Free `seq`'s row, moving the last occupied row into it to keep rows dense."""
        hole, last = seq.row, self.used - 1
        if self.owners[hole] is not seq:
            raise RuntimeError(f"{seq} does not own row {hole}")
        if hole != last:
            moved = self.owners[last]
            for cache in self.caches:
                length = int(cache.lengths[last])
                for keys, values in zip(cache.keys, cache.values, strict=True):
                    keys[hole, :, :length] = keys[last, :, :length]
                    values[hole, :, :length] = values[last, :, :length]
                cache.lengths[hole] = length
            self.owners[hole] = moved
            moved.row = hole
        self.owners.pop()
        seq.row = -1

    def view(self, index: int = 0) -> KVCache:
        """Cache `index` over the occupied rows, in row order (= `self.owners`)."""
        key = (index, self.used)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.caches[index].view(0, self.used)
        view.lengths = self.caches[index].lengths[: self.used]
        return view

    def commit_view(self, view: KVCache, index: int = 0) -> None:
        self.caches[index].lengths[: view.batch] = view.lengths


class ModelRunner:
    """Forwards of one model over sequences whose keys/values live in `pool.caches[index]`."""

    def __init__(self, model: Transformer, pool: CachePool, index: int, pad_id: int,
                 compiled: CompiledDecode | None = None, graphed: GraphedDecode | None = None) -> None:
        """`compiled`: the model's compiled decode step, which then runs every step that feeds
        one token to one row (the real-time path); `graphed`: the CUDA-Graph decode step over
        this runner's cache, which runs every step that feeds one token to every row (before
        `compiled`); other forwards stay eager."""
        self.model = model
        self.pool = pool
        self.index = index
        self.pad_id = pad_id
        self.device = model.output_weight().device
        self.compiled = compiled
        self.graphed = graphed
        if graphed is not None and graphed.cache is not self.cache:
            raise ValueError("the graphed decode step was built for another cache than this runner's")

    @property
    def cache(self) -> KVCache:
        return self.pool.caches[self.index]

    @torch.no_grad()
    def extend(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]]) -> Tensor:
        """Feed `tokens[i]` to sequence i after its first `starts[i]` cached tokens; returns the
        logits at each sequence's last new token, [B, vocab].

        Used for prefill chunks (and to bring the draft model's cache up to date). Rows of
        similar length run as one right-padded batch (`length_groups`): a batch is padded to
        its longest row, and prompts differ in length by half or more, so one batch for all
        would compute a fifth of its positions on padding. Each group goes through a temporary
        cache: only the prefix each row needs is copied in, and padding never reaches the pool.
        """
        logits: Tensor | None = None
        # Rows from an empty cache run apart from rows that continue one (a chunk, a restored
        # prefix): a group of the first kind needs no attention mask, the fast kernel.
        fresh = [i for i, start in enumerate(starts) if start == 0]
        going = [i for i, start in enumerate(starts) if start > 0]
        groups = [[part[i] for i in group] for part in (fresh, going) if part
                  for group in length_groups([len(tokens[i]) for i in part])]
        for group in groups:
            out = self._extend_group([seqs[i] for i in group], [starts[i] for i in group], [tokens[i] for i in group])
            if logits is None:
                logits = out.new_empty(len(seqs), out.shape[-1])
            logits[group] = out
        return logits

    def _extend_group(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]]) -> Tensor:
        lengths = [len(t) for t in tokens]
        batch, width = len(seqs), max(lengths)
        prefix = max(starts)
        config = self.model.config
        temp = KVCache(config, batch, prefix + width, dtype=self.cache.keys[0].dtype, device=self.device)
        for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
            if start:
                for layer in range(config.num_layers):
                    temp.keys[layer][i, :, :start] = self.cache.keys[layer][seq.row, :, :start]
                    temp.values[layer][i, :, :start] = self.cache.values[layer][seq.row, :, :start]
            temp.lengths[i] = start
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        for i, chunk in enumerate(tokens):
            ids[i, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        valid = torch.tensor(lengths, dtype=torch.long, device=self.device)
        logits = self.model(ids.to(self.device), temp, valid_lengths=valid, output_positions=(valid - 1)[:, None])
        for i, (seq, start, length) in enumerate(zip(seqs, starts, lengths, strict=True)):
            end = start + length
            for layer in range(config.num_layers):
                self.cache.keys[layer][seq.row, :, start:end] = temp.keys[layer][i, :, start:end]
                self.cache.values[layer][seq.row, :, start:end] = temp.values[layer][i, :, start:end]
            self.cache.lengths[seq.row] = end
        return logits[:, 0]

    @torch.no_grad()
    def forward_rows(self, tokens: list[list[int]], longest: int | None = None) -> Tensor:
        """Feed `tokens[r]` to the sequence in row r, for every occupied row, in place.

        Returns the logits at every new position, [rows, longest, vocab]; rows with fewer
        tokens are right padded (their padded keys land past their length and are never read).
        `longest`: the most tokens a row holds after this forward, when the caller knows it
        (the graphed step then needs no host read of the lengths).
        """
        view = self.pool.view(self.index)
        if self.graphed is not None and not self.graphed.failed and all(len(t) == 1 for t in tokens):
            logits = self.graphed([t[0] for t in tokens], view, longest)
            self.pool.commit_view(view, self.index)
            return logits
        if self.compiled is not None and len(tokens) == 1 and len(tokens[0]) == 1:
            logits = self.compiled(tokens[0][0], view)
            self.pool.commit_view(view, self.index)
            return logits
        lengths = [len(t) for t in tokens]
        width = max(lengths)
        if min(lengths) == width:  # no padding: the model needs no per-row lengths
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            valid = None
        else:
            ids = torch.full((len(tokens), width), self.pad_id, dtype=torch.long)
            for row, chunk in enumerate(tokens):
                ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            ids = ids.to(self.device)
            valid = torch.tensor(lengths, dtype=torch.long, device=self.device)
        logits = self.model(ids, view, valid_lengths=valid)
        self.pool.commit_view(view, self.index)
        return logits

    def truncate_rows(self, lengths: list[int]) -> None:
        """Roll rows [0, len(lengths)) back to `lengths` tokens (rejected speculative tokens).

        A roll-back only: `lengths[r]` must not exceed what row r holds (the caller counts
        what it fed), so the lengths are written as they are, without reading the old ones.
        """
        self.cache.lengths[: len(lengths)] = torch.tensor(lengths, dtype=torch.long, device=self.cache.lengths.device)
