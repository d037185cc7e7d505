"""Proposals from a drafted answer: a diffusion model's, or one the request brings."""

from __future__ import annotations


# Speculative diffusion decoding (Christopher et al. 2024): the proposal is the drafted answer
# from where the output stands in it; after a disagreement the output is re-aligned on the draft
# by its last tokens (prompt lookup's rule, Saxena 2023), the occurrence nearest the old alignment.
def propose_from_draft(draft: list[int], output: list[int], count: int, shift: int = 0,
                       max_ngram: int = 3, min_ngram: int = 2) -> tuple[list[int], int]:
    """Up to `count` tokens of `draft` to follow `output`, and the alignment they assume.

    `shift`: draft index minus output index found last time (0 while the output is a prefix of
    the draft). The output's last n tokens (n from `max_ngram` down to `min_ngram`) are looked
    up in the draft, and the occurrence that ends nearest `len(output) + shift` wins; when none
    occurs the last output token is taken to have replaced a draft token (the alignment is
    kept). Returns the proposal and the new shift.
    """
    if count <= 0:
        return [], shift
    expected = len(output) + shift
    best: tuple[int, int, int] | None = None  # (distance from the alignment, -n, end)
    for n in range(min(max_ngram, len(output)), min_ngram - 1, -1):
        suffix = output[len(output) - n:]
        for end in range(n, len(draft) + 1):
            if draft[end - n: end] == suffix:
                candidate = (abs(end - expected), -n, end)
                best = candidate if best is None or candidate < best else best
    if best is not None:
        end = best[2]
        return draft[end: end + count], end - len(output)
    start = max(0, expected)
    return draft[start: start + count], shift
