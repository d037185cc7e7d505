"""Speculative decoding on the AR engine: a draft model, prompt lookup or a diffusion model
drafting whole answers proposes tokens, the target verifies them in one pass. Import-only: each
name lives in its module."""

from nowait.engines.ar.prompt_lookup import PromptLookup, propose_ngram
from nowait.engines.speculative.acceptance import expected_tokens_per_pass, greedy_accept, speculative_accept
from nowait.engines.speculative.answers import propose_from_draft
from nowait.engines.speculative.config import (
    BEST_METHOD,
    SPEC_METHODS,
    SPEC_SETTINGS,
    SpeculativeConfig,
    SpeculativeMethod,
    should_speculate,
)
from nowait.engines.speculative.drafters import (
    IncompatibleDraftError,
    build_drafter,
    check_draft,
    check_drafter_model,
)
from nowait.engines.speculative.engine import SpeculativeEngine

__all__ = [
    "BEST_METHOD",
    "SPEC_METHODS",
    "SPEC_SETTINGS",
    "IncompatibleDraftError",
    "PromptLookup",
    "SpeculativeConfig",
    "SpeculativeEngine",
    "SpeculativeMethod",
    "build_drafter",
    "check_draft",
    "check_drafter_model",
    "expected_tokens_per_pass",
    "greedy_accept",
    "propose_from_draft",
    "propose_ngram",
    "should_speculate",
    "speculative_accept",
]
