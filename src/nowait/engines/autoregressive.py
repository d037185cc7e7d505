"""Autoregressive decoding with the KV cache.

This module holds the simple, correct greedy decoder the evaluation and training use; the
serving engine (continuous batching, sampling, speculative decoding) builds on it.
"""

from __future__ import annotations

import torch

from nowait.model import KVCache, Transformer


@torch.no_grad()
def greedy_decode(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                  end_id: int, stats: dict | None = None) -> list[list[int]]:
    """Greedy decode a batch of prompts of different lengths; returns the new ids, end excluded.

    One prefill over the right-padded prompts, then one cached forward per token. Rows that
    finish early ride along until the longest is done (continuous batching retires them).
    """
    device = model.output_weight().device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    padded = torch.full((batch, int(lengths.max())), end_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = torch.tensor(prompt, device=device)
    cache = KVCache(model.config, batch, int(lengths.max()) + max_new_tokens,
                    dtype=model.output_weight().dtype, device=device)
    logits = model(padded, cache, valid_lengths=lengths)
    next_ids = logits[torch.arange(batch, device=device), lengths - 1].argmax(-1)
    forwards = 1
    outputs: list[list[int]] = [[] for _ in range(batch)]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for produced in range(1, max_new_tokens + 1):
        finished_now = finished | (next_ids == end_id)
        for row in (~finished_now).nonzero().flatten().tolist():
            outputs[row].append(int(next_ids[row]))
        finished = finished_now
        if bool(finished.all()) or produced == max_new_tokens:
            break
        next_ids = model(next_ids[:, None], cache)[:, -1].argmax(-1)
        forwards += 1
    if stats is not None:
        stats["forwards"] = forwards
    return outputs
