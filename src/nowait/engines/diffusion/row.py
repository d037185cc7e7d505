"""One request's decoding state: its answer window, the block being filled, the decision of
each step, what each cache mode forwards for it, and the Completion it ends with.

Positions: the row's sequence is prompt (P tokens) + window (W). With Dream's logit shift the
logits that predict position p sit at p - 1, so whatever forwards window position i must also
forward the token before it: the last prompt token is never cached (it is recomputed with the
window), and a block's forward starts one token before the block.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import Tensor

from nowait.engines.base import Completion, Timings, TokenLogprob
from nowait.engines.diffusion.cache import cut_slots, keep_slot_runs, slot_runs
from nowait.engines.diffusion.policies import (
    choose_commits,
    commit_above_threshold,
    filter_top_k_top_p,
    fixed_count,
    gumbel_noise,
    position_scores,
    propose_tokens,
    token_probability,
)
from nowait.engines.diffusion.request import DecodePlan
from nowait.engines.logprobs import chosen_logprobs
from nowait.engines.structured.templates import read_template
from nowait.engines.structured.token_automaton import SlotAutomaton
from nowait.model import KVCache
from nowait.tokenizer import TextCodec


def settled_facts(masked: Tensor, lo: int, hi: int, ends: Tensor | None) -> tuple[bool, bool]:
    """(whether window positions [lo, hi) are still masked, whether the answer is settled: an
    end token committed at some position with nothing masked before the first one), read from
    the device at once. `masked`, `ends` [window] bool; `ends` None: no early stop (templates)."""
    block_open = masked[lo:hi].any()
    if ends is None:
        return bool(block_open), False
    before_first_end = torch.arange(masked.shape[0], device=masked.device) < ends.int().argmax()
    stopped = ends.any() & ~(masked & before_first_end).any()
    block_open, stopped = torch.stack([block_open, stopped]).tolist()
    return block_open, stopped


class RowState:
    def __init__(self, plan: DecodePlan, index: int, shift: bool, mask_id: int, device: torch.device) -> None:
        self.plan, self.index, self.mask_id = plan, index, mask_id
        self.shift = int(shift)
        self.prompt_length, self.window_length = len(plan.prompt), len(plan.window)
        self.tokens = torch.tensor(plan.prompt + plan.window, dtype=torch.long, device=device)
        self.window = self.tokens[self.prompt_length:]  # a view: writing it writes `tokens`
        self.fillable = torch.tensor(plan.fillable, dtype=torch.bool, device=device)
        self.confidence = torch.full((self.window_length,), float("nan"), device=device)
        # Asked for: each position's logprob, kept when the position is committed (`decide`).
        self.logprobs: list[TokenLogprob | None] | None = (
            [None] * self.window_length if plan.request.sampling.logprobs is not None else None)
        self.end_ids = torch.tensor(sorted(plan.end_ids), device=device)
        self.block_index = 0
        self.steps_in_block = 0
        self.needs_refresh = True
        self.prompt_pending = False  # the prompt is not cached yet: the first refresh forwards it
        self._written_at = 0  # the slot where the last refresh's span was written
        self._suffix_end = 0  # dual cache: slots before it are prompt, window prefix and suffix
        self._settled: list[int] = []  # dual cache: the absolute position of each slot after those
        self._span_start = 0  # the absolute position where the last refresh's span began
        self.open_range = plan.blocks[0]  # dual cache: the window range a step recomputes
        self.forwards = 0
        self.finish_reason: str | None = None
        self.admitted_at = self.first_text_at = self.finished_at = 0.0
        sampling = plan.request.sampling
        self.generator = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else random.randrange(2**63)
            self.generator = torch.Generator().manual_seed(seed)
        self._window_positions = torch.arange(self.window_length, device=device)
        options = plan.options
        self._greedy_threshold = (plan.template is None and sampling.temperature == 0 and options.policy == "threshold"
                                  and options.score == "probability")
        self.slot_of = [-1] * self.window_length  # window position -> slot index (templates)
        if plan.template is not None:
            for k, slot in enumerate(plan.template.template.slots):
                for offset in range(slot.width):
                    self.slot_of[slot.start + offset] = k

    # --- geometry ---

    @property
    def block(self) -> tuple[int, int]:
        return self.plan.blocks[self.block_index]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_prefix(self) -> int:
        """Prompt tokens kept in the cache: all but the last one when logits are shifted."""
        return self.prompt_length - self.shift

    @property
    def total_length(self) -> int:
        return self.prompt_length + self.window_length

    def refresh_span(self) -> tuple[Tensor, int]:
        """The whole window (and the token before it), recomputed over the cached prompt."""
        return self.tokens[self.prompt_prefix:], self.prompt_prefix

    @property
    def refreshes_blocks_only(self) -> bool:
        """Whether this block's refresh recomputes only the block just finished and this one
        (dual cache, `refresh="blocks"`): the suffix after them keeps the keys and values of
        the window's first refresh instead of being recomputed at every block."""
        return self.plan.options.cache == "dual" and self.plan.options.refresh == "blocks" and self.block_index > 0

    def prepare_refresh(self, cache: KVCache, row: int) -> tuple[Tensor, int]:
        """Set this row's cache up for its refresh; returns the span to forward (writing its
        keys/values after the row's cached slots) and the span's absolute start.

        Whole window: the cache is cut back to the prompt (or emptied, when the prompt is still
        pending and forwards with the window). Blocks only: the dual cache holds the
        prompt, the window before the finished block and the suffix after the finished block;
        the suffix's slots up to this block's end are dropped (the span recomputes them)."""
        if not self.refreshes_blocks_only:
            start = 0 if self.prompt_pending else self.prompt_prefix
            cache.lengths[row] = self._written_at = self._span_start = start
            return self.tokens[start:], start
        previous_lo, previous_hi = self.plan.blocks[self.block_index - 1]
        _, hi = self.block
        kept_prefix = self.prompt_length + previous_lo - self.shift
        # The finished block's positions before its last open range were cached by its steps
        # (with their tokens); the span recomputes the rest of it and the new block.
        start = self.prompt_length + self.open_range[0] - self.shift
        settled = sorted((position, self._suffix_end + k) for k, position in enumerate(self._settled)
                         if position < start)
        keep_slot_runs(cache, row, [(0, kept_prefix), *slot_runs([slot for _, slot in settled]),
                                    (kept_prefix + hi - previous_hi, self._suffix_end)])
        self._written_at, self._span_start = int(cache.lengths[row]), start
        return self.tokens[start: self.prompt_length + hi], start

    def step_span(self, cache_mode: str) -> tuple[Tensor, int]:
        """What one step forwards; the rest of the sequence is in this row's cache slots."""
        lo, hi = self.block
        if cache_mode == "none":
            return self.tokens, 0
        if cache_mode == "prompt":
            return self.refresh_span()
        if cache_mode == "dual":
            lo, hi = self.open_range
        start = self.prompt_length + lo - self.shift
        end = self.total_length if cache_mode == "prefix" else self.prompt_length + hi
        return self.tokens[start:end], start

    @property
    def caches_decoded(self) -> bool:
        """Dual cache with `cache_decoded`: the block's settled tokens are cached too."""
        return self.plan.options.cache == "dual" and self.plan.options.cache_decoded

    def decision_range(self, cache_mode: str) -> tuple[int, int]:
        """The window range whose logits a step reads: the block, or its open range."""
        return self.open_range if cache_mode == "dual" else self.block

    def block_offsets(self, span_start: int, window_range: tuple[int, int] | None = None) -> tuple[int, int]:
        """(first, count): where the logits of `window_range` (default: the current block) sit
        in a forward whose span began at absolute position `span_start`."""
        lo, hi = window_range or self.block
        return self.prompt_length + lo - self.shift - span_start, hi - lo

    def block_logits(self, logits: Tensor, span_start: int) -> Tensor:
        """This row's logits [block, vocab] for the current block, out of the logits of every
        position of a forward whose span began at absolute position `span_start`."""
        first, count = self.block_offsets(span_start)
        return logits[first: first + count]

    def keep_block_cache(self, cache: KVCache, row: int, cache_mode: str) -> None:
        """After a refresh wrote its span: keep what the block's steps will reuse."""
        lo, hi = self.block
        start = self.prompt_length + lo - self.shift
        if self.refreshes_blocks_only:
            # Slots now: [prefix up to the span | suffix after this block | the refreshed span].
            # The span's part before this block joins the prefix; the block is recomputed by steps.
            kept_prefix, written = self._span_start, self._written_at
            keep_slot_runs(cache, row, [(0, kept_prefix), (written, written + start - kept_prefix),
                                        (kept_prefix, written)])
        elif cache_mode == "prefix":
            cache.lengths[row] = start
        else:  # dual: drop the span each step recomputes, keep the suffix after it
            cut_slots(cache, row, start, self.prompt_length + hi, self.total_length)
        self._suffix_end = int(cache.lengths[row])
        self._settled = []
        self.open_range = self.block  # the refresh saw the block masked: all of it is open

    def keep_step_cache(self, cache: KVCache, row: int, written_at: int, committed_now: Tensor) -> None:
        """After a dual step that wrote its span at slot `written_at` (and was decided): keep the
        keys/values of the positions the next step need not recompute.

        dKV-Cache (Ma et al. 2025, arXiv 2505.15781), delayed caching: a token's keys/values are
        cached once they were computed with the token itself, one step after its commit. The next
        step recomputes the range from the first to the last position still masked or committed
        just now (window offsets); the settled positions of this span outside it are kept.
        """
        lo, hi = self.open_range
        cache.lengths[row] = written_at
        if not self.caches_decoded:
            return
        moving_mask = self._masked(*self.block)
        moving_mask[committed_now] = True  # one read of both (their order does not matter: min and max)
        moving = moving_mask.nonzero().flatten().tolist()
        if not moving:
            return  # the block is complete; its refresh recomputes it
        block_lo = self.block[0]
        next_lo, next_hi = block_lo + min(moving), block_lo + max(moving) + 1
        # Span slot j holds absolute position P + lo - shift + j: keep its slots before the next
        # open range and after it.
        kept = [(0, next_lo - lo), (next_hi - lo + self.shift, hi - lo + self.shift)]
        keep_slot_runs(cache, row, [(0, written_at), *((written_at + a, written_at + b) for a, b in kept)])
        first = self.prompt_length + lo - self.shift
        self._settled += [first + j for a, b in kept for j in range(a, b)]
        self.open_range = (next_lo, next_hi)

    # --- one step ---

    def _masked(self, lo: int, hi: int) -> Tensor:
        return (self.window[lo:hi] == self.mask_id) & self.fillable[lo:hi]

    def decide(self, logits: Tensor, first: int | None = None) -> Tensor:
        """Propose a token at every masked position of the block and commit some of them;
        returns the block offsets committed.

        `logits` [positions, vocab] for the window positions from `first` on (default: the
        block's start), covering every still-masked position of the block."""
        lo, hi = self.block
        first = lo if first is None else first
        options, sampling = self.plan.options, self.plan.request.sampling
        steps_done = self.steps_in_block
        self.steps_in_block += 1
        if self._greedy_threshold:  # the fast default: the same commits as below, in fewer operations
            return self._decide_greedy_threshold(logits, first)
        where = self._masked(lo, hi).nonzero().flatten()  # block offsets still to fill
        if not len(where):
            return where
        logits = logits[where - (first - lo)].float()
        logits[:, self.mask_id] = float("-inf")  # committing the mask token would commit nothing
        probabilities = logits.softmax(-1)
        allowed = forced = None
        if self.plan.template is not None:
            allowed, forced = self._allowed([lo + p for p in where.tolist()], logits.shape[-1])
            allowed, forced = allowed.to(logits.device), forced.to(logits.device)
        refused = None if allowed is None else ~allowed
        choice = logits if allowed is None else logits.masked_fill(refused, float("-inf"))
        noise = None
        if sampling.temperature > 0:
            choice = filter_top_k_top_p(choice, sampling.top_k, sampling.top_p)
            noise = gumbel_noise(tuple(choice.shape), self.generator).to(choice.device)
        prediction = propose_tokens(choice, sampling.temperature, noise)
        # The reported confidence is the model's own probability of the token, not renormalized
        # over what the template allows: a forced token the model did not want stays unsure.
        chosen_probability = token_probability(probabilities, prediction)
        # The probability score reads only the chosen token's: no need to mask the rest.
        ranked = probabilities if allowed is None or options.score == "probability" \
            else probabilities.masked_fill(refused, 0.0)
        score = position_scores(options.score, ranked, chosen_probability)
        if forced is not None:  # a position with one legal token has nothing to wait for
            score = torch.where(forced, torch.ones_like(score), score)
        count = 1
        if options.policy == "fixed":
            steps = options.steps or int(self.fillable[lo:hi].sum())
            count = fixed_count(len(where), steps - steps_done)
        everything = torch.ones(1, len(where), dtype=torch.bool, device=score.device)
        commit = choose_commits(options.policy, score[None], everything, tau=options.tau,
                                factor=options.factor, count=count)[0]
        positions = where + lo
        if self.plan.template is not None:
            commit = self._consistent(positions, commit, prediction, score)
        return self._commit(where, positions, commit, prediction, chosen_probability, logits)

    def _decide_greedy_threshold(self, logits: Tensor, first: int) -> Tensor:
        """`decide` for greedy free-form decoding under the threshold rule and the probability
        score. Every row of `logits` is scored, masked or not (softmax, argmax and the
        threshold are per row, so a masked row's numbers are those of `decide`), and only the
        masked ones may be chosen: no gather of the masked rows first, no index lists."""
        count = logits.shape[0]
        positions = self._window_positions[first: first + count]
        logits = logits.float()
        logits[:, self.mask_id] = float("-inf")  # committing the mask token would commit nothing
        probabilities = logits.softmax(-1)
        prediction = logits.argmax(-1)
        chosen_probability = token_probability(probabilities, prediction)
        still = self._masked(first, first + count)
        commit = commit_above_threshold(chosen_probability[None], still[None], self.plan.options.tau)[0]
        return self._commit(positions - self.block[0], positions, commit, prediction, chosen_probability, logits)

    def _commit(self, where: Tensor, positions: Tensor, commit: Tensor, prediction: Tensor,
                chosen_probability: Tensor, logits: Tensor) -> Tensor:
        """Write the chosen commits into the window; returns their block offsets. `where` and
        `positions`: the block offsets and window positions of the rows of the other tensors."""
        # The committed rows as indices, found once: each boolean-mask index would find them
        # again, and on a GPU each finding is a read back to the host.
        rows = commit.nonzero().flatten()
        chosen = positions[rows]
        self.window[chosen] = prediction[rows]
        self.confidence[chosen] = chosen_probability[rows]
        if self.logprobs is not None:  # the same distribution as the confidence, at the step that unmasked it
            kept = chosen_logprobs(logits[rows], prediction[rows], self.plan.request.sampling.logprobs)
            for position, entry in zip(chosen.tolist(), kept, strict=True):
                self.logprobs[position] = entry
        return where[rows]

    def _slot_assignment(self, slot_index: int, window: list[int]) -> list[int | None]:
        slot = self.plan.template.template.slots[slot_index]
        return [None if t == self.mask_id else t for t in window[slot.start: slot.start + slot.width]]

    def _allowed(self, positions: list[int], vocab: int) -> tuple[Tensor, Tensor]:
        """bool [positions, vocab]: the tokens that keep each masked slot position's slot
        completable, and bool [positions]: where exactly one token is legal.

        A model's vocabulary may be padded past the tokenizer's: ids without text stay out."""
        template = self.plan.template
        window = self.window.tolist()
        wanted: dict[int, list[int]] = {}
        for position in positions:
            slot_index = self.slot_of[position]
            wanted.setdefault(slot_index, []).append(position - template.template.slots[slot_index].start)
        by_position = {}
        for slot_index, offsets in wanted.items():
            start = template.template.slots[slot_index].start
            masks = template.automata[slot_index].allowed(self._slot_assignment(slot_index, window), offsets)
            by_position.update({start + offset: mask for offset, mask in masks.items()})
        stacked = torch.from_numpy(np.stack([by_position[p] for p in positions]))
        allowed = torch.zeros(len(positions), vocab, dtype=torch.bool)
        known = min(stacked.shape[1], vocab)
        allowed[:, :known] = stacked[:, :known]
        return allowed, allowed.sum(-1) == 1

    def _consistent(self, positions: Tensor, commit: Tensor, prediction: Tensor, score: Tensor) -> Tensor:
        """Commits that are legal together: each was legal alone; within one slot, take them in
        score order and drop any that the ones before it make impossible (it stays masked)."""
        template = self.plan.template
        window = self.window.tolist()
        positions_, predictions, scores = positions.tolist(), prediction.tolist(), score.tolist()
        by_slot: dict[int, list[int]] = {}
        for k in commit.nonzero().flatten().tolist():
            by_slot.setdefault(self.slot_of[positions_[k]], []).append(k)
        commit = commit.clone()
        for slot_index, chosen in by_slot.items():
            if len(chosen) < 2:
                continue
            slot = template.template.slots[slot_index]
            automaton = template.automata[slot_index]
            assigned = self._slot_assignment(slot_index, window)
            chosen.sort(key=lambda k: -scores[k])
            if self._all_legal(automaton, assigned, [(positions_[k] - slot.start, predictions[k]) for k in chosen]):
                continue
            for rank, k in enumerate(chosen):
                offset, token = positions_[k] - slot.start, predictions[k]
                if rank and not automaton.allowed(assigned, [offset])[offset][token]:
                    commit[k] = False
                    continue
                assigned[offset] = token
        return commit

    @staticmethod
    def _all_legal(automaton: SlotAutomaton, assigned: list[int | None], picks: list[tuple[int, int]]) -> bool:
        """Whether a slot stays completable with every (offset, token) of `picks` at once: then
        each one is legal after the ones before it, and the one-by-one check would keep them
        all (a completion of the whole set completes each part). One automaton query, not one
        per pick."""
        together = list(assigned)
        for offset, token in picks[:-1]:
            together[offset] = token
        offset, token = picks[-1]
        return bool(automaton.allowed(together, [offset])[offset][token])

    # --- after a step ---

    def first_end(self) -> int | None:
        hits = torch.isin(self.window, self.end_ids).nonzero()
        return int(hits[0]) if len(hits) else None

    def advance(self, now: float) -> str | None:
        """"done" when the answer is settled, "block" when a block completed, else None.

        Early stop (free-form): once an end token is committed and every position before it
        is, the answer is final: nothing after it can change the output, so no more forwards.
        """
        masked = self._masked(0, self.window_length)
        lo, hi = self.block
        # The three facts below in one read from the device (three reads on a GPU, otherwise).
        block_open, stopped = settled_facts(masked, lo, hi, None if self.plan.template is not None else
                                            torch.isin(self.window, self.end_ids))
        if stopped:
            return self._finish("stop", now)
        if block_open:
            return None
        self.block_index += 1
        self.steps_in_block = 0
        self.needs_refresh = True
        if self.block_index == len(self.plan.blocks):
            return self._finish("length" if self.plan.template is None else "stop", now)
        self.first_text_at = self.first_text_at or now
        return "block"

    def _finish(self, reason: str, now: float) -> str:
        self.finish_reason = reason
        self.finished_at = now
        self.first_text_at = self.first_text_at or now
        return "done"

    # --- output ---

    def decided(self, codec: TextCodec) -> tuple[str, list[int]]:
        """The text (and ids) settled so far, read left to right: streaming sends its growth."""
        window = self.window.tolist()
        template = self.plan.template
        if template is None:
            cut = next((i for i, t in enumerate(window) if t == self.mask_id or t in self.plan.end_ids),
                       len(window))
            return codec.decode(window[:cut]).rstrip("\ufffd"), window[:cut]
        text, upto = "", 0
        for piece, slot in zip(template.template.pieces, template.template.slots, strict=False):
            text += piece
            upto = slot.start
            values = window[slot.start: slot.start + slot.width]
            if self.mask_id in values:
                break
            text += codec.decode([t for t in values if t not in self.plan.end_ids])
            upto = slot.start + slot.width
        else:
            text += template.template.pieces[-1]
            upto = len(window)
        return text, [t for t in window[:upto] if t not in self.plan.end_ids]

    def completion(self, engine: str, codec: TextCodec) -> Completion:
        window = self.window.tolist()
        confidence = self.confidence.tolist()
        template = self.plan.template
        if template is None:
            end = self.first_end()
            cut = len(window) if end is None else end
            token_ids, token_confidences = window[:cut], confidence[:cut]
            logprobs = None if self.logprobs is None else self.logprobs[:cut]
            # The end token decides where the answer stops: one more decision to be sure of.
            deciding = token_confidences + ([] if end is None else [confidence[end]])
            text = codec.decode(token_ids)
        else:
            token_ids, token_confidences, deciding = [], [], []
            logprobs = None  # refused with a template (`plan_request`)
            value_ends = set()
            for slot in template.template.slots:
                span = window[slot.start: slot.start + slot.width]
                first_end = next((i for i, t in enumerate(span) if t in self.plan.end_ids), None)
                if first_end is not None:
                    value_ends.add(slot.start + first_end)
            for position, token in enumerate(window):
                if token in self.plan.end_ids:
                    if position in value_ends:
                        deciding.append(confidence[position])
                    continue
                generated = self.slot_of[position] >= 0
                token_ids.append(token)
                token_confidences.append(confidence[position] if generated else 1.0)
                if generated:
                    deciding.append(confidence[position])
            text = read_template(template.template, window, codec)
        arrival = self.plan.request.arrival_time
        return Completion(
            request_id=self.plan.request.request_id, engine=engine, token_ids=token_ids, text=text,
            finish_reason=self.finish_reason or "error", prompt_tokens=self.prompt_length,
            token_confidences=token_confidences, confidence=min(deciding, default=1.0),
            confidence_kind="min_token_probability", forwards=self.forwards,
            text_tokens=None if template is None else len(codec.encode(text)),
            # A template ends where its last piece does, as a grammar ends an AR answer: no end token.
            ended_by_end_token=template is None and end is not None, logprobs=logprobs,
            timings=Timings(queued_s=self.admitted_at - arrival, first_token_s=self.first_text_at - arrival,
                            total_s=self.finished_at - arrival),
        )
