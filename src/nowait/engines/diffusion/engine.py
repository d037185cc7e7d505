"""The masked-diffusion engine: batched, cached, early-stopping, schema-constrained decoding.

Each iteration of the scheduler moves every active request by exactly one step, so a request's
output depends only on its own steps (a batched run equals the same requests run alone):

1. waiting requests join, up to `max_batch` (a newcomer starts at its first block boundary);
   their prompts are prefilled once, the keys/values stacked into the batch's cache;
2. with the prefix/dual cache, rows starting a block run a refresh forward over their whole
   window (writing its keys/values; its logits are the block's first step);
3. the other rows run one step forward over what their cache mode recomputes;
4. each row commits what its policy picks; a row whose answer is settled leaves at once (its
   cache row is dropped); a row whose block completed refreshes on the next iteration.

Requests with different cache modes run one mode after another (their forwards differ).

Row by row: while any active request fills a schema template, each row's forward runs alone
through a one-row view of the batch's cache (no copy). Template rows differ in window and
prompt length, so one padded forward for all of them computes the padding and needs an attention
mask; on a CPU that made 8 requests together slower than one after another (0.5x). Alone, a row
takes the model's unmasked path, and outputs are the same either way (a batched run equals the
requests run alone).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from nowait.engines.base import Completion, GenerationRequest, StreamChunk
from nowait.engines.diffusion.cache import (
    CacheStorage,
    forward_spans,
    output_window,
    prefill,
    put_rows,
    stack_caches,
    take_rows,
)
from nowait.engines.diffusion.request import DecodePlan, DiffusionOptions, plan_request
from nowait.engines.diffusion.row import RowState
from nowait.engines.structured.templates import TemplateCompiler
from nowait.model import KVCache, Transformer
from nowait.model.compiled_block import CompiledBlock
from nowait.model.graphed_block import GraphedBlock
from nowait.tokenizer import TextCodec


class DiffusionEngine:
    """Implements the `Engine` protocol for a bidirectional (masked diffusion) model."""

    kind = "diffusion"

    def __init__(self, model: Transformer, codec: TextCodec, options: DiffusionOptions | None = None,
                 max_batch: int = 8, name: str = "diffusion", *, end_ids: Sequence[int] | None = None,
                 compile: bool = False, cuda_graphs: bool | None = None) -> None:
        """`end_ids`: the checkpoint's end-of-text ids (`LoadedModel.conventions.end_ids`); an
        answer ends at the first of any of them. Default: the demo tokenizer's end token.
        `compile`: a forward of one row that writes its span (the dual cache's steps and
        refreshes) runs a compiled graph (`nowait.model.compiled_block`), compiled now (tens of
        seconds); forwards of several rows, and a request's first forward (its prompt isolated,
        two attention kernels, measured faster eager), stay eager. `cuda_graphs`: those same
        forwards replay CUDA Graphs instead (`nowait.model.graphed_block`); None (default): on
        when the model is on a CUDA device; True on a CPU runs the static-shape step eagerly
        (tests); on, it takes the place of `compile`."""
        if model.config.causal:
            raise ValueError("the diffusion engine needs a bidirectional model; this one is causal (AR)")
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model = model.eval()
        self.codec = codec
        self.options = options or DiffusionOptions()
        self.options.validate()
        self.max_batch = max_batch
        self.name = name
        self.mask_id = model.config.mask_token_id if model.config.mask_token_id is not None else codec.mask_id
        if self.mask_id is None:
            raise ValueError("the diffusion engine needs a mask token; this model and tokenizer name none")
        self.end_ids = tuple(end_ids) if end_ids else (codec.end_id,)
        if None in self.end_ids:
            raise ValueError("give end_ids: this tokenizer has no <|endoftext|> token to default to")
        self.end_id = self.end_ids[0]  # also pads the rows of a batch
        self.compiler = TemplateCompiler(codec, self.mask_id)
        self.storage = CacheStorage()  # cache memory kept from one request to the next
        self.compiled: CompiledBlock | GraphedBlock | None = None
        on_cuda = model.output_weight().device.type == "cuda"
        if on_cuda if cuda_graphs is None else cuda_graphs:
            self.compiled = GraphedBlock(self.model, capture=on_cuda)
        elif compile:
            self.compiled = CompiledBlock(self.model)
            self.compiled.warm_up()

    def plan(self, request: GenerationRequest) -> DecodePlan:
        """Validate a request (InvalidRequestError) and lay out its answer window."""
        return plan_request(request, self.options, self.model.config, self.compiler, self.mask_id, self.end_ids)

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        plans = [self.plan(request) for request in requests]  # refuse bad requests before any work
        rows = self._rows(plans)
        completions: list[Completion | None] = [None] * len(rows)
        for mode in dict.fromkeys(plan.options.cache for plan in plans):
            batch = _Scheduler(self.model, [r for r in rows if r.plan.options.cache == mode], mode,
                               self.max_batch, self.end_id, self.storage, self.compiled)
            for row, event in batch.events():
                if event == "done":
                    completions[row.index] = row.completion(self.name, self.codec)
        return completions

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        """Chunks of settled text, one per completed block; the last carries the Completion."""
        plan = self.plan(request)  # raised here, not at the first next()
        return self._stream(plan)

    def _stream(self, plan: DecodePlan) -> Iterator[StreamChunk]:
        [row] = self._rows([plan])
        sent_text, sent_ids = "", 0
        for _, event in _Scheduler(self.model, [row], plan.options.cache, 1, self.end_id, self.storage,
                                   self.compiled).events():
            if event == "done":
                completion = row.completion(self.name, self.codec)
                yield StreamChunk(text=completion.text[len(sent_text):], token_ids=completion.token_ids[sent_ids:],
                                  completion=completion, logprobs=_from(completion.logprobs, sent_ids))
                return
            text, ids = row.decided(self.codec)
            if len(text) > len(sent_text) and text.startswith(sent_text):
                logprobs = None if row.logprobs is None else row.logprobs[sent_ids:len(ids)]
                yield StreamChunk(text=text[len(sent_text):], token_ids=ids[sent_ids:], logprobs=logprobs)
                sent_text, sent_ids = text, len(ids)

    def _rows(self, plans: list[DecodePlan]) -> list[RowState]:
        device = self.model.output_weight().device
        return [RowState(plan, index, self.model.config.logits_shift, self.mask_id, device)
                for index, plan in enumerate(plans)]


def _from(logprobs: list | None, start: int) -> list | None:
    return None if logprobs is None else logprobs[start:]


class _Scheduler:
    """Decodes rows of one cache mode, at most `max_batch` at a time."""

    def __init__(self, model: Transformer, rows: list[RowState], cache_mode: str, max_batch: int,
                 pad_id: int, storage: CacheStorage | None = None,
                 compiled: CompiledBlock | GraphedBlock | None = None) -> None:
        self.model, self.cache_mode, self.max_batch, self.pad_id = model, cache_mode, max_batch, pad_id
        self.storage = storage
        self.compiled = compiled
        self.waiting = deque(rows)
        self.active: list[RowState] = []  # active[i] owns row i of the cache
        self.cache: KVCache | None = None
        self.capacity = 0

    @torch.inference_mode()
    def events(self) -> Iterator[tuple[RowState, str]]:
        """(row, "block") when a row completes a block, (row, "done") when it finishes."""
        while self.waiting or self.active:
            joining = []
            while self.waiting and len(self.active) + len(joining) < self.max_batch:
                joining.append(self.waiting.popleft())
            if joining:
                self._admit(joining)
            refreshing = [i for i, row in enumerate(self.active)
                          if row.needs_refresh and self.cache_mode in ("prefix", "dual")]
            stepping = set(range(len(self.active))) - set(refreshing)
            if self._row_by_row():
                for i in refreshing:
                    self._refresh([i], alone=True)
                for i in sorted(stepping):
                    self._step({i}, alone=True)
            else:
                if refreshing:
                    self._refresh(refreshing)
                if stepping:
                    self._step(stepping)
            now = time.perf_counter()
            events = [(row, row.advance(now)) for row in self.active]
            for row, event in events:
                if event:
                    yield row, event
            if any(row.done for row in self.active):
                self._retire()

    def _row_by_row(self, rows: list[RowState] | None = None) -> bool:
        """Forward each row alone while any row fills a template (see the module docstring)."""
        rows = self.active if rows is None else rows
        return len(rows) > 1 and any(row.plan.template is not None for row in rows)

    def _one_row(self, index: int) -> KVCache:
        return self.cache.view(index, 1)

    def _admit(self, joining: list[RowState]) -> None:
        now = time.perf_counter()
        for row in joining:
            row.admitted_at = now
        if self.cache_mode != "none":
            everyone = self.active + joining
            # Room for a refresh: a row's cached prompt plus the longest window of the batch.
            capacity = max(max(r.total_length for r in everyone) + max(r.window_length for r in everyone) + 1,
                           self.capacity)
            merge = self._merges_prefill(everyone)
            for row in joining:
                row.prompt_pending = merge and row.prompt_prefix > 0
            prefixes = [row.tokens[: 0 if row.prompt_pending else row.prompt_prefix] for row in joining]
            fresh = prefill(self.model, prefixes, capacity, self.pad_id, one_by_one=self._row_by_row(everyone),
                            storage=self.storage if self.cache is None else None)
            for row in joining:
                row.forwards += row.prompt_prefix > 0 and not row.prompt_pending
            self.cache = fresh if self.cache is None else stack_caches(self.model, self.cache, fresh, capacity)
            self.capacity = capacity
        self.active.extend(joining)

    def _merges_prefill(self, everyone: list[RowState]) -> bool:
        """Whether joiners skip the prefill and forward their prompt with their window's first
        refresh, in one forward (`nowait.model.attention.IsolatedPrefix`: the prompt attends only to itself, as
        the prefill would have it): where each refresh runs as a one-row forward (a lone
        request, or rows forwarded one by one). One forward fewer per request; a batched
        refresh keeps the prompts out, as rows of different prompt lengths would pad."""
        return self.cache_mode in ("prefix", "dual") and (len(everyone) == 1 or self._row_by_row(everyone))

    def _refresh(self, indices: list[int], alone: bool = False) -> None:
        """Rows starting a block recompute their window (refresh="window"; the first block
        always), or the finished block and the new one (refresh="blocks"), writing the keys and
        values; its logits are the block's first step. `alone`: one row, through a view of its
        cache row."""
        rows = [self.active[i] for i in indices]
        spans = [row.prepare_refresh(self.cache, i) for i, row in zip(indices, rows, strict=True)]
        whole = len(indices) == len(self.active)
        if alone:
            target = self._one_row(indices[0])
        else:
            target = self.cache if whole else take_rows(self.model, self.cache, indices,
                                                        int(self.cache.lengths[indices].max()), self.capacity)
        blocks = [row.block_offsets(start) for row, (_, start) in zip(rows, spans, strict=True)]
        outputs = output_window([first for first, _ in blocks], [count for _, count in blocks], target.lengths.device)
        isolated = [row.prompt_prefix if row.prompt_pending else 0 for row in rows]
        if any(isolated) and len(rows) > 1:
            raise RuntimeError("a prompt left for its first refresh must refresh alone")
        logits = self._forward([s for s, _ in spans], [start for _, start in spans], target, True, outputs,
                               isolated[0])
        if alone:
            self.cache.lengths[indices[0]] = target.lengths[0]
        elif not whole:
            put_rows(self.cache, indices, target, int(target.lengths.max()))
        for k, (i, row) in enumerate(zip(indices, rows, strict=True)):
            row.forwards += 1
            row.needs_refresh = row.prompt_pending = False
            row.decide(logits[k, : blocks[k][1]])
            row.keep_block_cache(self.cache, i, self.cache_mode)

    def _step(self, indices: set[int], alone: bool = False) -> None:
        """One forward for the given rows; the others ride along as a one-token no-op (a row
        of the cache cannot be skipped, and one token costs next to nothing). `alone`: one
        row, through a view of its cache row, and nobody rides along.

        Dual cache: the forward writes each span's keys/values after the row's cached slots;
        each row then keeps what it settled (`keep_step_cache`) and the rest is dropped."""
        members = sorted(indices) if alone else range(len(self.active))
        spans, starts, ranges, blocks = [], [], [], []
        for i in members:
            row = self.active[i]
            span, start = row.step_span(self.cache_mode) if i in indices else (row.tokens[:1], 0)
            spans.append(span)
            starts.append(start)
            ranges.append(row.decision_range(self.cache_mode))
            blocks.append(row.block_offsets(start, ranges[-1]) if i in indices else (0, 0))
        cache = None
        if self.cache_mode != "none":
            cache = self._one_row(members[0]) if alone else self.cache
        write = self.cache_mode == "dual"
        # A forward replaces its cache's lengths (never writes into them): put the old ones back.
        before = cache.lengths if write else None
        written_at = before.tolist() if write else None
        outputs = output_window([first for first, _ in blocks], [count for _, count in blocks], spans[0].device)
        logits = self._forward(spans, starts, cache, write, outputs)
        if write:
            cache.lengths = before  # a view's: the batch cache's lengths were never changed
        for k, i in enumerate(members):
            if i not in indices:
                continue
            row = self.active[i]
            row.forwards += 1
            committed = row.decide(logits[k, : blocks[k][1]], ranges[k][0])
            if write:
                row.keep_step_cache(self.cache, i, written_at[k], committed)

    def _forward(self, spans: list, starts: list[int], cache: KVCache | None, write: bool, outputs: torch.Tensor,
                 isolated_prefix: int = 0) -> torch.Tensor:
        """`forward_spans`, or the compiled block step where it computes the same: one row
        writing a span of two tokens or more, nothing isolated (the real-time path's steps)."""
        if (self.compiled is not None and not getattr(self.compiled, "failed", False) and write and not isolated_prefix
                and len(spans) == 1 and cache is not None and cache.batch == 1 and len(spans[0]) > 1):
            return self.compiled(spans[0], starts[0], cache, outputs)
        return forward_spans(self.model, spans, starts, self.pad_id, cache, write=write, outputs=outputs,
                             isolated_prefix=isolated_prefix)

    def _retire(self) -> None:
        keep = [i for i, row in enumerate(self.active) if not row.done]
        self.active = [self.active[i] for i in keep]
        if self.cache is not None:
            if keep:
                self.cache.select(torch.tensor(keep, device=self.cache.lengths.device))
            else:
                if self.storage is not None:
                    self.storage.release(self.cache)
                self.cache, self.capacity = None, 0
