"""Autoregressive decoding with the KV cache.

`greedy_decode` is the simple, correct batched decoder the evaluation and training use.
`AutoregressiveEngine` is the serving engine, split as nano-vllm splits it: the scheduler
(`scheduler.py`) picks each step's sequences, the sequence (`sequence.py`) holds a request's
state, the model runner (`runner.py`) owns the cache rows and runs the forwards, and the
policies are pure functions (`sampling.py`, `../structured/grammar.py`). The speculative engine
(`nowait.engines.speculative`) replaces only the decode step.
"""

from __future__ import annotations

import collections.abc
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nowait.engines.ar.prefix_cache import PrefixCache
from nowait.engines.ar.runner import CachePool, ModelRunner
from nowait.engines.ar.sampling import SamplingBatch, choose_tokens, mask_logits, token_probability
from nowait.engines.ar.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from nowait.engines.ar.sequence import Sequence
from nowait.engines.base import Completion, GenerationRequest, InvalidRequestError, StreamChunk
from nowait.engines.logprobs import row_logprobs
from nowait.model import KVCache, Transformer
from nowait.model.compiled_step import CompiledDecode
from nowait.model.graphed_step import GraphedDecode
from nowait.tokenizer import TextCodec

if TYPE_CHECKING:  # llguidance is imported only by engines that constrain output
    from nowait.engines.structured.grammar import GrammarCompiler


