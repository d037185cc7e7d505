"""DiffusionGemma's sampler and decode loop, as transformers' reference generate() runs them.

Source: transformers 5.x, models/diffusion_gemma/generation_diffusion_gemma.py. Unlike LLaDA,
the canvas is not masked: it starts as uniformly random tokens, and each denoising step

1. runs the denoiser over the canvas (self-conditioned on the previous step's logits),
2. scales the logits by the step's temperature (`step_temperature`, linear from t_max at the
   first step to t_min at the last: LinearTemperatureScheduleLogitsProcessor),
3. samples a token at every position and keeps those of the lowest-entropy positions whose
   summed entropy, less the largest of them, stays within the bound (`entropy_bound_accept`,
   EntropyBoundSampler.accept_canvas, after arXiv 2505.24857),
4. re-noises every other position with fresh random tokens (renoise_canvas),
5. stops early once the argmax canvas has not changed for `stability_threshold` steps and the
   mean entropy is below `confidence_threshold` (StableAndConfidentStoppingCriteria).

The block's tokens are the last step's argmax canvas; it is then appended to the prompt's cache
by the encoder and the next block starts. A row ends at the first end id in a block. The random
draws are made in the reference's order (canvas, then per step a multinomial and a re-noising
draw) from one generator, so one seed gives transformers' tokens exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from nowait.engines.base import TokenLogprob
from nowait.engines.logprobs import chosen_logprobs
from nowait.model.diffusion_gemma import DiffusionGemma, PromptCache


@dataclass(frozen=True)
class GemmaSampling:
    """The reference's defaults (DiffusionGemmaGenerationConfig._get_default_generation_params)."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    @classmethod
    def from_generation_config(cls, generation: dict) -> GemmaSampling:
        """A checkpoint's generation_config.json values over the defaults."""
        defaults = cls()
        sampler = generation.get("sampler_config") or {}
        return cls(
            max_denoising_steps=int(generation.get("max_denoising_steps") or defaults.max_denoising_steps),
            entropy_bound=float(sampler.get("entropy_bound", defaults.entropy_bound)),
            t_min=float(generation.get("t_min", defaults.t_min)),
            t_max=float(generation.get("t_max", defaults.t_max)),
            stability_threshold=int(generation.get("stability_threshold", defaults.stability_threshold)),
            confidence_threshold=float(generation.get("confidence_threshold", defaults.confidence_threshold)),
        )


def step_temperature(remaining: int, steps: int, t_min: float, t_max: float) -> float:
    """t = t_min + (t_max - t_min) * n / N, where n counts the steps *remaining* (N first, 1 last)."""
    return t_min + (t_max - t_min) * (remaining / steps)


def token_entropy(logits: Tensor) -> Tensor:
    """Per-position entropy of softmax(logits), as torch.distributions.Categorical computes it."""
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)
    clamped = torch.clamp(normalized, min=torch.finfo(normalized.dtype).min)
    return -(clamped * normalized.softmax(-1)).sum(-1)


def entropy_bound_accept(logits: Tensor, bound: float) -> Tensor:
    """[B, L] True at the k lowest-entropy positions with sum(entropy_1..k) - max(entropy_1..k) <= bound
    (the positions' joint mutual information bound): always at least the most certain one."""
    entropy = token_entropy(logits)
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    selected = ordered.cumsum(-1) - ordered <= bound  # ascending: the running max is the current one
    return torch.scatter(torch.zeros_like(selected), -1, order, selected)


@dataclass
class StabilityTracker:
    """StableAndConfidentStoppingCriteria for one block: the argmax canvases of the last
    `threshold` steps, and the mean-entropy test."""

    threshold: int
    confidence: float
    history: Tensor | None = None

    def done(self, argmax: Tensor, logits: Tensor) -> Tensor:
        if self.threshold == 0:
            stable = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        else:
            if self.history is None:
                self.history = torch.full((self.threshold, *argmax.shape), -1, dtype=argmax.dtype,
                                          device=argmax.device)
            stable = (self.history == argmax[None]).all(-1).all(0)
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax
        return stable & (token_entropy(logits).mean(-1) < self.confidence)


@dataclass
class GemmaBlock:
    """One finished block: its tokens (the last argmax canvas), the denoiser passes it took, and
    each token's probability under the last step's raw (temperature 1) logits."""

    tokens: Tensor  # [L]
    forwards: int
    probabilities: Tensor  # [L]
    logprobs: list[TokenLogprob] | None = None  # [L], the same distribution's, when asked for


