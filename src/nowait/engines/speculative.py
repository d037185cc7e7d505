"""Speculative decoding: cheap proposals, verified by the target in one forward.

Two proposers share one verifier:

- **draft model** (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
  Speculative Decoding"; Chen et al. 2023): a small model with the target's vocabulary drafts
  `gamma` tokens one by one;
- **prompt lookup** (n-gram drafting, Saxena 2023; vLLM's `ngram` method): the last n tokens
  are looked up earlier in prompt + output and the tokens that followed are proposed. Free to
  compute, and it suits extraction, where most answer tokens are copied from the document.

The target scores the pending token plus the proposals in one forward; proposals are accepted
left to right with probability min(1, p(x) / q(x)) (p: target, q: draft; the issue writes them
the other way round), and at the first rejection the next token is drawn from
norm(max(0, p - q)); when all are accepted a bonus token comes from the target. This leaves the
output distributed exactly as the target's; at temperature 0 both are one-hot, so greedy
output is the target's argmax token for token. A deterministic proposer (prompt lookup) is a
draft whose q is a point mass on the proposed token.

When speculation is skipped (`should_speculate`): speculation buys tokens per target forward
with extra compute (gamma draft forwards plus gamma more positions in the verify). At small
batch a decode forward is memory- or overhead-bound and the extra positions are nearly free;
at large batch the forward is already compute-efficient and the extra positions cost their
full price while only the accepted ones pay. So a step speculates only while the running
batch is at most `max_batch` sequences and batch x (gamma + 1) positions fit the step's token
cap; above that the engine decodes normally (and the draft's cache catches up later). The
default `max_batch=4` is a CPU-side guess to be calibrated by `nowait bench batching`: set
it to the batch size at which batched decoding stops being nearly free per extra sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from nowait.engines.autoregressive import AutoregressiveEngine, EngineConfig
from nowait.engines.runner import ModelRunner
from nowait.engines.sampling import (
    SamplingBatch,
    mask_logits,
    sample_from,
    sampling_distribution,
    token_probability,
)
from nowait.engines.scheduler import ScheduledBatch
from nowait.engines.sequence import Sequence
from nowait.model import Transformer
from nowait.tokenizer import TextCodec

SpeculativeMethod = Literal["draft", "ngram"]


class IncompatibleDraftError(ValueError):
    """The draft cannot propose for this target (another vocabulary, not causal...)."""


# --- the algorithms, as pure functions ---


# Leviathan et al. 2023, Algorithm 1 (speculative sampling), for a batch of rows with their
# own number of proposals.
def speculative_accept(draft_tokens: Tensor, num_drafts: Tensor, target_probs: Tensor,
                       draft_probs: Tensor | None, accept_uniforms: Tensor,
                       sample_uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """How many proposals each row accepts, and the token that follows them.

    draft_tokens [B, K] (rows padded past `num_drafts[b]`), target_probs [B, K + 1, V]
    (p at each proposal and after the last), draft_probs [B, K, V] (q), or None for a
    deterministic proposer (q is a point mass on the proposal), uniforms [B, K] and [B].
    Returns accepted [B] and next_token [B]: the residual norm(max(0, p - q)) at the first
    rejection, the target's own distribution after the last proposal when none is rejected.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long), sample_from(target_probs[:, 0], sample_uniforms)
    p_of_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).clamp(min=1e-30)
    # u < p/q accepts with probability min(1, p/q); u is in [0, 1), so p >= q always accepts.
    accept = (accept_uniforms < p_of_draft / q_of_draft) & (torch.arange(k)[None, :] < num_drafts[:, None])
    accepted = accept.long().cumprod(-1).sum(-1)
    p_next = target_probs[rows, accepted]
    at = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    q_next = torch.where((accepted < num_drafts)[:, None], q_next, torch.zeros_like(q_next))
    residual = (p_next - q_next).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # total == 0 only if p == q, where rejection has probability 0; fall back to p for safety.
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_next)
    return accepted, sample_from(residual, sample_uniforms)


def expected_tokens_per_pass(acceptance_rate: float, gamma: int) -> float:
    """Leviathan et al. 2023, eq. 1: (1 - a^(gamma+1)) / (1 - a) tokens per target forward."""
    if acceptance_rate >= 1:
        return gamma + 1.0
    return (1 - acceptance_rate ** (gamma + 1)) / (1 - acceptance_rate)


# Prompt lookup decoding (Saxena 2023): copy what followed the latest earlier occurrence of
# the current suffix; longer suffixes first, since they predict the continuation better.
def propose_ngram(tokens: list[int] | np.ndarray, count: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the last n tokens."""
    if count <= 0:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = ids[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start: start + count].tolist()
    return []


def should_speculate(batch_size: int, gamma: int, max_batch: int, token_cap: int) -> bool:
    """The rule for skipping speculation (see the module docstring)."""
    return gamma > 0 and batch_size <= max_batch and batch_size * (gamma + 1) <= token_cap


def check_draft(target: Transformer, draft: Transformer, codec: TextCodec | None = None,
                draft_codec: TextCodec | None = None) -> None:
    """Refuse a draft that cannot propose tokens for this target."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise IncompatibleDraftError(
            f"the draft's vocabulary has {draft.config.vocab_size} tokens, the target's {target.config.vocab_size}: "
            "speculative decoding needs the same tokenizer")
    if not draft.config.causal:
        raise IncompatibleDraftError("the draft model is bidirectional; it must be causal (AR)")
    if codec is not None and draft_codec is not None and \
            codec.tokenizer.get_vocab(True) != draft_codec.tokenizer.get_vocab(True):
        raise IncompatibleDraftError("the draft's tokenizer maps tokens to other ids than the target's")


