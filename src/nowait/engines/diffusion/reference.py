"""Masked-diffusion decoding.

This module holds the reference sampler training's evaluation uses and the two helpers the
engine shares with it; the serving engine (parallel commit policies, caches, batching, template
infilling) is `nowait.engines.diffusion.engine.DiffusionEngine` (see docs/engines-diffusion.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nowait.model import Transformer


def window_logits(logits: Tensor, window_start: Tensor, window: int, shift: bool) -> Tensor:
    """The logits that predict each answer-window position, [B, window, vocab].

    With Dream's shift (a model adapted from an AR one) position p is predicted at p - 1.
    Rows whose window ends before `window` read clamped (meaningless) logits past their end.
    """
    index = window_start[:, None] + torch.arange(window, device=logits.device) - int(shift)
    index = index.clamp(max=logits.shape[1] - 1)
    return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))


# LLaDA (arXiv 2502.09992), Algorithm "low-confidence remasking": semi-autoregressive blocks,
# a fixed number of positions committed per step, the most confident masked ones first.
def commit_most_confident(confidence: Tensor, still_masked: Tensor, count: int) -> Tensor:
    """Boolean [B, W]: the `count` most confident still-masked positions of each row."""
    scores = confidence.masked_fill(~still_masked, float("-inf"))
    top = scores.topk(count, dim=-1).indices
    chosen = torch.zeros_like(still_masked).scatter(1, top, True)
    return chosen & still_masked


@torch.no_grad()
def reference_decode(model: Transformer, prompts: list[list[int]], window: int, block: int,
                     mask_id: int, end_id: int, stats: dict | None = None) -> list[list[int]]:
    """LLaDA's reference schedule with one token committed per forward, greedy, batched.

    Each row's answer window starts fully masked; blocks are filled left to right and each
    step commits the single most confident masked position of the current block. Decoding
    stops after the first block in which every row has committed an end token.
    `stats`, when given, receives the number of forward passes under "forwards".
    """
    if window % block:
        raise ValueError("window must be a multiple of block")
    device = model.output_weight().device
    batch = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    total = prompt_lengths + window
    tokens = torch.full((batch, int(total.max())), end_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
        tokens[row, len(prompt): len(prompt) + window] = mask_id
    positions = prompt_lengths[:, None] + torch.arange(window, device=device)
    rows = torch.arange(batch, device=device)[:, None]
    shift = model.config.logits_shift
    forwards = 0
    for start in range(0, window, block):
        in_block = torch.zeros(batch, window, dtype=torch.bool, device=device)
        in_block[:, start: start + block] = True
        for _ in range(block):
            answer = tokens[rows, positions]
            still_masked = (answer == mask_id) & in_block
            if not bool(still_masked.any()):
                break
            logits = window_logits(model(tokens, valid_lengths=total), prompt_lengths, window, shift)
            logits[..., mask_id] = float("-inf")  # committing the mask token would commit nothing
            forwards += 1
            probabilities = logits.float().softmax(-1)
            confidence, prediction = probabilities.max(-1)
            chosen = commit_most_confident(confidence, still_masked, 1)
            tokens[rows, positions] = torch.where(chosen, prediction, answer)
        answer = tokens[rows, positions]
        if bool((answer[:, : start + block] == end_id).any(-1).all()):
            break
    if stats is not None:
        stats["forwards"] = forwards
    outputs = []
    for row in tokens[rows, positions].tolist():
        kept = []
        for token in row:
            if token in (end_id, mask_id):
                break
            kept.append(token)
        outputs.append(kept)
    return outputs
