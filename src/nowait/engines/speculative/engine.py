"""Speculative decoding: cheap proposals, verified by the target in one forward.

Three proposers share one verifier:

- **draft model** (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
  Speculative Decoding"; Chen et al. 2023): a small model with the target's vocabulary drafts
  up to `gamma` tokens one by one, and stops early after a token it is unsure of
  (`draft_confidence`: the draft's own probability of its proposal), because a proposal the
  draft doubts is likely rejected and every further draft forward would build on it;
- **prompt lookup** (n-gram drafting, Saxena 2023; vLLM's `ngram` method): the last n tokens
  are looked up earlier in prompt + output and the tokens that followed are proposed. Free to
  compute, and it suits extraction, where most answer tokens are copied from the document;
- **hybrid**: prompt lookup when the last `hybrid_min_ngram` or more tokens occur earlier in
  the prompt (a copy in progress: a value from the document), the draft model otherwise (JSON
  keys and punctuation, which are not in the document), and a lookup finishes a proposal the
  draft started as soon as its tokens match the prompt. A one-token match, or one inside the
  output (keys and punctuation repeat there), proposes mostly noise; a longer match in the
  prompt mostly the right copy; and a looked-up token costs no draft forward, which on small
  models costs about half a target forward;
- **diffusion** (speculative diffusion decoding, Christopher et al. 2024, arXiv 2408.05636): a
  diffusion model drafts the whole answer in a few parallel forwards (`drafter`, a
  `DiffusionEngine` with the target's tokenizer), or the request brings a drafted answer
  (`GenerationRequest.draft_ids`, e.g. a diffusion answer the gateway falls back from; every
  method verifies such an answer); the target then verifies up to `answer_gamma` of its tokens
  per forward. Where the target disagrees, the rest of the draft usually still fits a token or
  two later (a value one token longer), so each proposal re-aligns the output's last tokens on
  the draft (`propose_from_draft`), as prompt lookup does on the prompt.

How the target accepts proposals is `acceptance.py`; when a step speculates at all, `config.py`
(`should_speculate`).
"""

from __future__ import annotations

import collections.abc
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.ar.prompt_lookup import PromptLookup
from nowait.engines.ar.runner import ModelRunner
from nowait.engines.ar.sampling import (
    SamplingBatch,
    mask_logits,
    sample_from,
    sampling_distribution,
    token_probability,
)
from nowait.engines.ar.scheduler import ScheduledBatch
from nowait.engines.ar.sequence import Sequence
from nowait.engines.base import Completion, GenerationRequest, SamplingParams, TokenLogprob
from nowait.engines.logprobs import row_logprobs
from nowait.engines.speculative.acceptance import greedy_accept, proposal_distributions, speculative_accept
from nowait.engines.speculative.answers import propose_from_draft
from nowait.engines.speculative.config import SpeculativeConfig, should_speculate
from nowait.engines.speculative.drafters import IncompatibleDraftError, check_draft, check_drafter_model
from nowait.model import Transformer
from nowait.tokenizer import TextCodec

if TYPE_CHECKING:  # the diffusion engine loads only where a drafter is given
    from nowait.engines.diffusion.engine import DiffusionEngine

log = logging.getLogger(__name__)


