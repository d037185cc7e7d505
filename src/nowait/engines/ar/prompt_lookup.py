"""Prompt lookup: proposals copied from earlier in a sequence's own tokens (prompt + output).

The speculative engine proposes with it (methods ngram and hybrid); a `Sequence` carries its
index (`Sequence.prompt_lookup`), which is why it lives beside the sequence and the speculative
engine builds on the AR engine, never the reverse.
"""

from __future__ import annotations

import numpy as np


# Prompt lookup decoding (Saxena 2023): copy what followed the latest earlier occurrence of
# the current suffix; longer suffixes first, since they predict the continuation better.
def propose_ngram(tokens: list[int] | np.ndarray, count: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the last n tokens."""
    if count <= 0:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = ids[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start: start + count].tolist()
    return []


class PromptLookup:
    """`propose_ngram` over one growing token list, kept incrementally.

    For each n it remembers where the latest occurrence of every n-gram ended, so a proposal
    costs O(max_ngram) dictionary lookups instead of a scan of the whole context per step (a
    scan of a few hundred tokens costs about as much as the rest of a small model's step).
    Proposals are identical to `propose_ngram`'s.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, search_limit: int | None = None) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.search_limit = search_limit  # occurrences must end before this index (None: anywhere)
        self.tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # n-grams ending before this index are in `_ends`

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, count: int, drafted: list[int] | tuple[int, ...] = ()) -> tuple[list[int], int]:
        """Up to `count` tokens, and the length of the matched suffix (0: no match).

        `drafted`: tokens proposed after `tokens` this step; the suffix then ends in them (a
        copy the draft model has started), and occurrences are still searched in `tokens` only.
        """
        ids = self.tokens
        # The suffix itself must not match itself: index only n-grams ending before the last token.
        last = len(ids) - 1 if self.search_limit is None else min(len(ids) - 1, self.search_limit)
        for end in range(self._indexed, last):
            for n, table in self._ends.items():
                if end + 1 >= n:
                    table[tuple(ids[end + 1 - n: end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        if count <= 0:
            return [], 0
        context = ids + list(drafted) if drafted else ids
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._ends[n].get(tuple(context[length - n:]))
            if start is not None:
                return context[start: start + count], n
        return [], 0
