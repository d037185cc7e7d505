"""What a speculative engine is asked to do: the method and its limits, the settings tuned per
method, and when a step speculates at all.

When speculation is skipped (`should_speculate`): speculation buys tokens per target forward
with extra compute (draft forwards plus the proposals' positions in the verify). At small
batch a decode forward is memory- or overhead-bound and the extra positions are cheap; at
large batch the forward is already compute-efficient and the extra positions cost their
full price while only the accepted ones pay. So a step speculates only while the running
batch is at most `max_batch` sequences and batch x (gamma + 1) positions fit the step's token
cap; above that the engine decodes normally (and the draft's cache catches up later). The
default `max_batch=4` is a CPU-side guess to be calibrated by `nowait bench batching`: set
it to the batch size at which batched decoding stops being nearly free per extra sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpeculativeMethod = Literal["draft", "ngram", "hybrid", "diffusion"]


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod = "draft"
    gamma: int = 4  # proposals per step and sequence, at most
    max_batch: int = 4  # speculate only while at most this many sequences run
    max_ngram: int = 3
    min_ngram: int = 1
    # Draft model: stop drafting a row after a proposal whose draft probability is below this
    # (0: always draft gamma tokens). The doubtful token is still proposed: its forward is paid.
    draft_confidence: float = 0.0
    hybrid_min_ngram: int = 2  # hybrid: prompt lookup when at least this many tokens match
    # Tokens one prompt lookup proposes, at most (None: gamma). A copied span ends where the
    # document's value ends, so long lookups mostly fill the verify with rejected positions.
    lookup_gamma: int | None = None
    # Method diffusion: the drafter's commit threshold (None: the drafter's own). A looser tau
    # drafts in fewer forwards; the target corrects what it gets wrong, so only speed changes.
    drafter_tau: float | None = None
    # Tokens of a drafted answer (method diffusion, or a request's draft_ids) one verify checks,
    # at most: such an answer is mostly right, so a long verify pays where a guessed one would not.
    answer_gamma: int = 64

    @property
    def widest(self) -> int:
        """The most proposals one row's verify can carry."""
        return max(self.gamma, self.answer_gamma)

    def validate(self) -> None:
        if self.method not in ("draft", "ngram", "hybrid", "diffusion"):
            raise ValueError(f"unknown speculative method {self.method!r}; choose draft, ngram, hybrid or diffusion")
        if self.gamma < 1:
            raise ValueError(f"gamma must be at least 1, got {self.gamma}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if not 0 <= self.draft_confidence < 1:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if self.lookup_gamma is not None and self.lookup_gamma < 1:
            raise ValueError(f"lookup_gamma must be at least 1 (or None for gamma), got {self.lookup_gamma}")
        if self.answer_gamma < 1:
            raise ValueError(f"answer_gamma must be at least 1, got {self.answer_gamma}")
        if self.drafter_tau is not None and not 0 < self.drafter_tau <= 1:
            raise ValueError(f"drafter_tau must be in (0, 1], got {self.drafter_tau}")
        if not 1 <= self.hybrid_min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= hybrid_min_ngram <= max_ngram, got {self.hybrid_min_ngram}, "
                             f"{self.max_ngram}")

    @property
    def uses_draft(self) -> bool:
        """Needs a causal draft model (methods draft and hybrid)."""
        return self.method in ("draft", "hybrid")

    @property
    def uses_drafter(self) -> bool:
        """Needs a diffusion drafter (method diffusion)."""
        return self.method == "diffusion"


# Per-method settings, measured side by side on the demo models at batch size 1 (CPU; see
# docs/engines-ar.md): the draft is cut short once it doubts (draft_confidence), which makes a
# long gamma cheap; prompt lookups stop at 5 tokens, about where copied document values end;
# the diffusion drafter commits at tau 0.99 (fewer forwards than its own 0.999: the target
# corrects what it gets wrong) and a verify checks 64 of its tokens (answers run ~93).
# Diffusion was the fastest, hybrid the fastest of those without a second full-size model; the
# bench (`nowait bench engines --only spec`) remeasures all four.
SPEC_SETTINGS: dict[str, SpeculativeConfig] = {
    "ngram": SpeculativeConfig(method="ngram", gamma=4),
    "draft": SpeculativeConfig(method="draft", gamma=8, draft_confidence=0.9),
    "hybrid": SpeculativeConfig(method="hybrid", gamma=12, draft_confidence=0.95, lookup_gamma=5),
    "diffusion": SpeculativeConfig(method="diffusion", gamma=64, drafter_tau=0.99, answer_gamma=64),
}
SPEC_METHODS = tuple(SPEC_SETTINGS)
BEST_METHOD = "hybrid"  # the default of `nowait eval --engine spec` and the gateway's spec engines


def should_speculate(batch_size: int, gamma: int, max_batch: int, token_cap: int) -> bool:
    """The rule for skipping speculation (see the module docstring)."""
    return gamma > 0 and batch_size <= max_batch and batch_size * (gamma + 1) <= token_cap