class SpeculativeEngine(AutoregressiveEngine):
    """The AR engine whose decode step proposes and verifies (draft model, prompt lookup, both,
    or a diffusion model's drafted answer).

    Prefill, scheduling, sampling parameters, stop tokens and grammars are the AR engine's;
    per request the Completion counts proposed and accepted draft tokens and the target's
    forwards (`tokens_per_forward` is then tokens per target pass, prefill included).
    """

    name = "spec"

    def __init__(self, model: Transformer, codec: TextCodec | None = None, config: EngineConfig | None = None,
                 *, draft: Transformer | None = None, speculative: SpeculativeConfig | None = None,
                 draft_codec: TextCodec | None = None, end_id: int | None = None,
                 end_ids: collections.abc.Sequence[int] | None = None, grammar=None,
                 drafter: DiffusionEngine | None = None) -> None:
        """`draft_codec`: the draft checkpoint's tokenizer; given, a draft whose tokens mean
        something else than the target's is refused (`check_draft`). `drafter`: the diffusion
        engine that drafts answers (method diffusion). `end_id`, `end_ids`: as for
        `AutoregressiveEngine`."""
        self.speculative = speculative or SpeculativeConfig()
        self.speculative.validate()
        if self.speculative.uses_draft:
            if draft is None:
                raise IncompatibleDraftError(f"method {self.speculative.method!r} needs a draft model")
            check_draft(model, draft, codec, draft_codec)
        if self.speculative.uses_drafter:
            if drafter is None:
                raise IncompatibleDraftError("method 'diffusion' needs a diffusion drafter (a DiffusionEngine)")
            check_drafter_model(model, drafter.model, codec, drafter.codec)
        self.drafter = drafter if self.speculative.uses_drafter else None
        self.draft = draft.eval() if draft is not None and self.speculative.uses_draft else None
        super().__init__(model, codec, config, end_id=end_id, end_ids=end_ids, grammar=grammar)
        self.draft_runner = (ModelRunner(self.draft, self.pool, 1, pad_id=self.end_id,
                                         graphed=self._graphed(self.draft, 1)) if self.draft else None)

    def _cached_models(self) -> list[Transformer]:
        return [self.model] + ([self.draft] if self.draft is not None else [])

    def _lookahead(self) -> int:
        # Cache slots past max_model_len a row may write: the verify's pending + proposals (a
        # drafted answer's up to answer_gamma), and the draft's catch-up forward (up to
        # `_catch_up` tokens, right padded in a batch).
        return max(self._catch_up, self.speculative.widest + 1) + 1

    @property
    def _catch_up(self) -> int:
        """Unseen tokens the draft takes in its first forward of a step; rows further behind
        (new, or after steps without the draft) first catch up in a prefill-like forward."""
        return self.speculative.gamma + 2

    def _run_decode(self, batch: ScheduledBatch) -> None:
        seqs = self._rows(batch)
        spec = self.speculative
        # A drafted answer's rows may propose answer_gamma tokens: the skip rule counts them.
        width = spec.widest if any(self._has_answer(s) for s in seqs) else spec.gamma
        if not should_speculate(len(seqs), width, spec.max_batch, self.config.max_num_batched_tokens):
            super()._run_decode(batch)
            return
        budgets = [self._proposal_budget(s) for s in seqs]
        if not any(budgets):  # every row is one token from its end: nothing to propose
            super()._run_decode(batch)
            return
        # A row with a drafted answer (method diffusion, or one the request brought, whatever the
        # method) proposes from it; the others as their method does.
        self._draft_answers([s for s, b in zip(seqs, budgets, strict=True)
                             if b and s.draft_answer is None and self._has_answer(s)])
        # Where the drafted answer has nothing to offer (it ran out, or the drafter refused),
        # the method's own proposer takes over.
        from_answer = [self._answer_proposal(s, self._proposal_budget(s, spec.answer_gamma)) if b and
                       s.draft_answer is not None else [] for s, b in zip(seqs, budgets, strict=True)]
        lookups = [answer if answer else self._lookup_proposal(s, b) if spec.method in ("ngram", "hybrid") else []
                   for s, b, answer in zip(seqs, budgets, from_answer, strict=True)]
        # ngram: the lookup always; draft: the model always; hybrid: the model where no lookup.
        wants_draft = [not answer and (spec.method == "draft" or (spec.method == "hybrid" and not lookup))
                       for answer, lookup in zip(from_answer, lookups, strict=True)]
        greedy = all(s.generator is None and s.matcher is None for s in seqs)
        params = None if greedy else SamplingBatch.from_params([s.request.sampling for s in seqs], self.runner.device)
        proposals, drafted, draft_probs = lookups, [0] * len(seqs), None
        if any(b and d for b, d in zip(budgets, wants_draft, strict=True)):
            from_model, drafted, draft_probs = self._draft_proposals(
                seqs, [b if d else 0 for b, d in zip(budgets, wants_draft, strict=True)], params)
            proposals = [m if use else lookup for m, lookup, use in zip(from_model, lookups, wants_draft, strict=True)]
        if params is None:
            self._verify_greedy(seqs, proposals)
        else:
            self._verify(seqs, proposals, proposal_distributions(proposals, drafted, draft_probs), params)

    def _proposal_budget(self, seq: Sequence, gamma: int | None = None) -> int:
        # The verify always yields one token of its own, so propose at most remaining - 1.
        return max(0, min(gamma or self.speculative.gamma, seq.remaining_tokens - 1))

    def _lookup_proposal(self, seq: Sequence, budget: int, drafted: list[int] | None = None) -> list[int]:
        """Prompt lookup for one row (after this step's `drafted` tokens, if any), cut at a stop
        token and at the grammar's first refusal."""
        spec = self.speculative
        lookup = seq.prompt_lookup
        if lookup is None:
            # Hybrid takes matches of hybrid_min_ngram tokens or more (shorter ones go to the
            # draft) and only in the prompt: in the output, repeated keys and punctuation
            # would propose the wrong continuation where the draft model knows the right one.
            if spec.method == "hybrid":
                lookup = PromptLookup(spec.max_ngram, spec.hybrid_min_ngram, search_limit=seq.num_prompt_tokens)
            else:
                lookup = PromptLookup(spec.max_ngram, spec.min_ngram)
            seq.prompt_lookup = lookup
        lookup.extend(seq.tokens_from(len(lookup.tokens)))
        proposal, _ = lookup.propose(min(budget, spec.lookup_gamma or budget), drafted or ())
        return self._trim_proposal(seq, proposal)

    def _has_answer(self, seq: Sequence) -> bool:
        """Whether the row's proposals come from a drafted answer: method diffusion's, or the
        one its request brought (any method)."""
        return self.speculative.method == "diffusion" or seq.request.draft_ids is not None

    def _draft_answers(self, seqs: list[Sequence]) -> None:
        """The answer each sequence's proposals come from, the end token after it: the
        request's `draft_ids`, else the drafter's answer (one batched diffusion run; the end
        token only after an answer that stopped). The drafter decodes greedily: the proposals
        must be a function of the context alone for the acceptance test to keep the target's
        distribution. It runs inside this step, so the other rows of the batch wait for it."""
        wanted = []
        for seq in seqs:
            if seq.request.draft_ids is not None:
                seq.draft_answer = [*seq.request.draft_ids, self.end_id]
            else:
                wanted.append(seq)
        # The drafter's window must fit its positions; the target's output is capped by its own.
        room = {s.seq_id: min(s.max_tokens, self.drafter.model.config.max_position - len(s.prompt_ids) - 1)
                for s in wanted}
        for seq in wanted:
            seq.draft_answer = []  # until the drafter answers: a refused or failed draft proposes nothing
        wanted = [s for s in wanted if room[s.seq_id] > 0]
        if not wanted:
            return
        tau = self.speculative.drafter_tau
        requests = [GenerationRequest(s.prompt_ids, SamplingParams(max_tokens=room[s.seq_id]),
                                      request_id=str(s.seq_id), options={} if tau is None else {"tau": tau})
                    for s in wanted]
        try:
            answers = self.drafter.generate(requests)
        except Exception:  # a drafter failure must not fail the target's requests
            answers = [self._draft_alone(r) for r in requests]  # find the request it fails on
        for seq, answer in zip(wanted, answers, strict=True):
            if answer is not None:
                seq.draft_answer = answer.token_ids + ([self.end_id] if answer.finish_reason == "stop" else [])
                seq.draft_forwards += answer.forwards

    def _draft_alone(self, request: GenerationRequest) -> Completion | None:
        """One request's draft, or None (logged) when the drafter fails on it: the sequence
        then decodes with its method's proposals only."""
        try:
            return self.drafter.generate([request])[0]
        except Exception as error:
            log.warning("the diffusion drafter failed on request %s (%s); it decodes without a draft",
                        request.request_id, error)
            return None

    def _answer_proposal(self, seq: Sequence, budget: int) -> list[int]:
        """The drafted answer from where the output stands in it (`propose_from_draft`)."""
        spec = self.speculative
        proposal, seq.draft_shift = propose_from_draft(seq.draft_answer, seq.output_ids, budget, seq.draft_shift,
                                                       spec.max_ngram, min(spec.hybrid_min_ngram, spec.max_ngram))
        return self._trim_proposal(seq, proposal)

    def _trim_proposal(self, seq: Sequence, proposal: list[int]) -> list[int]:
        """A proposal cut after a stop token and at the grammar's first refusal."""
        for i, token in enumerate(proposal):
            if token in seq.stop_ids:  # nothing after a stop token matters
                proposal = proposal[: i + 1]
                break
        if seq.matcher is not None:
            # A proposal is a deterministic function of the context, so cutting it at the
            # first token the grammar forbids changes nothing but the wasted positions.
            # (The matcher stands after `drafted`: the draft loop consumed them.)
            if proposal and proposal[-1] in seq.stop_ids:
                proposal = proposal[:-1]
            proposal = proposal[: seq.matcher.valid_prefix(proposal)]
        return proposal

    def _draft_catch_up(self, seqs: list[Sequence], tokens: list[list[int]]) -> None:
        """Feed `tokens[i]` to the draft cache of `seqs[i]`, in chunks that keep every forward
        within `max_num_batched_tokens` positions (rows x longest chunk), as the target's prefill
        is: a long prompt's catch-up must not make one step far costlier than the cap promises."""
        budget = self.config.max_num_batched_tokens
        pending = {i: left for i, left in enumerate(tokens) if left}
        while pending:
            rows = list(pending)
            width = max(1, budget // len(rows))  # rows <= max_num_seqs <= the budget
            chunks = [pending[i][:width] for i in rows]
            self.draft_runner.extend([seqs[i] for i in rows], [seqs[i].draft_cached for i in rows], chunks)
            for i, chunk in zip(rows, chunks, strict=True):
                seqs[i].draft_cached += len(chunk)
                seqs[i].draft_forwards += 1
                pending[i] = pending[i][len(chunk):]
            pending = {i: left for i, left in pending.items() if left}

    def _draft_proposals(self, seqs: list[Sequence], budgets: list[int], params: SamplingBatch | None
                         ) -> tuple[list[list[int]], list[int], Tensor | None]:
        """Up to budgets[i] tokens for row i from the draft model: its argmax when `params` is
        None (every row greedy and unconstrained), else draws from its (masked) sampling
        distributions, returned [B, steps, V] for the acceptance test.

        Hybrid: as soon as a row's drafted tokens start a copy (prompt lookup matches the
        context plus them), the lookup's continuation finishes the row's proposal without more
        draft forwards. Returns proposals, the number of leading proposals per row that came
        from the draft model (the rest are lookups, point masses), and the distributions.
        """
        runner = self.draft_runner
        unseen = [s.tokens_from(s.draft_cached) for s in seqs]
        # Rows far behind (new, or after many steps without the draft) catch up in prefill-like
        # forwards first, so the first draft forward below feeds at most `_catch_up` tokens a row.
        behind = [i for i, u in enumerate(unseen) if len(u) > self._catch_up]
        if behind:
            self._draft_catch_up([seqs[i] for i in behind], [unseen[i][:-1] for i in behind])
            for i in behind:
                unseen[i] = unseen[i][-1:]
        logits = last_logits(runner.forward_rows(unseen), [len(u) for u in unseen])
        for seq, u in zip(seqs, unseen, strict=True):
            seq.draft_cached += len(u)
            seq.draft_forwards += 1
        proposals: list[list[int]] = [[] for _ in seqs]
        drafted = [0] * len(seqs)
        distributions = []
        consumed = [0] * len(seqs)
        live = list(budgets)  # proposals still wanted per row: the budget, cut by a stop or doubt
        threshold = self.speculative.draft_confidence
        hybrid = self.speculative.method == "hybrid"
        for step in range(max(budgets)):
            sure = None
            if params is None and threshold > 0:
                # Greedy draft: which proposal barely matters for correctness (the target
                # decides), so the softmax's max gives token and confidence in one pass.
                confidence, tokens = logits.softmax(-1).max(-1)
                sure = (confidence >= threshold).tolist()
            elif params is None:
                tokens = logits.argmax(-1)
            else:
                tokens, q = self._sample_draft(seqs, logits, params, [b > step for b in live])
                distributions.append(q)
                if threshold > 0:
                    sure = (token_probability(logits, tokens) >= threshold).tolist()
            chosen = tokens.tolist()
            proposed = []
            for i, seq in enumerate(seqs):
                if live[i] <= step:
                    continue
                token = chosen[i]
                proposals[i].append(token)
                drafted[i] += 1
                proposed.append(i)
                if token in seq.stop_ids or (sure is not None and not sure[i]):
                    live[i] = step + 1
                    continue
                if seq.matcher is not None:
                    seq.matcher.consume(token)
                    consumed[i] += 1
                    if seq.matcher.is_stopped():
                        live[i] = step + 1
                        continue
                if hybrid and live[i] > step + 1:
                    copied = self._lookup_proposal(seq, live[i] - step - 1, proposals[i])
                    if copied:
                        proposals[i] += copied
                        live[i] = step + 1
            if all(b <= step + 1 for b in live):  # no row wants another proposal
                break
            logits = runner.forward_rows([[t] for t in chosen])[:, -1]
            for i in proposed:  # rows past their last proposal were fed a placeholder: not cached
                seqs[i].draft_cached += 1
            for seq in seqs:
                seq.draft_forwards += 1
        for seq, n in zip(seqs, consumed, strict=True):
            if seq.matcher is not None:
                seq.matcher.rollback(n)
        return proposals, drafted, torch.stack(distributions, dim=1) if distributions else None

    @staticmethod
    def _sample_draft(seqs: list[Sequence], logits: Tensor, params: SamplingBatch,
                      live: list[bool]) -> tuple[Tensor, Tensor]:
        """One draft token per row from its masked sampling distribution q, and q [B, V]."""
        for i, seq in enumerate(seqs):
            if seq.matcher is not None and live[i]:
                mask_logits(logits[i], seq.matcher.allowed())
        q = sampling_distribution(logits, params)
        uniforms = torch.full((len(seqs),), 0.5)
        for i, seq in enumerate(seqs):
            if seq.generator is not None and live[i]:  # one draw per proposal: batch-independent
                uniforms[i] = torch.rand(1, generator=seq.generator)[0]
        return sample_from(q, uniforms), q

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

    def _verify_greedy(self, seqs: list[Sequence], proposals: list[list[int]]) -> None:
        """The verify when every row is greedy and unconstrained: accept what the target's
        argmax agrees with, then the target's own token (`greedy_accept`)."""
        logits = self.runner.forward_rows([[s.last_token, *p] for s, p in zip(seqs, proposals, strict=True)])
        choice = logits.argmax(-1)
        confidences = token_probability(logits, choice).tolist()
        choices = choice.tolist()
        accepted = [greedy_accept(p, c) for p, c in zip(proposals, choices, strict=True)]
        self._commit(seqs, proposals, accepted, choices, confidences, verify_logprobs(seqs, logits, choice))

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
        accepted, next_tokens = speculative_accept(draft_tokens, torch.tensor(counts), target_probs, draft_probs,
                                                   accept_uniforms, sample_uniforms)
        emitted = torch.cat([draft_tokens, torch.zeros(batch, 1, dtype=torch.long)], dim=1).to(accepted.device)
        emitted[torch.arange(batch, device=accepted.device), accepted] = next_tokens
        self._commit(seqs, proposals, accepted.tolist(), emitted.tolist(), token_probability(logits, emitted).tolist(),
                     verify_logprobs(seqs, logits, emitted))

    def _commit(self, seqs: list[Sequence], proposals: list[list[int]], accepted: list[int],
                emitted: list[list[int]], confidences: list[list[float]],
                logprobs: list[list[TokenLogprob | None]]) -> None:
        """Append each row's accepted proposals and the token after them; roll both caches
        back past the rejected ones. `emitted[i][:accepted[i] + 1]` are row i's new tokens."""
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            n = accepted[i]
            seq.forwards += 1
            seq.draft_proposed += len(proposals[i])
            seq.draft_accepted += n
            seq.num_cached += 1 + n  # pending + accepted stay in the cache; the new token is pending
            for position in range(n + 1):
                if seq.append_token(emitted[i][position], confidences[i][position], now, logprobs[i][position]):
                    break
            seq.draft_cached = min(seq.draft_cached, seq.num_cached)
        self.runner.truncate_rows([s.num_cached for s in seqs])
        if self.draft_runner is not None:
            self.draft_runner.truncate_rows([s.draft_cached for s in seqs])


def verify_logprobs(seqs: list[Sequence], logits: Tensor, emitted: Tensor) -> list[list[TokenLogprob | None]]:
    """Each row's logprobs of its candidate tokens [B, T] from the verify's target logits
    [B, T, V] (the target's own distribution, as AR decoding reports it); rows that did not ask
    get None and cost nothing."""
    batch, width = emitted.shape
    wanted = [s.request.sampling.logprobs for s in seqs for _ in range(width)]
    flat = row_logprobs(logits.reshape(batch * width, -1), emitted.reshape(-1), wanted)
    return [flat[i * width: (i + 1) * width] for i in range(batch)]


def last_logits(logits: Tensor, lengths: list[int]) -> Tensor:
    """[B, V]: each row's logits at its last real position of a right-padded [B, T, V] forward."""
    if all(n == logits.shape[1] for n in lengths):
        return logits[:, -1]
    return logits[torch.arange(len(lengths), device=logits.device), torch.tensor(lengths, device=logits.device) - 1]
