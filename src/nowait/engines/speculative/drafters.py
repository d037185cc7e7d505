"""Who may draft for a target: a causal draft model or a diffusion drafter with the target's
tokens, checked before an engine is built, and the diffusion drafter's construction."""

from __future__ import annotations

import collections.abc
from typing import TYPE_CHECKING

from nowait.model import Transformer
from nowait.tokenizer import TextCodec

if TYPE_CHECKING:  # the diffusion engine loads only where a drafter is given
    from nowait.engines.diffusion.engine import DiffusionEngine


class IncompatibleDraftError(ValueError):
    """The draft cannot propose for this target (another vocabulary, not causal...)."""


def check_draft(target: Transformer, draft: Transformer, codec: TextCodec | None = None,
                draft_codec: TextCodec | None = None) -> None:
    """Refuse a draft that cannot propose tokens for this target."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise IncompatibleDraftError(
            f"the draft's vocabulary has {draft.config.vocab_size} tokens, the target's {target.config.vocab_size}: "
            "speculative decoding needs the same tokenizer")
    if not draft.config.causal:
        raise IncompatibleDraftError("the draft model is bidirectional; it must be causal (AR)")
    if codec is not None and draft_codec is not None and not codec.same_ids_as(draft_codec):
        raise IncompatibleDraftError("the draft's tokenizer maps tokens to other ids than the target's")


def check_drafter_model(target: Transformer, drafter: Transformer, codec: TextCodec | None = None,
                        drafter_codec: TextCodec | None = None) -> None:
    """Refuse a diffusion drafter whose answers are not in the target's tokens."""
    if drafter.config.vocab_size != target.config.vocab_size:
        raise IncompatibleDraftError(
            f"the drafter's vocabulary has {drafter.config.vocab_size} tokens, the target's "
            f"{target.config.vocab_size}: speculative decoding needs the same tokenizer")
    if drafter.config.causal:
        raise IncompatibleDraftError("the drafter is causal (AR); method diffusion needs a diffusion model")
    if codec is not None and drafter_codec is not None and not codec.same_ids_as(drafter_codec):
        raise IncompatibleDraftError("the drafter's tokenizer maps tokens to other ids than the target's")


def build_drafter(model: Transformer, codec: TextCodec, max_batch: int = 4,
                  end_ids: collections.abc.Sequence[int] | None = None) -> DiffusionEngine:
    """The diffusion engine that drafts answers for method diffusion (its fast default; the
    speculative settings' `drafter_tau` goes with each drafting request). A causal model is
    refused as a drafter, like any draft that cannot serve (IncompatibleDraftError)."""
    from nowait.engines.diffusion.engine import DiffusionEngine

    if model.config.causal:
        raise IncompatibleDraftError("the drafter is causal (AR); method diffusion needs a diffusion model")
    return DiffusionEngine(model, codec, max_batch=max_batch, end_ids=end_ids)
