"""Each serving engine as a step model: how long a step of a batch takes and how far it moves each request.

The capacity simulator only sees this interface; the forward timer underneath is the roofline or a
measured profile. A "step" is the unit at which a running batch can admit and retire requests:
one decode forward for AR, one draft-and-verify cycle for speculative decoding, one block for
diffusion (diffusion batches join and leave at block boundaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from nowait.planner.roofline import ForwardTimer

ENGINES = ("ar", "spec", "diffusion")


class ServingModel(Protocol):
    name: str
    max_batch: int
    kv_token_budget: float  # tokens of KV cache one replica holds beside its weights

    @property
    def tokens_per_step(self) -> float: ...

    def prefill_seconds(self, prompt_tokens: float, prompts: int) -> float: ...

    def step_seconds(self, batch: int, mean_context: float, mean_remaining: float) -> float: ...

    def kv_tokens(self, input_tokens: float, output_tokens: float) -> float: ...


# Leviathan, Kalman, Matias 2023 ("Fast inference from transformers via speculative decoding"), eq. (1):
# expected tokens per target pass with acceptance rate a and gamma drafted tokens.
def expected_tokens_per_target_pass(acceptance_rate: float, gamma: int) -> float:
    if acceptance_rate >= 1.0:
        return gamma + 1.0
    return (1.0 - acceptance_rate ** (gamma + 1)) / (1.0 - acceptance_rate)


# Leviathan et al. 2023, Theorem 3.8: walltime improvement when a draft forward costs c target forwards.
def speculative_speedup(acceptance_rate: float, gamma: int, draft_cost_ratio: float) -> float:
    return expected_tokens_per_target_pass(acceptance_rate, gamma) / (gamma * draft_cost_ratio + 1.0)


# Fast-dLLM (Wu et al. 2025): committing every position above the confidence threshold, a block of width W
# takes about W / k forwards when k tokens are committed per forward on average (never fewer than one).
def forwards_per_block(block_width: int, tokens_per_forward: float) -> float:
    return max(1.0, block_width / tokens_per_forward)


def steps_for(output_tokens: float, tokens_per_step: float) -> int:
    return max(1, math.ceil(output_tokens / tokens_per_step - 1e-9))


def restored_tokens(shared_prefix_tokens: float, prompt_tokens: float) -> float:
    """Prompt tokens a prefix cache restores instead of computing: the shared prefix, leaving at
    least the prompt's last token to compute (its logits choose the first output token)."""
    return max(0.0, min(shared_prefix_tokens, prompt_tokens - 1))


@dataclass(frozen=True)
class AutoregressiveServing:
    """One token per forward per sequence; continuous batching (Orca, vLLM) under a batch cap.
    `shared_prefix_tokens`: a beginning every prompt shares, which the prefix cache restores:
    the prefill computes the rest over it."""

    target: ForwardTimer
    max_batch: int = 256
    kv_token_budget: float = math.inf
    name: str = "ar"
    shared_prefix_tokens: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return 1.0

    def prefill_seconds(self, prompt_tokens: float, prompts: int) -> float:
        restored = restored_tokens(self.shared_prefix_tokens, prompt_tokens)
        return self.target(prompt_tokens - restored, restored, prompts)

    def step_seconds(self, batch: int, mean_context: float, mean_remaining: float) -> float:
        return self.target(1, mean_context, batch)

    def kv_tokens(self, input_tokens: float, output_tokens: float) -> float:
        return input_tokens + output_tokens


@dataclass(frozen=True)
class SpeculativeServing:
    """AR with a draft: gamma draft forwards, then one target forward verifies gamma + 1 positions."""

    target: ForwardTimer
    draft: ForwardTimer
    gamma: int = 4
    acceptance_rate: float = 0.75
    max_batch: int = 256
    kv_token_budget: float = math.inf
    name: str = "spec"
    shared_prefix_tokens: float = 0.0  # restored for the target only: the draft keeps no prefix cache

    @property
    def tokens_per_step(self) -> float:
        return expected_tokens_per_target_pass(self.acceptance_rate, self.gamma)

    def prefill_seconds(self, prompt_tokens: float, prompts: int) -> float:
        restored = restored_tokens(self.shared_prefix_tokens, prompt_tokens)
        return self.target(prompt_tokens - restored, restored, prompts) + self.draft(prompt_tokens, 0, prompts)

    def step_seconds(self, batch: int, mean_context: float, mean_remaining: float) -> float:
        drafting = self.gamma * self.draft(1, mean_context, batch)
        return drafting + self.target(self.gamma + 1, mean_context, batch)

    def kv_tokens(self, input_tokens: float, output_tokens: float) -> float:
        return input_tokens + output_tokens + self.gamma


