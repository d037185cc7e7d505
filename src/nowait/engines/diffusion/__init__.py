"""The masked-diffusion engine: LLaDA's reference decoder, the sampling policies, a request's
plan and state, the KV-cache surgery and the batching engine. Import-only: each name lives in its
module."""

from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.diffusion.policies import POLICIES, SCORES
from nowait.engines.diffusion.reference import commit_most_confident, reference_decode, window_logits
from nowait.engines.diffusion.request import CACHE_MODES, REFRESH_MODES, DiffusionOptions, plan_request

__all__ = [
    "CACHE_MODES",
    "POLICIES",
    "REFRESH_MODES",
    "SCORES",
    "DiffusionEngine",
    "DiffusionOptions",
    "commit_most_confident",
    "plan_request",
    "reference_decode",
    "window_logits",
]
