"""Speculative decoding on the AR engine: a draft model, prompt lookup or a diffusion model
drafting whole answers proposes tokens, the target verifies them in one pass. Import-only: each
name lives in its module."""

from nowait.engines.speculative.engine import (
    BEST_METHOD,
    SPEC_METHODS,
    SPEC_SETTINGS,
    IncompatibleDraftError,
    PromptLookup,
    SpeculativeConfig,
    SpeculativeEngine,
    build_drafter,
    expected_tokens_per_pass,
    greedy_accept,
    propose_from_draft,
    propose_ngram,
    should_speculate,
    speculative_accept,
)

__all__ = [
    "BEST_METHOD",
    "SPEC_METHODS",
    "SPEC_SETTINGS",
    "IncompatibleDraftError",
    "PromptLookup",
    "SpeculativeConfig",
    "SpeculativeEngine",
    "build_drafter",
    "expected_tokens_per_pass",
    "greedy_accept",
    "propose_from_draft",
    "propose_ngram",
    "should_speculate",
    "speculative_accept",
]