DIFFUSION_CACHE_MODES = ("none", "prefix", "dual", "dual-blocks", "block")


@dataclass(frozen=True)
class DiffusionServing:
    """Masked diffusion, block by block; a step is one block of `block_width` tokens for every sequence.

    Cache modes (what one forward reads and computes):
      none   - LLaDA's reference: every forward runs over the prompt and the whole answer window;
      prefix - Fast-dLLM prefix cache: a full forward refreshes the cache at each block start, the
               others run over the current block and the masked suffix after it;
      dual   - Fast-dLLM dual cache: a full refresh per block, the others over the current block only;
      dual-blocks - the nowait engine's default (`refresh="blocks"`): each block's refresh runs over
               the finished block and the new one, reading the prompt, the earlier answer and the
               suffix from the cache; the others over the current block (a shrinking open range
               with `cache_decoded`, not modelled: an upper bound);
      block  - prompt prefilled once and each committed block appended to the cache (exact under a
               block-causal mask): every forward over the current block, plus one forward per block
               to write the committed block's keys and values.
    """

    model: ForwardTimer
    block_width: int = 32
    tokens_per_forward: float = 4.0
    cache: str = "dual"
    max_batch: int = 64
    kv_token_budget: float = math.inf
    name: str = "diffusion"

    @property
    def tokens_per_step(self) -> float:
        return float(self.block_width)

    def prefill_seconds(self, prompt_tokens: float, prompts: int) -> float:
        if self.cache == "none":
            return 0.0  # nothing is cached: every forward re-reads the prompt
        return self.model(prompt_tokens, 0, prompts)

    def step_seconds(self, batch: int, mean_context: float, mean_remaining: float) -> float:
        width = self.block_width
        forwards = forwards_per_block(width, self.tokens_per_forward)
        suffix = max(mean_remaining - width, 0.0)  # masked positions after the current block
        whole = mean_context + width + suffix
        if self.cache == "none":
            return forwards * self.model(whole, 0, batch)
        if self.cache == "block":
            return (forwards + 1) * self.model(width, mean_context, batch)
        if self.cache == "dual-blocks":
            context = mean_context + suffix
            return self.model(2 * width, context, batch) + (forwards - 1) * self.model(width, context, batch)
        refresh = self.model(whole, 0, batch)
        if self.cache == "prefix":
            cached_forward = self.model(width + suffix, mean_context, batch)
        else:  # dual: block only, reading prefix and suffix from the cache
            cached_forward = self.model(width, mean_context + suffix, batch)
        return refresh + (forwards - 1) * cached_forward

    def kv_tokens(self, input_tokens: float, output_tokens: float) -> float:
        return input_tokens + steps_for(output_tokens, self.block_width) * self.block_width


def request_seconds(serving: ServingModel, batch: int, input_tokens: float, output_tokens: float) -> float:
    """Latency of one request that runs in a full batch of `batch` from admission to its last token."""
    return serving.prefill_seconds(input_tokens, 1) + generation_seconds(serving, batch, input_tokens, output_tokens)


def generation_seconds(serving: ServingModel, batch: int, input_tokens: float, output_tokens: float) -> float:
    """Time from the first to the last output step (context taken at the middle of the answer)."""
    steps = steps_for(output_tokens, serving.tokens_per_step)
    middle = output_tokens / 2
    return steps * serving.step_seconds(batch, input_tokens + middle, middle)


def single_stream_tokens_per_s(serving: ServingModel, input_tokens: float, output_tokens: float) -> float:
    """Decode speed of one request alone on a replica (prefill excluded, as decode benchmarks report it)."""
    return output_tokens / generation_seconds(serving, 1, input_tokens, output_tokens)


def replica_tokens_per_s(serving: ServingModel, batch: int, input_tokens: float, output_tokens: float) -> float:
    """Output tokens per second of one replica kept full at `batch` with continuous admission.

    In steady state each request costs its own prefill plus a 1/batch share of the steps it rides in.
    """
    steps = steps_for(output_tokens, serving.tokens_per_step)
    middle = output_tokens / 2
    share = serving.prefill_seconds(input_tokens, 1) + steps * serving.step_seconds(
        batch, input_tokens + middle, middle) / batch
    return output_tokens / share
