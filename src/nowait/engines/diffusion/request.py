"""Diffusion request settings and their validation: everything refused before any work.

A request's `options` override the engine's `DiffusionOptions`; `plan_request` checks them,
lays out the answer window (all masks, or a schema template with masked slots) and its blocks,
and raises `InvalidRequestError` with the parameter's name when something cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from nowait.engines.base import GenerationRequest, InvalidRequestError
from nowait.engines.diffusion.policies import POLICIES, SCORES, is_probability
from nowait.engines.structured.templates import ConstrainedTemplate, SchemaTemplateError, TemplateCompiler
from nowait.model import ModelConfig

# none: every step recomputes prompt + window (the exact reference).
# prompt: the prompt's keys/values computed once; each step recomputes the window.
# prefix: Fast-dLLM prefix cache: the window is recomputed once per block and its part before
#   the current block kept; each step computes the current block and what follows it.
# dual: Fast-dLLM dual cache: the part after the current block is kept too; each step computes
#   only the current block.
CACHE_MODES = ("none", "prompt", "prefix", "dual")
# How a dual cache is refreshed at each block after the first. window: the whole window is
# recomputed (Fast-dLLM). blocks: only the block just finished and the new one; the suffix after
# them keeps the keys/values of the window's first refresh.
REFRESH_MODES = ("window", "blocks")


@dataclass(frozen=True)
class DiffusionOptions:
    """How the engine decodes; a request's `options` dict overrides any of these by name."""

    policy: str = "threshold"  # fixed (LLaDA) | threshold (Fast-dLLM) | factor (Fast-dLLM)
    # threshold: commit positions at least this sure. Free-form answers need near-certainty: the
    # demo model's marginals are confidently wrong about JSON punctuation when many positions are
    # committed at once (80 validation documents: tau 0.9 -> field accuracy 0.60, 0.99 -> 0.85,
    # 0.999 -> 0.94, the reference schedule 0.94). Templates fix the punctuation, so values alone
    # are committed and 0.9 keeps the reference's accuracy (0.976) at ~3 forwards per document.
    tau: float = 0.999
    template_tau: float = 0.9  # threshold in template mode
    factor: float = 1.0  # factor: commit the largest n with (n + 1)(1 - c_n) < factor
    steps: int | None = None  # fixed: steps per block; None: one position per step
    block: int | None = 32  # free-form block length; None: the whole window in one block
    template_block: int | None = None  # template mode block length; None: the whole template
    cache: str = "dual"
    refresh: str = "blocks"  # dual cache: window | blocks (REFRESH_MODES)
    # dual cache: keep each settled token's keys/values once computed with the token (one step
    # after its commit), so a step recomputes only the block's range that still changes.
    cache_decoded: bool = True
    score: str = "probability"  # probability | margin | entropy: the order of commits

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.cache not in CACHE_MODES:
            raise InvalidRequestError(f"cache must be one of {', '.join(CACHE_MODES)}; got {self.cache!r}")
        if not isinstance(self.cache_decoded, bool):
            raise InvalidRequestError(f"cache_decoded must be true or false, got {self.cache_decoded!r}")
        if self.refresh not in REFRESH_MODES:
            raise InvalidRequestError(f"refresh must be one of {', '.join(REFRESH_MODES)}; got {self.refresh!r}")
        if self.score not in SCORES:
            raise InvalidRequestError(f"score must be one of {', '.join(SCORES)}; got {self.score!r}")
        for name in ("tau", "template_tau"):
            if not is_probability(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not _is_number(self.factor) or self.factor <= 0:
            raise InvalidRequestError(f"factor must be > 0, got {self.factor!r}")
        for name in ("block", "template_block"):
            value = getattr(self, name)
            if value is not None and (not _is_integer(value) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive number of tokens (or None for one block), "
                                          f"got {value!r}")
        if self.steps is not None and (not _is_integer(self.steps) or self.steps < 1):
            raise InvalidRequestError(f"steps must be a positive integer, got {self.steps!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


REQUEST_OPTIONS = ("policy", "tau", "factor", "steps", "block", "cache", "refresh", "cache_decoded", "score")


def resolve_options(defaults: DiffusionOptions, overrides: dict, structured: bool) -> DiffusionOptions:
    """The request's settings; `block` is the effective block length (None: one block)."""
    unknown = sorted(set(overrides) - set(REQUEST_OPTIONS))
    if unknown:
        raise InvalidRequestError(f"unknown diffusion option(s) {', '.join(map(repr, unknown))}; "
                                  f"known: {', '.join(REQUEST_OPTIONS)}")
    block = overrides.get("block", defaults.template_block if structured else defaults.block)
    tau = overrides.get("tau", defaults.template_tau if structured else defaults.tau)
    known = {f.name for f in fields(DiffusionOptions)} - {"block", "tau"}
    options = replace(defaults, **{k: v for k, v in overrides.items() if k in known}, block=block, tau=tau)
    options.validate()
    return options


def block_ranges(fillable: list[bool], block: int | None) -> list[tuple[int, int]]:
    """Window ranges decoded one after another, left to right; ranges with nothing to fill
    (a template's fixed text) are skipped."""
    length = len(fillable)
    size = block or length
    return [(start, min(start + size, length)) for start in range(0, length, size)
            if any(fillable[start: start + size])]


@dataclass(frozen=True)
class DecodePlan:
    """A validated request: its settings, prompt, initial answer window and blocks."""

    request: GenerationRequest
    options: DiffusionOptions
    prompt: list[int]
    window: list[int]  # mask ids, or the template ids with masked slots
    fillable: list[bool]  # positions the model fills
    blocks: list[tuple[int, int]]
    template: ConstrainedTemplate | None
    end_ids: frozenset[int]


def plan_request(request: GenerationRequest, defaults: DiffusionOptions, config: ModelConfig,
                 compiler: TemplateCompiler, mask_id: int, end_ids: tuple[int, ...]) -> DecodePlan:
    """Validate a request and lay out its answer window, or raise InvalidRequestError.

    `end_ids`: the model's end-of-text ids; free-form answers end at any of them (and at the
    request's stop ids). Template slots are padded with the tokenizer's <|endoftext|>, the one
    end token `nowait.engines.structured.templates` knows, so a template needs the tokenizer to have it.
    """
    prompt = list(request.prompt_ids)
    if not prompt:
        raise InvalidRequestError("prompt_ids is empty: a diffusion request needs a prompt to condition on")
    if any(not _is_integer(t) or not 0 <= t < config.vocab_size for t in prompt):
        raise InvalidRequestError(f"prompt_ids must be token ids in [0, {config.vocab_size})")
    request.sampling.validate()
    if not isinstance(request.options, dict):
        raise InvalidRequestError("options must be a dict of diffusion settings")
    options = resolve_options(defaults, request.options, structured=request.schema is not None)
    template = None
    if request.schema is not None:
        if not isinstance(request.schema, dict):
            raise InvalidRequestError("schema must be a JSON Schema object")
        if request.sampling.logprobs is not None:
            # The template's fixed pieces are written, never predicted: they have no logprob.
            raise InvalidRequestError("logprobs: a schema-templated diffusion answer has fixed pieces the model "
                                      "never predicts, so they have no logprob; use an AR engine")
        if compiler.codec.end_id is None:
            raise InvalidRequestError("schema: template infilling pads slots with <|endoftext|>, which this "
                                      "model's tokenizer lacks")
        try:
            template = compiler.compile(request.schema, max_tokens=request.sampling.max_tokens)
        except SchemaTemplateError as error:
            raise InvalidRequestError(f"schema: {error}") from None
        window = list(template.template.ids)
        slots = set(template.template.slot_positions)
        fillable = [i in slots for i in range(len(window))]
    else:
        window = [mask_id] * request.sampling.max_tokens
        fillable = [True] * len(window)
    if len(prompt) + len(window) > config.max_position:
        raise InvalidRequestError(f"prompt ({len(prompt)} tokens) + answer window ({len(window)}) exceeds the "
                                  f"model's {config.max_position} positions")
    return DecodePlan(request=request, options=options, prompt=prompt, window=window, fillable=fillable,
                      blocks=block_ranges(fillable, options.block), template=template,
                      # A template's slots end with the end token only; stop ids apply to free-form.
                      end_ids=frozenset({compiler.codec.end_id} if template
                                        else {*end_ids, *request.sampling.stop_token_ids}))