@torch.no_grad()
def greedy_decode(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                  end_id: int, stats: dict | None = None) -> list[list[int]]:
    """Greedy decode a batch of prompts of different lengths; returns the new ids, end excluded.

    One prefill over the right-padded prompts, then one cached forward per token. Rows that
    finish early ride along until the longest is done (continuous batching retires them).
    """
    device = model.output_weight().device
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    padded = torch.full((batch, int(lengths.max())), end_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = torch.tensor(prompt, device=device)
    cache = KVCache(model.config, batch, int(lengths.max()) + max_new_tokens,
                    dtype=model.output_weight().dtype, device=device)
    next_ids = model(padded, cache, valid_lengths=lengths, output_positions=(lengths - 1)[:, None])[:, 0].argmax(-1)
    forwards = 1
    outputs: list[list[int]] = [[] for _ in range(batch)]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for produced in range(1, max_new_tokens + 1):
        finished_now = finished | (next_ids == end_id)
        for row in (~finished_now).nonzero().flatten().tolist():
            outputs[row].append(int(next_ids[row]))
        finished = finished_now
        if bool(finished.all()) or produced == max_new_tokens:
            break
        next_ids = model(next_ids[:, None], cache)[:, -1].argmax(-1)
        forwards += 1
    if stats is not None:
        stats["forwards"] = forwards
    return outputs


# --- the serving engine: continuous batching over the KV cache ---


def resolve_end_ids(codec: TextCodec | None, end_id: int | None,
                    end_ids: collections.abc.Sequence[int] | None) -> tuple[int, ...]:
    """The ids that end a sequence, the padding one first: `end_id`, then `end_ids`, else the
    codec's end token. Refused when there is none: a real checkpoint's tokenizer has no
    <|endoftext|>, and its end ids come from its files (`LoadedModel.conventions.end_ids`)."""
    ids = [end_id] if end_id is not None else []
    ids += list(end_ids or ())
    if not ids and codec is not None and codec.end_id is not None:
        ids = [codec.end_id]
    if not ids:
        raise ValueError("give end_ids (or end_id): " + ("this tokenizer has no <|endoftext|> token to default to"
                                                        if codec is not None else "there is no codec to read it from"))
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class EngineConfig:
    """Caps of the continuous-batching engine (see `nowait.engines.ar.scheduler`).

    `max_model_len`: prompt + output tokens one sequence may hold (default: the model's
    `max_position`); each cache row is sized for it, so memory is rows x max_model_len.
    `prefix_cache_tokens`: prompt tokens whose keys/values the prefix cache keeps for later
    prompts that start alike (`nowait.engines.ar.prefix_cache`); default an eighth of the rows'
    tokens and at least one row's, 0 turns it off. `prefix_block_size`: the unit of sharing.
    `compile_decode`: a step that feeds one token to one sequence runs a compiled graph
    (`nowait.model.compiled_step`), compiled when the engine is built (seconds to a minute).
    `cuda_graphs`: decode steps (every running row fed one token) replay CUDA Graphs
    (`nowait.model.graphed_step`), one per batch and key-length bucket, all captured when the
    engine is built; None
    (default) turns them on when the model is on a CUDA device. True on a CPU runs the same
    static-shape step eagerly (tests use it; it only adds padded work there).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    max_waiting: int | None = None
    prefix_cache_tokens: int | None = None
    prefix_block_size: int = 16
    compile_decode: bool = False
    cuda_graphs: bool | None = None

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_waiting)


class AutoregressiveEngine:
    """AR generation with continuous batching: `generate` a list, `stream` one, or drive it
    yourself with `submit` and `step`.

    Per request: greedy or sampled (temperature, top-k, top-p, a seed of its own), stop tokens
    (the model's end tokens always stop), `max_tokens`, and `schema` for JSON valid for that
    JSON Schema (needs a `GrammarCompiler`). Not thread-safe: one loop drives it.
    """

    name = "ar"
    kind = "ar"

    def __init__(self, model: Transformer, codec: TextCodec | None = None, config: EngineConfig | None = None,
                 *, end_id: int | None = None, end_ids: collections.abc.Sequence[int] | None = None,
                 grammar: GrammarCompiler | None = None) -> None:
        """`end_ids`: the checkpoint's end-of-text ids (`LoadedModel.conventions.end_ids`;
        Llama 3 Instruct: <|end_of_text|> and <|eot_id|>); a sequence stops at any of them.
        `end_id` (default: the first of `end_ids`, else the codec's end token) also stops and
        pads the rows of a batch."""
        if not model.config.causal:
            raise ValueError("the AR engine needs a causal model; this one is bidirectional (diffusion)")
        self.model = model.eval()
        self.codec = codec
        self.end_ids = resolve_end_ids(codec, end_id, end_ids)
        self.end_id = self.end_ids[0]
        self.config = config or EngineConfig()
        self.max_model_len = self.config.max_model_len or model.config.max_position
        self.grammar = grammar
        self.scheduler = Scheduler(self.config.scheduler_config())
        self.pool = CachePool(self._cached_models(), self.config.max_num_seqs,
                              self.max_model_len + self._lookahead())
        self.runner = ModelRunner(model, self.pool, 0, pad_id=self.end_id, compiled=self._compiled(model),
                                  graphed=self._graphed(model))
        self.prefix_cache = self._prefix_cache()
        self.vocab_size = model.config.vocab_size
        self.steps = {"prefill": 0, "decode": 0}
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}  # wall time of the forwards, by kind
        self._next_seq_id = 0
        self._completed: dict[int, Completion] = {}
        self._seed_source = random.Random()

    def _prefix_cache(self) -> PrefixCache | None:
        """The target model's prefix cache, sized by the config (None when turned off)."""
        block = self.config.prefix_block_size
        tokens = self.config.prefix_cache_tokens
        if block < 1:
            raise ValueError(f"prefix_block_size must be >= 1, got {block}")
        if tokens is None:  # an eighth of the rows, and at least one row's worth (off if under a block)
            tokens = max(self.pool.rows * self.pool.max_tokens // 8, self.pool.max_tokens)
            tokens = tokens if tokens >= block else 0
        elif tokens < 0 or 0 < tokens < block:
            raise ValueError(f"prefix_cache_tokens must be 0 (off) or at least prefix_block_size ({block}), "
                             f"got {tokens}")
        return PrefixCache(self.pool.caches[0], tokens // block, block) if tokens else None

    def _compiled(self, model: Transformer) -> CompiledDecode | None:
        """`model`'s compiled decode step when the config asks for one, compiled now."""
        if not self.config.compile_decode:
            return None
        compiled = CompiledDecode(model)
        compiled.warm_up()
        return compiled

    def _graphed(self, model: Transformer, index: int = 0) -> GraphedDecode | None:
        """`model`'s CUDA-Graph decode step over the pool's cache `index`, when the config and
        the device say so."""
        on_cuda = model.output_weight().device.type == "cuda"
        wanted = on_cuda if self.config.cuda_graphs is None else self.config.cuda_graphs
        if not wanted:
            return None
        graphed = GraphedDecode(model, self.pool.caches[index], capture=on_cuda)
        if on_cuda:  # capture every bucket now, as vLLM does at startup, not in a request's time
            graphed.warm_up()
        return graphed

    # --- hooks the speculative engine overrides ---

    def _cached_models(self) -> list[Transformer]:
        return [self.model]

    def _lookahead(self) -> int:
        """Extra cache slots per row beyond max_model_len (speculative verify writes ahead)."""
        return 1

    # --- requests in ---

    def validate(self, request: GenerationRequest) -> None:
        """Refuse a request before any work, naming the bad parameter."""
        request.sampling.validate()
        if not request.prompt_ids:
            raise InvalidRequestError("prompt_ids is empty: the model needs at least one token to continue")
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt is {len(request.prompt_ids)} tokens; this engine holds at most "
                                      f"{self.max_model_len} per sequence, output included")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt_ids holds ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        bad = [t for t in request.sampling.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        bad = [t for t in request.draft_ids or () if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"draft_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if request.schema is not None and self.grammar is None:
            raise InvalidRequestError("schema: this engine was built without a grammar compiler")

    def submit(self, request: GenerationRequest) -> Sequence:
        self.validate(request)
        matcher = self.grammar.matcher(request.schema) if request.schema is not None else None
        sampling = request.sampling
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(sampling.seed if sampling.seed is not None else self._seed_source.getrandbits(63))
        seq = Sequence(self._next_seq_id, request, frozenset({*self.end_ids, *sampling.stop_token_ids}),
                       self.max_model_len, generator, matcher)
        self._next_seq_id += 1
        self.scheduler.add(seq)
        return seq

    # --- the loop ---

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """Run one scheduled forward; returns the sequences that finished in it."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        started = time.perf_counter()
        if batch.kind == "prefill":
            self._run_prefill(batch)
        else:
            self._run_decode(batch)
        self.steps[batch.kind] += 1
        self.step_seconds[batch.kind] += time.perf_counter() - started
        finished = [s for s in batch.seqs if s.is_finished]
        self._retire(finished)
        return finished

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        for request in requests:  # refuse the batch before any work if one request is bad
            self.validate(request)
        seqs: list[Sequence] = []
        try:
            for request in requests:
                seqs.append(self.submit(request))
        except Exception:  # a full queue: withdraw the ones taken, so nothing runs uncollected
            for seq in seqs:
                if self.scheduler.abort_waiting(seq):
                    seq.finish("cancelled")
            raise
        while not all(s.is_finished for s in seqs):
            self.step()
        return [self._completed.pop(s.seq_id) for s in seqs]

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        """Chunks of newly committed text as steps run (other requests in the engine advance
        too); the last chunk carries the Completion. Text ending in an incomplete UTF-8
        character is held back until the character is whole."""
        seq = self.submit(request)
        sent_tokens, sent_text = 0, ""
        while True:
            if not seq.is_finished:
                self.step()
            if seq.is_finished:
                completion = self._completed.pop(seq.seq_id)
                yield StreamChunk(completion.text[len(sent_text):], seq.output_ids[sent_tokens:], completion,
                                  seq.logprobs_from(sent_tokens))
                return
            if len(seq.output_ids) > sent_tokens:
                text = self._decode_text(seq.output_ids)
                if not text.endswith("\ufffd"):
                    yield StreamChunk(text[len(sent_text):], seq.output_ids[sent_tokens:],
                                      logprobs=seq.logprobs_from(sent_tokens))
                    sent_tokens, sent_text = len(seq.output_ids), text

    # --- one step ---

    def _run_prefill(self, batch: ScheduledBatch) -> None:
        now = time.perf_counter()
        for seq in batch.seqs:
            if seq.row < 0:
                self.pool.allocate(seq)
                seq.admitted_time = now
                if self.prefix_cache is not None:
                    # The chunk the scheduler sized now starts after the restored blocks: the
                    # same tokens budget or less, never more.
                    seq.num_cached = seq.cached_prompt_tokens = self.prefix_cache.restore(
                        seq.prompt_ids, self.pool.caches[0], seq.row)
        starts = [s.num_cached for s in batch.seqs]
        chunks = [s.prompt_ids[start: start + n] for s, start, n in zip(batch.seqs, starts, batch.chunks, strict=True)]
        logits = self.runner.extend(batch.seqs, starts, chunks)
        for seq, chunk in zip(batch.seqs, chunks, strict=True):
            seq.num_cached += len(chunk)
            seq.forwards += 1
        done = [i for i, s in enumerate(batch.seqs) if not s.is_prefilling]
        if self.prefix_cache is not None:
            for i in done:
                self.prefix_cache.store(batch.seqs[i].prompt_ids, self.pool.caches[0], batch.seqs[i].row)
        if done:
            self._sample_and_append([batch.seqs[i] for i in done], logits[done])

    def _run_decode(self, batch: ScheduledBatch) -> None:
        seqs = self._rows(batch)
        longest = max(s.num_cached for s in seqs) + 1  # keys the longest row holds after the step
        logits = self.runner.forward_rows([[s.last_token] for s in seqs], longest=longest)[:, -1]
        for seq in seqs:
            seq.num_cached += 1
            seq.forwards += 1
        self._sample_and_append(seqs, logits)

    def _rows(self, batch: ScheduledBatch) -> list[Sequence]:
        """The decode batch in cache-row order (a decode step runs over every occupied row)."""
        if len(batch.seqs) != self.pool.used:
            raise RuntimeError("decode batch and cache rows disagree")
        return list(self.pool.owners)

    def _apply_grammar(self, seqs: list[Sequence], logits: Tensor) -> Tensor:
        """Logits with each constrained row's forbidden tokens at -inf (a copy when any)."""
        if not any(s.matcher is not None for s in seqs):
            return logits
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.matcher is not None:
                mask_logits(logits[row], seq.matcher.allowed())
                seq.grammar_mask_s = seq.matcher.mask_seconds
        return logits

    def _sample_and_append(self, seqs: list[Sequence], logits: Tensor) -> None:
        if all(s.generator is None and s.matcher is None for s in seqs):
            # Greedy and unconstrained (the common serving case): the argmax, without building
            # per-row parameter tensors; on a small model they cost a visible share of a step.
            tokens = logits.argmax(-1)
        else:
            params = SamplingBatch.from_params([s.request.sampling for s in seqs], logits.device)
            tokens = choose_tokens(self._apply_grammar(seqs, logits), params, [s.generator for s in seqs])
        confidences = token_probability(logits, tokens).tolist()
        # Raw logits (before the grammar mask), as the confidences; only rows that ask pay for it.
        logprobs = row_logprobs(logits, tokens, [s.request.sampling.logprobs for s in seqs])
        now = time.perf_counter()
        for seq, token, confidence, logprob in zip(seqs, tokens.tolist(), confidences, logprobs, strict=True):
            seq.append_token(token, confidence, now, logprob)

    def _retire(self, finished: list[Sequence]) -> None:
        if not finished:
            return
        self.scheduler.retire(finished)
        for seq in finished:
            self.pool.release(seq)
            self._completed[seq.seq_id] = seq.to_completion(self.name, self._decode_text(seq.output_ids))

    def _decode_text(self, ids: list[int]) -> str:
        return self.codec.decode(ids) if self.codec is not None else ""
