"""Regular languages over token ids, for writing only valid JSON values into template slots.

A slot's language (a JSON string, a number, one enum option, `null`...) is written as a small
regular expression, compiled to a DFA over UTF-8 bytes and lifted to a DFA over the tokenizer's
ids, with the end token as padding after the value. Diffusion fills slot positions in any order,
so the question at a masked position is not "what may follow the prefix" but "which tokens here
still leave a completion of the whole slot": `SlotAutomaton.allowed` answers it exactly with a
forward/backward pass over the slot's fixed width.

The steps: `languages.py` (syntax trees and the regex subset that writes them), `byte_dfa.py`
(a language -> a DFA over UTF-8 bytes), this module (the bytes each token writes, the slot's
token automaton).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from nowait.engines.structured.byte_dfa import ByteDFA


def byte_level_decoding() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the rest are
    shifted past 255 in order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def token_byte_strings(tokenizer, special_ids: Iterable[int]) -> list[bytes | None]:
    """The bytes each token id writes, None for special tokens (never part of a value).

    Byte-level BPE vocabularies spell bytes with a printable alphabet; other tokenizers fall
    back to decoding the id alone (exact for whole-character tokens).
    """
    decoding = byte_level_decoding()
    special = set(special_ids)
    strings: list[bytes | None] = []
    for token_id in range(tokenizer.get_vocab_size()):
        piece = tokenizer.id_to_token(token_id)
        if token_id in special or piece is None:
            strings.append(None)
        elif all(char in decoding for char in piece):
            strings.append(bytes(decoding[char] for char in piece))
        else:
            strings.append(tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8") or None)
    return strings


class SlotAutomaton:
    """A value of a byte language, then end tokens, in exactly `width` token positions.

    Token states are the byte DFA's states plus PAD (after the value's end token) and DEAD.
    """

    def __init__(self, language: ByteDFA, tokens: Sequence[bytes | None], end_id: int, width: int) -> None:
        self.width = width
        self.end_id = end_id
        byte_states = language.transitions.shape[0] - 1  # without the byte DFA's dead state
        self.pad, self.dead = byte_states, byte_states + 1
        states = byte_states + 2
        table = np.full((states, len(tokens)), self.dead, dtype=np.int32)
        by_length: dict[int, list[int]] = {}
        for token_id, data in enumerate(tokens):
            if data and token_id != end_id:
                by_length.setdefault(len(data), []).append(token_id)
        for length, ids in by_length.items():
            data = np.array([list(tokens[i]) for i in ids], dtype=np.int64)  # [n, length]
            current = np.repeat(np.arange(byte_states)[:, None], len(ids), axis=1)
            for k in range(length):
                current = language.transitions[current, data[None, :, k]]
            current[current == language.dead] = self.dead
            table[:byte_states, ids] = current
        table[:byte_states, end_id] = np.where(language.accepting[:byte_states], self.pad, self.dead)
        table[self.pad, end_id] = self.pad
        self.table = table
        self.start = language.start
        self.final = np.zeros(states, dtype=bool)
        self.final[:byte_states] = language.accepting[:byte_states]
        self.final[self.pad] = True
        successors = np.zeros((states, states), dtype=bool)
        for state in range(states):
            successors[state, np.unique(table[state])] = True
        successors[:, self.dead] = False
        self.successors = successors
        # Its transpose, stored row-major too: the backward pass gathers rows (the states that
        # lead into a set) instead of columns, which at ~2,000 states (a 100-character string
        # slot) is 10-50x faster.
        self.predecessors = np.ascontiguousarray(successors.T)
        self._allowed_cache: dict[tuple[bytes, bytes], np.ndarray] = {}
        self._passes_cache: dict[tuple[int | None, ...], tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def _forward(self, reachable: np.ndarray, token: int | None) -> np.ndarray:
        if token is None:
            return self.successors[reachable].any(0)
        following = np.zeros_like(reachable)
        following[self.table[reachable.nonzero()[0], token]] = True
        following[self.dead] = False
        return following

    def _backward(self, completing: np.ndarray, token: int | None) -> np.ndarray:
        if token is None:
            return self.predecessors[completing].any(0)
        return completing[self.table[:, token]]

    def _passes(self, assigned: Sequence[int | None]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Forward sets (states reachable before position i) and backward sets (states from which
        positions i.. can still be completed). Most slots do not change between two steps, so
        the passes are remembered per assignment."""
        key = tuple(assigned)
        if key not in self._passes_cache:
            if len(self._passes_cache) >= 4096:
                self._passes_cache.clear()
            self._passes_cache[key] = self._compute_passes(assigned)
        return self._passes_cache[key]

    def _compute_passes(self, assigned: Sequence[int | None]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        states = self.table.shape[0]
        reachable = np.zeros(states, dtype=bool)
        reachable[self.start] = True
        forward = [reachable]
        for token in assigned:
            forward.append(self._forward(forward[-1], token))
        backward = [self.final]
        for token in reversed(assigned):
            backward.append(self._backward(backward[-1], token))
        backward.reverse()
        return forward, backward

    def completable(self, assigned: Sequence[int | None]) -> bool:
        forward, backward = self._passes(assigned)
        return bool((forward[0] & backward[0]).any())

    def allowed(self, assigned: Sequence[int | None], positions: Iterable[int]) -> dict[int, np.ndarray]:
        """For each unassigned position asked for: bool [vocab], the tokens that keep the slot
        completable given every other assignment (masked positions free)."""
        forward, backward = self._passes(assigned)
        result = {}
        for position in positions:
            before, after = forward[position], backward[position + 1]
            key = (before.tobytes(), after.tobytes())
            mask = self._allowed_cache.get(key)
            if mask is None:
                mask = after[self.table[before.nonzero()[0]]].any(0)
                if len(self._allowed_cache) < 4096:
                    self._allowed_cache[key] = mask
            result[position] = mask
        return result
