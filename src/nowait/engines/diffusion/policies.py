"""Sampling policies for masked diffusion: what to propose at each masked position, how sure it
is, and which positions to commit this step. Small pure functions over tensors.

Shapes: `logits` [B, L, vocab] over the current block's positions; `score` and `still_masked`
[B, L]; every `commit_*` returns a boolean [B, L] that is False wherever `still_masked` is
False and, in every row with a masked position, True somewhere (a step always makes progress).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nowait.engines.diffusion.reference import commit_most_confident

POLICIES = ("fixed", "threshold", "factor")
SCORES = ("probability", "margin", "entropy")


# --- proposals ---


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
    """Standard Gumbel noise in float64 (LLaDA notes low-precision Gumbel-max hurts quality)."""
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(min=1e-300)
    return -torch.log(-torch.log(uniform))


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits outside the top-k tokens, or outside the smallest set holding top_p of the
    probability, set to -inf (Holtzman et al. 2019, arXiv 1904.09751). top_k 0 / top_p 1: off."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def propose_tokens(logits: Tensor, temperature: float, noise: Tensor | None = None) -> Tensor:
    """The token proposed at each position: argmax at temperature 0, otherwise a sample by the
    Gumbel-max trick, argmax(logits / T + g), as LLaDA samples (arXiv 2502.09992, App. B)."""
    if temperature == 0 or noise is None:
        return logits.argmax(-1)
    logits = logits.double()
    return ((logits - logits.amax(-1, keepdim=True)) / temperature + noise).argmax(-1)  # no inf at tiny T


def token_probability(probabilities: Tensor, tokens: Tensor) -> Tensor:
    """p(token) at each position: the confidence the engine reports for a committed token."""
    return probabilities.gather(-1, tokens[..., None]).squeeze(-1)


# --- scores: the order in which masked positions are committed ---


def top2_margin(probabilities: Tensor) -> Tensor:
    """p(first) - p(second) per position. Top probability margin (Kim et al. 2025, arXiv
    2502.06768; Dream's `topk_margin`): a position torn between two tokens waits even when the
    first one looks likely."""
    top = probabilities.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def inverse_perplexity(probabilities: Tensor) -> Tensor:
    """exp(-entropy) per position, in (0, 1]. Entropy ordering (Dream, arXiv 2508.15487,
    `entropy`), mapped to (0, 1] so the same tau applies."""
    entropy = -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1)
    return torch.exp(-entropy)


def position_scores(kind: str, probabilities: Tensor, chosen_probability: Tensor) -> Tensor:
    if kind == "probability":
        return chosen_probability
    if kind == "margin":
        return top2_margin(probabilities)
    if kind == "entropy":
        return inverse_perplexity(probabilities)
    raise ValueError(f"unknown score {kind!r}")


# --- commit rules ---


# LLaDA (arXiv 2502.09992), low-confidence remasking: each block gets `steps` steps and every
# step commits the same share of its masked positions, the most confident first.
def fixed_count(still_masked: int, steps_left: int) -> int:
    """Positions to commit now so the block ends on time: LLaDA's per-step counts (the
    remainder on the first steps) are exactly the running ceil(masked / steps left)."""
    return -(-still_masked // max(steps_left, 1))


def commit_fixed(score: Tensor, still_masked: Tensor, count: int) -> Tensor:
    return commit_most_confident(score, still_masked, max(count, 1))


def _with_best(chosen: Tensor, score: Tensor, still_masked: Tensor) -> Tensor:
    """Add each row's best masked position, so every row with work left commits something."""
    best = score.masked_fill(~still_masked, float("-inf")).argmax(-1, keepdim=True)
    # The best masked position is set (a row with nothing masked sets nothing): one scatter,
    # not a one-hot mask combined with the row's any().
    return chosen.scatter(-1, best, still_masked.gather(-1, best) | chosen.gather(-1, best))


# Fast-dLLM (arXiv 2505.22618), Sec. 3.3 threshold rule: commit every masked position whose
# confidence is >= tau, and always at least the most confident one.
def commit_above_threshold(score: Tensor, still_masked: Tensor, tau: float) -> Tensor:
    return _with_best(still_masked & (score >= tau), score, still_masked)


# Fast-dLLM (arXiv 2505.22618), Sec. 3.3 factor rule: with confidences sorted c_1 >= c_2 >= ...,
# commit the largest n with (n + 1)(1 - c_n) < factor: more positions when all are sure.
def commit_by_factor(score: Tensor, still_masked: Tensor, factor: float) -> Tensor:
    ordered, order = score.masked_fill(~still_masked, float("-inf")).sort(-1, descending=True)
    rank = torch.arange(1, score.shape[-1] + 1, device=score.device, dtype=score.dtype)
    # The condition holds on a prefix of the ranks: c_n falls while 1 - factor/(n + 1) rises.
    passes = ((rank + 1) * (1 - ordered) < factor) & torch.isfinite(ordered)
    count = passes.long().cumprod(-1).sum(-1, keepdim=True)
    chosen_sorted = rank[None, :] <= count
    chosen = torch.zeros_like(still_masked).scatter(-1, order, chosen_sorted) & still_masked
    return _with_best(chosen, score, still_masked)


def choose_commits(policy: str, score: Tensor, still_masked: Tensor, *, tau: float = 0.9,
                   factor: float = 1.0, count: int = 1) -> Tensor:
    """The positions one step commits under a named policy."""
    if policy == "fixed":
        return commit_fixed(score, still_masked, count)
    if policy == "threshold":
        return commit_above_threshold(score, still_masked, tau)
    if policy == "factor":
        return commit_by_factor(score, still_masked, factor)
    raise ValueError(f"unknown policy {policy!r}")


def is_probability(value: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and 0 < value <= 1