@dataclass
class GemmaDecode:
    tokens: list[int]  # generated ids before the first end id, at most max_new_tokens
    finish_reason: str  # "stop" (an end id) or "length"
    blocks: list[GemmaBlock] = field(default_factory=list)

    @property
    def forwards(self) -> int:
        return sum(block.forwards for block in self.blocks)


@torch.no_grad()
def denoise_block(model: DiffusionGemma, cache: PromptCache, sampling: GemmaSampling,
                  generator: torch.Generator | None, logprobs: int | None = None) -> GemmaBlock:
    """One canvas of the reference's inner loop, for one row over `cache`; `logprobs` (a top
    count) adds each token's logprob under the same distribution as its probability."""
    c = model.config
    device = model.embed_tokens.weight.device
    canvas = torch.randint(0, c.vocab_size, (1, c.canvas_length), device=device, generator=generator)
    tracker = StabilityTracker(sampling.stability_threshold, sampling.confidence_threshold)
    self_conditioning, argmax, processed, forwards = None, canvas, None, 0
    steps = sampling.max_denoising_steps
    for remaining in range(steps, 0, -1):
        logits = model.denoise(canvas, cache, self_conditioning)
        forwards += 1
        processed = logits / step_temperature(remaining, steps, sampling.t_min, sampling.t_max)
        probabilities = torch.softmax(processed, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probabilities.view(-1, c.vocab_size), 1, generator=generator).view(canvas.shape)
        argmax = processed.argmax(-1)
        accepted = entropy_bound_accept(processed, sampling.entropy_bound)
        kept = torch.where(accepted, sampled, canvas)
        noise = torch.randint(0, c.vocab_size, canvas.shape, device=device, generator=generator)
        canvas = torch.where(accepted, kept, noise)
        finished = bool(tracker.done(argmax, processed)[0])
        self_conditioning = processed.to(model.embed_tokens.weight.dtype)
        if finished:
            break
    # The model's own probability of each chosen token (temperature 1): the schedule's low final
    # temperature would report near-certainty for any argmax.
    chosen = logits.softmax(-1, dtype=torch.float32).gather(-1, argmax[..., None])[..., 0]
    kept = None if logprobs is None else chosen_logprobs(logits[0], argmax[0], logprobs)
    return GemmaBlock(tokens=argmax[0], forwards=forwards, probabilities=chosen[0], logprobs=kept)


def decode_blocks(model: DiffusionGemma, prompt: list[int], max_new_tokens: int, end_ids: tuple[int, ...],
                  sampling: GemmaSampling, generator: torch.Generator | None = None,
                  logprobs: int | None = None) -> Iterator[GemmaBlock]:
    """The reference's outer loop for one prompt, one finished block at a time: encode, denoise
    a block, append it, until a block holds an end id or ceil(max_new_tokens / canvas_length)
    blocks are done."""
    if max_new_tokens <= 0:
        raise ValueError("max_new_tokens must be positive")
    device = model.embed_tokens.weight.device
    cache = PromptCache(model.config.num_layers)
    pending = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(-(-max_new_tokens // model.config.canvas_length)):
        with torch.no_grad():
            model.encode(pending, cache)
            block = denoise_block(model, cache, sampling, generator, logprobs)
        yield block
        if any(token in end_ids for token in block.tokens.tolist()):
            return
        pending = block.tokens[None]


def answer_of(blocks: list[GemmaBlock], max_new_tokens: int, end_ids: tuple[int, ...]) -> GemmaDecode:
    """The answer the blocks so far spell: their tokens up to the first end id ("stop"), at most
    `max_new_tokens` of them ("length": whole blocks are denoised, the answer ends at the limit)."""
    ids = [token for block in blocks for token in block.tokens.tolist()]
    end = next((i for i, token in enumerate(ids) if token in end_ids), None)
    if end is not None and end <= max_new_tokens:
        return GemmaDecode(tokens=ids[:end], finish_reason="stop", blocks=list(blocks))
    return GemmaDecode(tokens=ids[:max_new_tokens], finish_reason="length", blocks=list(blocks))


def generate_diffusion_gemma(model: DiffusionGemma, prompt: list[int], max_new_tokens: int, end_ids: tuple[int, ...],
                             sampling: GemmaSampling, generator: torch.Generator | None = None,
                             logprobs: int | None = None) -> GemmaDecode:
    """The whole decode of one prompt (`decode_blocks`, then `answer_of`)."""
    blocks = list(decode_blocks(model, prompt, max_new_tokens, end_ids, sampling, generator, logprobs))
    return answer_of(blocks, max_new_tokens, end_ids)
