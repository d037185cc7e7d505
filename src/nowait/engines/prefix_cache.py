"""Automatic prefix caching: prompts that start alike share their prefill (vLLM's automatic
prefix caching; SGLang's RadixAttention shares prefixes the same way).

A causal model's keys/values at a position depend only on the tokens up to it, so two prompts
that begin with the same tokens have the same keys/values there. After a prefill, the prompt's
full blocks of `block_size` tokens are copied out of the sequence's cache row into a store;
a later prompt that begins with stored blocks gets them copied into its row and prefills only
the rest. Serving traffic repeats its beginnings (a system prompt, an instruction, a document
kind's header), so the prefill a request pays shrinks to what is its own.

A block is found by its parent block and its own tokens, so a hit is exact (no hash can
collide). The store holds `capacity_blocks` blocks and forgets the least recently used; a
prompt's blocks are touched last-first, so a prefix outlives its continuations.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from nowait.model import KVCache

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's id, or -1 at the start; the block's tokens)


@dataclass
class PrefixStats:
    queries: int = 0  # prompts looked up
    hit_tokens: int = 0  # prompt tokens restored instead of computed
    query_tokens: int = 0  # prompt tokens of the prompts looked up

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """Stored keys/values of prompt blocks for one model's cache (`like`: its layout)."""

    def __init__(self, like: KVCache, capacity_blocks: int, block_size: int = 16) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError(f"a prefix cache needs capacity_blocks >= 1 and block_size >= 1, got "
                             f"{capacity_blocks} and {block_size}")
        kv_heads, dim = like.keys[0].shape[1], like.keys[0].shape[3]
        shape = (capacity_blocks, kv_heads, block_size, dim)
        dtype, device = like.keys[0].dtype, like.keys[0].device
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in like.keys]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in like.values]
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.slots: OrderedDict[BlockKey, int] = OrderedDict()  # least recently used first
        self._ids: dict[int, int] = {}  # slot -> id of the block it holds (ids are never reused)
        self._next_id = 0
        self.stats = PrefixStats()

    def _match(self, tokens: list[int], limit: int) -> list[tuple[BlockKey, int]]:
        """(key, slot) of the stored blocks `tokens` starts with, at most `limit` tokens' worth."""
        found: list[tuple[BlockKey, int]] = []
        parent = -1
        for start in range(0, limit - self.block_size + 1, self.block_size):
            key = (parent, tuple(tokens[start: start + self.block_size]))
            slot = self.slots.get(key)
            if slot is None:
                break
            found.append((key, slot))
            parent = self._ids[slot]
        return found

    def restore(self, prompt: list[int], cache: KVCache, row: int) -> int:
        """Copy the stored blocks `prompt` starts with into `cache` row `row` (empty) and return
        how many tokens they hold. At least one prompt token is always left to compute: its
        logits choose the first output token."""
        found = self._match(prompt, len(prompt) - 1)
        self.stats.queries += 1
        self.stats.query_tokens += len(prompt)
        if not found:
            return 0
        for key, _ in reversed(found):  # the first block most recent: a prefix outlives its continuations
            self.slots.move_to_end(key)
        index = torch.tensor([slot for _, slot in found], device=self.keys[0].device)
        n = len(found) * self.block_size
        for stored, rows in ((self.keys, cache.keys), (self.values, cache.values)):
            for layer, blocks in enumerate(stored):
                # [blocks, kv, block, D] -> [kv, blocks * block, D]: the row's first n slots.
                rows[layer][row, :, :n] = blocks[index].transpose(0, 1).reshape(rows[layer].shape[1], n, -1)
        cache.lengths[row] = n
        self.stats.hit_tokens += n
        return n

    def store(self, prompt: list[int], cache: KVCache, row: int) -> None:
        """Keep the full blocks of `prompt` that row `row` of `cache` holds and the store lacks."""
        held = min(len(prompt), int(cache.lengths[row]))
        parent = -1
        touched: list[BlockKey] = []
        new_slots: list[int] = []
        new_starts: list[int] = []
        for start in range(0, held - self.block_size + 1, self.block_size):
            key = (parent, tuple(prompt[start: start + self.block_size]))
            slot = self.slots.get(key)
            if slot is None:
                slot = self._free_slot()
                self._ids[slot] = self._next_id
                self._next_id += 1
                self.slots[key] = slot
                new_slots.append(slot)
                new_starts.append(start)
            else:
                self.slots.move_to_end(key)  # not the next to go while this prompt's blocks are stored
            touched.append(key)
            parent = self._ids[slot]
        for key in reversed(touched):  # the first block most recent: a prefix outlives its continuations
            if key in self.slots:  # a store smaller than the prompt has let its first blocks go
                self.slots.move_to_end(key)
        if new_slots:
            # A store smaller than the prompt reuses a slot within one call: its key now names
            # the later block, so only that one is copied.
            latest = dict(zip(new_slots, new_starts, strict=True))
            self._copy_out(cache, row, list(latest.values()), list(latest))

    def _copy_out(self, cache: KVCache, row: int, starts: list[int], slots: list[int]) -> None:
        """The blocks at `starts` of the row into `slots` (distinct), one gather per tensor."""
        size = self.block_size
        positions = torch.tensor([start + i for start in starts for i in range(size)], device=self.keys[0].device)
        index = torch.tensor(slots, device=self.keys[0].device)
        for stored, rows in ((self.keys, cache.keys), (self.values, cache.values)):
            for layer, blocks in enumerate(stored):
                taken = rows[layer][row].index_select(1, positions)  # [kv, blocks * size, D]
                blocks[index] = taken.view(taken.shape[0], len(slots), size, -1).transpose(0, 1)

    def _free_slot(self) -> int:
        if len(self.slots) < self.capacity_blocks:
            return len(self.slots)
        _, slot = self.slots.popitem(last=False)  # its children can no longer be matched: new ids
        return slot
