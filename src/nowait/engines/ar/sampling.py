"""Sampling policies as small pure functions over logits and probabilities.

Every function takes a batch: logits [B, V] and one parameter per row, so one forward over many
requests with different settings is sampled in one call. Randomness comes in as uniforms drawn
by the caller from each request's own generator, which is what makes a seeded request give the
same tokens alone and inside any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nowait.engines.base import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors; `all_greedy` takes the argmax-only fast path."""

    temperature: Tensor  # [B] float, 0 = greedy
    top_k: Tensor  # [B] long, 0 = no cut
    top_p: Tensor  # [B] float in (0, 1]
    all_greedy: bool
    any_greedy: bool = True  # known from the parameters, so no row needs asking the device

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingBatch:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(p.temperature == 0 for p in params),
            any_greedy=any(p.temperature == 0 for p in params),
        )

    def on(self, device: torch.device | str) -> SamplingBatch:
        """These parameters on `device` (itself when they are there already): the engines build
        them on the host, next to the logits' device only when asked."""
        if self.temperature.device == torch.device(device):
            return self
        return SamplingBatch(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                             self.all_greedy, self.any_greedy)

    def repeat_rows(self, times: int) -> SamplingBatch:
        """Each row's parameters `times` times in a row (the positions of a speculative verify)."""
        return SamplingBatch(self.temperature.repeat_interleave(times), self.top_k.repeat_interleave(times),
                             self.top_p.repeat_interleave(times), self.all_greedy, self.any_greedy)


def one_hot_argmax(logits: Tensor) -> Tensor:
    """Greedy decoding as a distribution: all mass on the argmax (the first one on ties)."""
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


# Softmax temperature: logits / T; T -> 0 approaches the argmax, which rows with T = 0 take exactly.
def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """The row's maximum is subtracted first, so a tiny T sends the others to -inf, never the
    maximum to inf (inf - inf in the softmax would be NaN)."""
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)) / safe[:, None]


# Top-k: Fan et al. 2018, "Hierarchical Neural Story Generation"; top-p (nucleus): Holtzman et al.
# 2019, "The Curious Case of Neural Text Degeneration". Applied in that order, after the
# temperature, as Hugging Face and vLLM do.
def truncate_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Logits with -inf outside each row's top-k and outside its smallest nucleus of mass >= top_p.

    The nucleus always keeps the most likely token, so no row is left empty.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    keep = rank < k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the strictly more likely tokens
    # top_p = 1 keeps everything: in float32 the running mass reaches 1 before the last tokens.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sampling_distribution(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The distribution each row samples from, [B, V] float32: one-hot argmax for greedy rows,
    softmax of the temperature-scaled, top-k/top-p-truncated logits for the others.

    Speculative decoding needs these as explicit distributions (its acceptance test compares
    the target's and the draft's probabilities of the same token), hence no shortcut here.
    """
    if batch.all_greedy:
        return one_hot_argmax(logits)
    batch = batch.on(logits.device)
    scaled = truncate_top_k_top_p(apply_temperature(logits, batch.temperature), batch.top_k, batch.top_p)
    probs = scaled.softmax(-1)
    # Greedy rows among sampled ones take the one-hot argmax. Whether there are any is known from
    # the parameters: asking the device would be a host read (a synchronization on a GPU).
    if batch.any_greedy:
        probs = torch.where((batch.temperature == 0)[:, None], one_hot_argmax(logits), probs)
    return probs


# Inverse transform sampling: the first index whose cumulative mass exceeds u * total.
def sample_from(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row from `probs` [B, V] given uniforms in [0, 1) [B].

    A zero-probability token owns an empty interval of the CDF, so it is never drawn.
    """
    cdf = probs.cumsum(-1)
    targets = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]  # uniforms drawn on the host
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def token_probability(logits: Tensor, tokens: Tensor) -> Tensor:
    """The model's own probability of each chosen token (softmax at temperature 1, before any
    truncation or grammar mask): what a request's confidence is made of."""
    return logits.float().softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """Logits with -inf on every token a grammar forbids (in place on `logits`)."""
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def draw_uniforms(generators: list[torch.Generator | None], count: int = 1) -> Tensor:
    """[B, count] uniforms, row b from generator b; greedy rows (None) get 0.5, unused anyway."""
    rows = [torch.rand(count, generator=g) if g is not None else torch.full((count,), 0.5) for g in generators]
    return torch.stack(rows) if rows else torch.empty(0, count)


def choose_tokens(logits: Tensor, batch: SamplingBatch, generators: list[torch.Generator | None]) -> Tensor:
    """Next token per row: the argmax for greedy rows, a draw from the sampling distribution else."""
    if batch.all_greedy:
        return logits.argmax(-1)
    probs = sampling_distribution(logits, batch)
    return sample_from(probs, draw_uniforms(generators)[:, 0])