# --- the engine ---


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod = "draft"
    gamma: int = 4  # proposals per step and sequence
    max_batch: int = 4  # speculate only while at most this many sequences run
    max_ngram: int = 3
    min_ngram: int = 1

    def validate(self) -> None:
        if self.method not in ("draft", "ngram"):
            raise ValueError(f"unknown speculative method {self.method!r}; choose draft or ngram")
        if self.gamma < 1:
            raise ValueError(f"gamma must be at least 1, got {self.gamma}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


class SpeculativeEngine(AutoregressiveEngine):
    """The AR engine whose decode step proposes and verifies (draft model or prompt lookup).

    Prefill, scheduling, sampling parameters, stop tokens and grammars are the AR engine's;
    per request the Completion counts proposed and accepted draft tokens and the target's
    forwards (`tokens_per_forward` is then tokens per target pass, prefill included).
    """

    name = "spec"

    def __init__(self, model: Transformer, codec: TextCodec | None = None, config: EngineConfig | None = None,
                 *, draft: Transformer | None = None, speculative: SpeculativeConfig | None = None,
                 draft_codec: TextCodec | None = None, end_id: int | None = None, grammar=None) -> None:
        self.speculative = speculative or SpeculativeConfig()
        self.speculative.validate()
        if self.speculative.method == "draft":
            if draft is None:
                raise IncompatibleDraftError("method 'draft' needs a draft model")
            check_draft(model, draft, codec, draft_codec)
        self.draft = draft.eval() if draft is not None and self.speculative.method == "draft" else None
        super().__init__(model, codec, config, end_id=end_id, grammar=grammar)
        self.draft_runner = ModelRunner(self.draft, self.pool, 1, pad_id=self.end_id) if self.draft else None

    def _cached_models(self) -> list[Transformer]:
        return [self.model] + ([self.draft] if self.draft is not None else [])

    def _lookahead(self) -> int:
        return self.speculative.gamma + 2  # pending + gamma proposals (+ a catch-up token) per verify

    def _run_decode(self, batch: ScheduledBatch) -> None:
        seqs = self._rows(batch)
        spec = self.speculative
        if not should_speculate(len(seqs), spec.gamma, spec.max_batch, self.config.max_num_batched_tokens):
            super()._run_decode(batch)
            return
        budgets = [self._proposal_budget(s) for s in seqs]
        if not any(budgets):  # every row is one token from its end: nothing to propose
            super()._run_decode(batch)
            return
        params = SamplingBatch.from_params([s.request.sampling for s in seqs])
        if self.draft is not None:
            proposals, draft_probs = self._draft_proposals(seqs, budgets, params)
        else:
            proposals, draft_probs = [self._ngram_proposal(s, b) for s, b in zip(seqs, budgets, strict=True)], None
        self._verify(seqs, proposals, draft_probs, params)

    def _proposal_budget(self, seq: Sequence) -> int:
        # The verify always yields one token of its own, so propose at most remaining - 1.
        return max(0, min(self.speculative.gamma, seq.remaining_tokens - 1))

    def _ngram_proposal(self, seq: Sequence, budget: int) -> list[int]:
        proposal = propose_ngram(seq.prompt_ids + seq.output_ids, budget,
                                 self.speculative.max_ngram, self.speculative.min_ngram)
        for i, token in enumerate(proposal):
            if token in seq.stop_ids:  # nothing after a stop token matters
                proposal = proposal[: i + 1]
                break
        if seq.matcher is not None:
            # A proposal is a deterministic function of the context, so cutting it at the
            # first token the grammar forbids changes nothing but the wasted positions.
            if proposal and proposal[-1] in seq.stop_ids:
                proposal = proposal[:-1]
            proposal = proposal[: seq.matcher.valid_prefix(proposal)]
        return proposal

    def _draft_proposals(self, seqs: list[Sequence], budgets: list[int],
                         params: SamplingBatch) -> tuple[list[list[int]], Tensor]:
        """gamma tokens per row from the draft model, sampled from its (masked) distributions."""
        runner = self.draft_runner
        unseen = [s.tokens_from(s.draft_cached) for s in seqs]
        # Rows far behind (new, or after steps without speculation) catch up in one prefill-
        # like forward, so the first draft forward below feeds at most two tokens per row.
        behind = [i for i, u in enumerate(unseen) if len(u) > 2]
        if behind:
            runner.extend([seqs[i] for i in behind], [seqs[i].draft_cached for i in behind],
                          [unseen[i][:-1] for i in behind])
            for i in behind:
                seqs[i].draft_cached += len(unseen[i]) - 1
                seqs[i].draft_forwards += 1
                unseen[i] = unseen[i][-1:]
        steps = max(budgets)
        rows = torch.arange(len(seqs))
        logits = runner.forward_rows(unseen)[rows, torch.tensor([len(u) - 1 for u in unseen])]
        for seq, u in zip(seqs, unseen, strict=True):
            seq.draft_cached += len(u)
        proposals: list[list[int]] = [[] for _ in seqs]
        distributions = []
        consumed = [0] * len(seqs)
        live = list(budgets)  # proposals still wanted per row (0 after a stop token)
        for step in range(steps):
            for i, seq in enumerate(seqs):
                if seq.matcher is not None and live[i] > step:
                    mask_logits(logits[i], seq.matcher.allowed())
            q = sampling_distribution(logits, params)
            uniforms = torch.full((len(seqs),), 0.5)
            for i, seq in enumerate(seqs):
                if seq.generator is not None and live[i] > step:
                    uniforms[i] = torch.rand(1, generator=seq.generator)[0]
            tokens = sample_from(q, uniforms).tolist()
            distributions.append(q)
            for i, seq in enumerate(seqs):
                if live[i] <= step:
                    continue
                proposals[i].append(tokens[i])
                if tokens[i] in seq.stop_ids:
                    live[i] = step + 1
                elif seq.matcher is not None:
                    seq.matcher.consume(tokens[i])
                    consumed[i] += 1
                    if seq.matcher.is_stopped():
                        live[i] = step + 1
            if step + 1 < steps:
                logits = runner.forward_rows([[t] for t in tokens])[:, -1]
                for seq in seqs:
                    seq.draft_cached += 1
        for seq, n in zip(seqs, consumed, strict=True):
            if seq.matcher is not None:
                seq.matcher.rollback(n)
        for seq in seqs:
            seq.draft_forwards += steps
        return proposals, torch.stack(distributions, dim=1)

    def _grammar_masks(self, seq: Sequence, proposal: list[int]) -> list[Tensor]:
        """The allowed-token mask at the pending position and after each proposal token."""
        matcher = seq.matcher
        masks = [matcher.allowed()]
        consumed = 0
        for token in proposal:
            if token in seq.stop_ids:
                break
            matcher.consume(token)
            consumed += 1
            masks.append(matcher.allowed())
        matcher.rollback(consumed)
        seq.grammar_mask_s = matcher.mask_seconds
        return masks

    def _verify(self, seqs: list[Sequence], proposals: list[list[int]], draft_probs: Tensor | None,
                params: SamplingBatch) -> None:
        """One target forward over pending + proposals for every row; accept, roll back."""
        counts = [len(p) for p in proposals]
        width = max(counts)
        logits = self.runner.forward_rows([[s.last_token, *p] for s, p in zip(seqs, proposals, strict=True)])
        constrained = logits
        if any(s.matcher is not None for s in seqs):
            constrained = logits.clone()
            for i, seq in enumerate(seqs):
                if seq.matcher is not None:
                    for position, allowed in enumerate(self._grammar_masks(seq, proposals[i])):
                        mask_logits(constrained[i, position], allowed)
        batch = len(seqs)
        target_probs = sampling_distribution(constrained.reshape(batch * (width + 1), -1),
                                             params.repeat_rows(width + 1)).view(batch, width + 1, -1)
        draft_tokens = torch.zeros(batch, width, dtype=torch.long)
        accept_uniforms = torch.full((batch, width), 0.5)
        sample_uniforms = torch.full((batch,), 0.5)
        for i, (seq, proposal) in enumerate(zip(seqs, proposals, strict=True)):
            draft_tokens[i, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            if seq.generator is not None:  # exactly len(proposal) + 1 draws: batch-independent
                draws = torch.rand(len(proposal) + 1, generator=seq.generator)
                accept_uniforms[i, : len(proposal)] = draws[:-1]
                sample_uniforms[i] = draws[-1]
        if draft_probs is not None:
            draft_probs = draft_probs[:, :width]
        accepted, next_tokens = speculative_accept(draft_tokens, torch.tensor(counts), target_probs, draft_probs,
                                                   accept_uniforms, sample_uniforms)
        emitted = torch.cat([draft_tokens, torch.zeros(batch, 1, dtype=torch.long)], dim=1)
        emitted[torch.arange(batch), accepted] = next_tokens
        confidences = token_probability(logits, emitted).tolist()
        emitted_ids = emitted.tolist()
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            n = int(accepted[i])
            seq.forwards += 1
            seq.draft_proposed += counts[i]
            seq.draft_accepted += n
            seq.num_cached += 1 + n  # pending + accepted stay in the cache; the new token is pending
            for position in range(n + 1):
                if seq.append_token(emitted_ids[i][position], confidences[i][position], now):
                    break
            seq.draft_cached = min(seq.draft_cached, seq.num_cached)
        self.runner.truncate_rows([s.num_cached for s in seqs])
        if self.draft_runner is not None:
            self.draft_runner.truncate_rows([s.draft_cached for s in seqs])
