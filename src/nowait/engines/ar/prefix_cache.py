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

A block is stored the second time it is seen, not the first (a doorkeeper, as cache admission
filters such as TinyLFU's do). Most of a prompt is its own (the document), and storing every
block let each prompt's unique tail evict the prefixes other prompts share: with three document
kinds cycling through a one-row engine's store, the kinds' 344-token shared prefix was evicted
before its kind came back, and only the first 16 tokens were ever restored.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from nowait.model import KVCache

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's id, or -1 at the start; the block's tokens)


class PrefixCache:
    """Stored keys/values of prompt blocks for one model's cache (`like`: its layout)."""

    def __init__(self, like: KVCache, capacity_blocks: int, block_size: int = 16, admit_after: int = 2) -> None:
        """`admit_after`: sightings of a block before it is stored (1: at once)."""
        if capacity_blocks < 1 or block_size < 1 or admit_after < 1:
            raise ValueError(f"a prefix cache needs capacity_blocks, block_size and admit_after >= 1, got "
                             f"{capacity_blocks}, {block_size} and {admit_after}")
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
        self._fresh = 0  # slots [0, _fresh) have held a block
        self._free: list[int] = []  # slots given back by a copy that failed
        self.admit_after = admit_after
        # Blocks seen but not stored yet, by a hash of every token up to the block's end, with
        # their sightings; a hash collision only stores a block early, never restores a wrong one.
        self._sightings: OrderedDict[int, int] = OrderedDict()

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
        return n

    def store(self, prompt: list[int], cache: KVCache, row: int) -> None:
        """Keep the full blocks of `prompt` that row `row` of `cache` holds and the store lacks,
        as many as the store holds from the start: the first blocks are the ones prompts share,
        and a chain without them can never be matched."""
        held = min(len(prompt), int(cache.lengths[row]), self.capacity_blocks * self.block_size)
        parent = -1
        chain = 0
        touched: list[BlockKey] = []
        new_blocks: list[tuple[BlockKey, int, int]] = []  # key, slot, start
        for start in range(0, held - self.block_size + 1, self.block_size):
            block = tuple(prompt[start: start + self.block_size])
            key = (parent, block)
            chain = hash((chain, block))
            slot = self.slots.get(key)
            if slot is None:
                if self._sight(chain) < self.admit_after:  # seen too rarely: neither it nor what follows
                    self._sight_rest(prompt, start + self.block_size, held, chain)
                    break
                del self._sightings[chain]  # stored from now on
                slot = self._free_slot(protect=touched)
                self._ids[slot] = self._next_id
                self._next_id += 1
                new_blocks.append((key, slot, start))
            else:
                self.slots.move_to_end(key)  # not the next to go while this prompt's blocks are stored
            touched.append(key)
            parent = self._ids[slot]
        if new_blocks:  # copied before they are findable: a failed copy leaves no key to garbage
            slots = [slot for _, slot, _ in new_blocks]
            try:
                self._copy_out(cache, row, [start for _, _, start in new_blocks], slots)
            except BaseException:
                self._free.extend(slots)  # and no slot is lost: the next blocks take them
                raise
            for key, slot, _ in new_blocks:
                self.slots[key] = slot
        for key in reversed(touched):  # the first block most recent: a prefix outlives its continuations
            self.slots.move_to_end(key)

    def _sight(self, chain: int) -> int:
        """Count a sighting of the block ending `chain`; its sightings so far."""
        seen = self._sightings.pop(chain, 0) + 1
        self._sightings[chain] = seen
        while len(self._sightings) > 8 * self.capacity_blocks:  # forget the oldest sightings
            self._sightings.popitem(last=False)
        return seen

    def _sight_rest(self, prompt: list[int], start: int, held: int, chain: int) -> None:
        """Count sightings of the blocks after a block not admitted, so that a later prompt
        with the same longer beginning stores them too."""
        for begin in range(start, held - self.block_size + 1, self.block_size):
            chain = hash((chain, tuple(prompt[begin: begin + self.block_size])))
            self._sight(chain)

    def _copy_out(self, cache: KVCache, row: int, starts: list[int], slots: list[int]) -> None:
        """The blocks at `starts` of the row into `slots` (distinct), one gather per tensor."""
        size = self.block_size
        positions = torch.tensor([start + i for start in starts for i in range(size)], device=self.keys[0].device)
        index = torch.tensor(slots, device=self.keys[0].device)
        for stored, rows in ((self.keys, cache.keys), (self.values, cache.values)):
            for layer, blocks in enumerate(stored):
                taken = rows[layer][row].index_select(1, positions)  # [kv, blocks * size, D]
                blocks[index] = taken.view(taken.shape[0], len(slots), size, -1).transpose(0, 1)

    def _free_slot(self, protect: list[BlockKey]) -> int:
        """A slot for a new block: a never used one, else the least recently used block's, never
        one of `protect` (the blocks this store call has passed). An evicted block's children
        can no longer be matched: their parent's id is gone with it. A call stores at most
        `capacity_blocks`, so some block outside `protect` is always there to evict."""
        if self._free:
            return self._free.pop()
        if self._fresh < self.capacity_blocks:
            self._fresh += 1
            return self._fresh - 1
        kept = set(protect)
        key = next(key for key in self.slots if key not in kept)
        return self.slots.pop(key)
