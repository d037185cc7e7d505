"""Training the demo models: an AR target, a smaller AR draft, and a masked-diffusion model.

AR: next-token cross-entropy on the answer, plus a down-weighted loss on the document tokens
(without it a small model learns the JSON format but never starts copying values).
Diffusion: the LLaDA objective (arXiv 2502.09992) on the answer window: mask each position with
probability t ~ U(0, 1), cross-entropy on the masked positions weighted by 1/t. It starts from
the trained AR weights with Dream's logit shift (position i predicts i + 1), as Dream-7B and
DiffuLLaMA adapt AR models, so the copying circuits carry over.

A curriculum ramps the corpus' `variety` from clean, pre-normalized documents (pure copying)
to the full distribution, so the copying heads form before the normalizations are learned.
`hard_fraction` mixes hard-tier documents (tables, letters, packets, amendments, scan noise,
instructions in many wordings) into the stream; the hard tier's held-out layouts and labels
never occur in training, and `eval_tier` picks the validation tier the best checkpoint is chosen on.
Runs are resumable: the data stream is a function of its index, stored with the checkpoint.
Batches are built by worker processes ahead of the optimizer (`data_workers`), each pool of
batches a pure function of its first data index, so a GPU run is not starved by the CPU.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nowait.checkpoints import load_pretrained, save_pretrained
from nowait.engines.diffusion.reference import window_logits
from nowait.engines.structured.templates import Template, build_template, fill_template
from nowait.evaluation import ANSWER_WINDOW, evaluate_model
from nowait.extraction.corpus import (
    KINDS,
    Document,
    documents,
    schema_for,
    training_exclude,
    training_range,
    training_stream,
)
from nowait.model import ModelConfig, Transformer
from nowait.paths import write_replacing
from nowait.tokenizer import END, TextCodec, document_prompt, extraction_prompt, train_tokenizer

MODEL_PRESETS: dict[str, dict] = {
    "ar": dict(hidden_size=192, intermediate_size=512, num_layers=4, num_heads=6, num_kv_heads=3),
    "draft": dict(hidden_size=128, intermediate_size=344, num_layers=2, num_heads=4, num_kv_heads=2),
    "diffusion": dict(hidden_size=192, intermediate_size=512, num_layers=4, num_heads=6, num_kv_heads=3,
                      causal=False, logits_shift=True),
}


@dataclass
class TrainSettings:
    kind: str  # ar | draft | diffusion
    steps: int = 6000
    batch_size: int = 16
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # warmup-stable-decay: cosine to 10% over the last 20% of steps
    document_loss_weight: float = 0.5
    clean_steps: int = 1000  # variety 0 (clean, pre-normalized documents) for these steps
    curriculum_steps: int = 1000  # then variety ramps 0 -> 1 over these steps
    weight_decay: float = 0.01
    seed: int = 0
    eval_every: int = 500
    eval_documents: int = 60
    threads: int = 2
    init_from: str | None = None  # start from these weights (diffusion: a trained AR checkpoint)
    template_fraction: float = 0.5  # diffusion: share of rows in the schema-template layout
    prompt_isolation: float = 0.0  # diffusion: share of rows whose prompt attends only to itself
    device: str = "cpu"
    data_workers: int = 0  # processes building batches ahead of the optimizer (0: in this process)
    minutes: float | None = None  # a time budget: `steps` is re-planned from the measured step rate
    data_start: int = 0  # first data index of a new run (a continuation reads documents it never saw)
    hard_fraction: float = 0.0  # share of hard-tier documents in the stream (0: the clean stream exactly)
    eval_tier: str = "clean"  # the tier of the periodic validation (mixed: the best keeps clean and gains hard)
    model: dict = field(default_factory=dict)


def learning_rate_at(step: int, settings: TrainSettings) -> float:
    """Warmup-stable-decay: linear warmup, constant, cosine down to 10% at the end."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    decay_start = int(settings.steps * (1 - settings.decay_fraction))
    if step < decay_start:
        return settings.learning_rate
    progress = (step - decay_start) / max(1, settings.steps - decay_start)
    return settings.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def curriculum(settings: TrainSettings) -> Callable[[int], float]:
    """variety as a function of the data index: 0 for `clean_steps`, then a linear ramp to 1.

    Clean documents list the fields in schema order with values already normalized, so the
    answer is a copy; the copying circuits form there first, and the ramp then adds synonyms,
    formats, distractors and shuffling. A too-short clean phase left the model on the
    plateau of ignoring the document (answer loss ~0.75 after 1,000 steps)."""
    clean = settings.clean_steps * settings.batch_size
    ramp = max(1, settings.curriculum_steps * settings.batch_size)
    return lambda index: min(1.0, max(0.0, (index - clean) / ramp))


def planned_steps(step: int, steps_per_s: float, remaining_s: float) -> int:
    """The total steps a time-budgeted run reaches: `step` now, then `steps_per_s` for the rest.

    Warmup-stable-decay needs its total before the decay starts, so such a run re-plans
    during the stable phase and keeps the plan once the decay has begun."""
    return step + 1 + int(steps_per_s * max(0.0, remaining_s))


# --- batches ---


def ar_batch(docs: list[Document], codec: TextCodec, document_weight: float) -> tuple[torch.Tensor, ...]:
    """Inputs, targets and per-target weights (answer 1, document `document_weight`, pad 0)."""
    sequences, prompt_lengths = [], []
    for doc in docs:
        prompt = codec.encode(document_prompt(doc))
        sequences.append(prompt + codec.encode(doc.answer_json()) + [codec.end_id])
        prompt_lengths.append(len(prompt))
    length = max(len(s) for s in sequences) - 1
    inputs = torch.full((len(docs), length), codec.end_id, dtype=torch.long)
    targets = torch.full((len(docs), length), codec.end_id, dtype=torch.long)
    answer = torch.zeros(len(docs), length)
    document = torch.zeros(len(docs), length)
    for row, (seq, prompt_length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        n = len(seq) - 1
        inputs[row, :n] = torch.tensor(seq[:-1])
        targets[row, :n] = torch.tensor(seq[1:])
        answer[row, prompt_length - 1: n] = 1.0  # target index t predicts token t + 1
        document[row, : prompt_length - 1] = document_weight
    return inputs, targets, answer, document


def ar_loss(model: Transformer, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict]:
    inputs, targets, answer, document = batch
    logits = model(inputs)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view_as(answer)
    answer_loss = (losses * answer).sum() / answer.sum()
    document_loss = (losses * (document > 0)).sum() / (document > 0).sum().clamp(min=1)
    weight = float(document.max()) if document.numel() else 0.0
    return answer_loss + weight * document_loss, {"answer_loss": float(answer_loss.detach()),
                                                  "document_loss": float(document_loss.detach())}


class DiffusionBatch(NamedTuple):
    noisy: torch.Tensor  # [B, L] prompt + answer window with masked positions replaced
    total: torch.Tensor  # [B] real length of each row
    prompt_lengths: torch.Tensor  # [B]
    targets: torch.Tensor  # [B, W] the answer window (end-padded past each row's window)
    masked: torch.Tensor  # [B, W] positions replaced by the mask token
    p_mask: torch.Tensor  # [B] masking probability of each row
    maskable: torch.Tensor  # [B, W] positions the model must learn to fill
    prompt_isolated: torch.Tensor  # [B] rows whose prompt attends only to itself (block-causal)


def diffusion_batch(docs: list[Document], codec: TextCodec, window: int, generator: torch.Generator,
                    templates: dict[str, Template] | None = None, template_fraction: float = 0.0,
                    prompt_isolation: float = 0.0) -> DiffusionBatch:
    """Prompt + answer window; each fillable window position is masked with probability t.

    Free-form rows: the JSON, an end token, end padding to `window`; every position fillable.
    Template rows (a `template_fraction` of rows when `templates` are given): the kind's
    schema template with values in their slots; only slot positions are fillable, as in
    template infilling at inference.
    Isolated rows (a `prompt_isolation` share): the prompt attends only to itself, as it does
    when the engine computes the prompt's keys/values once; training on both patterns makes the
    prompt cache a pattern the model knows instead of an approximation.
    """
    prompts, answers, fillable = [], [], []
    for doc in docs:
        prompts.append(codec.encode(document_prompt(doc)))
        answer = None
        if templates and float(torch.rand(1, generator=generator)) < template_fraction:
            template = templates[doc.kind]
            answer = fill_template(template, doc.fields, codec)
            if answer is not None:
                slot_positions = set(template.slot_positions)
                fillable.append([i in slot_positions for i in range(len(answer))])
        if answer is None:
            answer = [*codec.encode(doc.answer_json())[: window - 1], codec.end_id]
            answer += [codec.end_id] * (window - len(answer))
            fillable.append([True] * len(answer))
        answers.append(answer)
    width = max(len(a) for a in answers)
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    total = prompt_lengths + torch.tensor([len(a) for a in answers])
    tokens = torch.full((len(docs), int(total.max())), codec.end_id, dtype=torch.long)
    targets = torch.full((len(docs), width), codec.end_id, dtype=torch.long)
    maskable = torch.zeros(len(docs), width, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
        tokens[row, len(prompt): len(prompt) + len(answer)] = torch.tensor(answer)
        targets[row, : len(answer)] = torch.tensor(answer)
        maskable[row, : len(answer)] = torch.tensor(fillable[row])
    # LLaDA's p_mask = (1 - eps) t + eps keeps 1/t bounded.
    t = torch.rand(len(docs), generator=generator)
    p_mask = (1 - 1e-3) * t + 1e-3
    masked = (torch.rand(len(docs), width, generator=generator) < p_mask[:, None]) & maskable
    positions = (prompt_lengths[:, None] + torch.arange(width)).clamp(max=tokens.shape[1] - 1)
    rows = torch.arange(len(docs))[:, None]
    noisy = tokens.clone()
    noisy[rows, positions] = torch.where(masked, torch.full_like(targets, codec.mask_id), tokens[rows, positions])
    isolated = torch.rand(len(docs), generator=generator) < prompt_isolation
    return DiffusionBatch(noisy, total, prompt_lengths, targets, masked, p_mask, maskable, isolated)


def prompt_isolation_mask(prompt_lengths: torch.Tensor, valid_lengths: torch.Tensor, length: int,
                          isolated: torch.Tensor) -> torch.Tensor:
    """[B, T, T] (True = may attend): keys past each row's valid length are hidden; in isolated
    rows the prompt's queries also skip the keys after the prompt (a block-causal prompt)."""
    index = torch.arange(length, device=valid_lengths.device)
    real_key = index[None, None, :] < valid_lengths[:, None, None]
    prompt_query = index[None, :, None] < prompt_lengths[:, None, None]
    later_key = index[None, None, :] >= prompt_lengths[:, None, None]
    return real_key & ~(prompt_query & later_key & isolated[:, None, None])


def diffusion_loss(model: Transformer, batch: DiffusionBatch) -> tuple[torch.Tensor, dict]:
    """LLaDA's objective: cross-entropy on masked positions weighted by 1/t, per fillable position."""
    width = batch.targets.shape[1]
    if bool(batch.prompt_isolated.any()):
        mask = prompt_isolation_mask(batch.prompt_lengths, batch.total, batch.noisy.shape[1], batch.prompt_isolated)
        logits = model(batch.noisy, attention_mask=mask)
    else:
        logits = model(batch.noisy, valid_lengths=batch.total)
    logits = window_logits(logits, batch.prompt_lengths, width, model.config.logits_shift)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="none")
    losses = losses.view_as(batch.targets)
    weighted = (losses * batch.masked / batch.p_mask[:, None]).sum() / batch.maskable.sum().clamp(min=1)
    plain = (losses * batch.masked).sum() / batch.masked.sum().clamp(min=1)
    return weighted, {"answer_loss": float(plain.detach())}


# --- the training loop ---


def build_tokenizer(path: Path, documents_for_vocabulary: int = 6000, vocab_size: int = 1024) -> TextCodec:
    """Train the shared BPE on training documents only (never validation or test)."""
    stream = training_stream(0)
    texts = []
    for _ in range(documents_for_vocabulary):
        doc = next(stream)
        texts.append(extraction_prompt(doc.kind, doc.text) + doc.answer_json() + END)
    tokenizer = train_tokenizer(texts, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return TextCodec(tokenizer)


BUCKETS = 4  # batches drawn together and grouped by length, so padding wastes little compute


def pool_size(settings: TrainSettings) -> int:
    """Documents per pool: BUCKETS batches drawn together, then grouped by length."""
    return settings.batch_size * BUCKETS


class BatchMaker:
    """The training batches of one pool of documents: a pure function of the pool's first index.

    A pool is the documents with data indices [start, start + batch_size * BUCKETS), sorted by
    length and cut into batches (similar lengths pad little), in an order and with masking
    noise seeded by the pool's index; so batches can be built in any process, in any order,
    and a resumed run continues the same stream from a pool boundary.
    """

    def __init__(self, settings: TrainSettings, tokenizer_path: Path) -> None:
        self.settings = settings
        self.codec = TextCodec.from_file(tokenizer_path)
        self.variety = curriculum(settings)
        self.exclude = training_exclude(settings.hard_fraction)
        self.templates = ({kind: build_template(schema_for(kind), self.codec, self.codec.mask_id) for kind in KINDS}
                          if settings.kind == "diffusion" else None)

    def __call__(self, start: int) -> list[tuple]:
        s = self.settings
        pool = sorted(training_range(start, start + pool_size(s), self.variety, self.exclude, s.hard_fraction),
                      key=lambda d: len(d.text) + len(d.answer_json()))
        groups = [pool[i: i + s.batch_size] for i in range(0, len(pool), s.batch_size)]
        random.Random(f"buckets:{s.seed}:{start}").shuffle(groups)
        if s.kind != "diffusion":
            return [ar_batch(group, self.codec, s.document_loss_weight) for group in groups]
        generator = torch.Generator().manual_seed(s.seed * 1_000_003 + start)
        return [diffusion_batch(group, self.codec, ANSWER_WINDOW, generator, self.templates, s.template_fraction,
                                s.prompt_isolation) for group in groups]


_worker_maker: BatchMaker | None = None


def _start_worker(settings: TrainSettings, tokenizer_path: Path) -> None:
    global _worker_maker
    torch.set_num_threads(1)
    _worker_maker = BatchMaker(settings, tokenizer_path)


def _worker_pool(start: int) -> list[tuple]:
    assert _worker_maker is not None
    return _worker_maker(start)


def batch_stream(settings: TrainSettings, tokenizer_path: Path, start_index: int) -> Iterator[tuple[tuple, int]]:
    """(batch, data index to resume from) forever. The index advances a whole pool at a time, so
    a resumed run starts at a pool boundary (at most BUCKETS - 1 batches are seen twice or skipped).
    With `data_workers`, that many processes build pools ahead, a bounded number in flight."""
    size = pool_size(settings)
    starts = iter(range(start_index, 2**62, size))
    if settings.data_workers <= 0:
        maker = BatchMaker(settings, tokenizer_path)
        for start in starts:
            yield from ((batch, start + size) for batch in maker(start))
        return
    # spawn, not fork: the parent may already hold a CUDA context, which a fork cannot share.
    context = multiprocessing.get_context("spawn")
    workers = context.Pool(settings.data_workers, _start_worker, (settings, tokenizer_path))
    in_flight: deque = deque()
    try:
        while True:
            while len(in_flight) < 2 * settings.data_workers:
                start = next(starts)
                in_flight.append((start, workers.apply_async(_worker_pool, (start,))))
            start, result = in_flight.popleft()
            yield from ((batch, start + size) for batch in result.get())
    finally:
        # close + join, not terminate: terminating a pool while pools are still in flight races its
        # result thread (CPython's "Cannot have cache with result_hander not alive"); the few in
        # flight are finished and dropped.
        workers.close()
        workers.join()


def to_device(batch: tuple, device: str | torch.device) -> tuple:
    """The batch's tensors on `device` (a DiffusionBatch stays one)."""
    moved = [t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch]
    return type(batch)(*moved) if isinstance(batch, DiffusionBatch) else tuple(moved)


def _new_model(settings: TrainSettings, codec: TextCodec) -> Transformer:
    if settings.init_from:
        loaded = load_pretrained(settings.init_from)
        config = loaded.model.config
        config.causal = settings.model.get("causal", config.causal)
        config.logits_shift = settings.model.get("logits_shift", config.logits_shift)
        config.mask_token_id = codec.mask_id
        model = Transformer(config)
        model.load_state_dict(loaded.model.state_dict())
        return model
    config = ModelConfig(vocab_size=codec.vocab_size, mask_token_id=codec.mask_id, **settings.model)
    return Transformer(config)


class ResumeError(ValueError):
    """A run directory's state.pt that this run cannot resume."""



def train(settings: TrainSettings, run_dir: Path, export_dir: Path, tokenizer_path: Path,
          progress: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) a model; export the best validation checkpoint to `export_dir`.

    Writes `run_dir/state.pt` (model, optimizer, step, data index) after every evaluation,
    `run_dir/log.jsonl` (loss per 10 steps, validation metrics per evaluation) and
    `run_dir/settings.json`. With `settings.minutes`, the total steps are re-planned from the
    measured rate until the decay begins (the log's records carry `steps`).
    """
    torch.set_num_threads(settings.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    codec = TextCodec.from_file(tokenizer_path) if tokenizer_path.exists() else build_tokenizer(tokenizer_path)
    state_path, log_path = run_dir / "state.pt", run_dir / "log.jsonl"
    settings.model = {**MODEL_PRESETS.get(settings.kind, {}), **settings.model}
    torch.manual_seed(settings.seed)
    random.seed(settings.seed)
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # tensor cores for fp32 weights; ample for training
    model = _new_model(settings, codec).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=settings.weight_decay)
    step, data_index, best = 0, settings.data_start, -1.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        try:
            optimizer.load_state_dict(state["optimizer"])
        except ValueError:
            # The optimizer's state is per parameter: one written for other parameters (before
            # q/k/v and gate/up were fused, or for another model) cannot go on, whatever the weights.
            raise ResumeError(f"{state_path}: its optimizer state does not fit this model's parameters (written "
                              "by an older nowait, before the q/k/v and gate/up projections were fused, or for "
                              "another kind or size); start a new --run-dir, with --init-from the exported "
                              "checkpoint to keep its weights") from None
        step, data_index, best = state["step"], state["data_index"], state["best"]
    validation = documents("validation", settings.eval_documents, tier=settings.eval_tier)
    batches = batch_stream(settings, tokenizer_path, data_index)
    log = log_path.open("a")
    recent: list[float] = []
    started, step_cap = time.time(), settings.steps
    rate_clock: tuple[int, float] | None = None  # (step, time) once the data workers are up
    while step < settings.steps:
        batch, data_index = next(batches)
        batch = to_device(batch, device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, settings)
        model.train()
        loss, parts = (diffusion_loss if settings.kind == "diffusion" else ar_loss)(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        recent.append(parts["answer_loss"])
        record = {"step": step, "loss": loss.item(), **parts, "lr": learning_rate_at(step - 1, settings)}
        if settings.minutes and time.time() - started > settings.minutes * 60:
            settings.steps = step  # out of time (a plan could not settle, or evaluations ran long): end here
        if step % 10 == 0:
            in_stable_phase = step < int(settings.steps * (1 - settings.decay_fraction))
            now = time.time()
            if rate_clock is None:
                rate_clock = (step, now)  # this run's rate, after its start-up
            elif settings.minutes and in_stable_phase and step - rate_clock[0] >= 50:
                steps_per_s = (step - rate_clock[0]) / max(now - rate_clock[1], 1e-9)
                remaining_s = settings.minutes * 60 - (now - started)
                settings.steps = min(step_cap, planned_steps(step, steps_per_s, remaining_s))
            record["answer_loss_avg10"] = sum(recent[-10:]) / len(recent[-10:])
            record["elapsed_s"] = round(time.time() - started, 1)
            record["steps"] = settings.steps
            log.write(json.dumps(record) + "\n")
            log.flush()
        if step % settings.eval_every == 0 or step == settings.steps:
            metrics = evaluate_model(model, codec, validation)
            metrics.pop("per_kind")
            record = {"step": step, "eval": metrics, "elapsed_s": round(time.time() - started, 1)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if metrics["field_accuracy"] >= best:
                best = metrics["field_accuracy"]
                save_pretrained(model, codec, export_dir, notes={
                    "kind": settings.kind, "step": step, "validation": metrics,
                    "settings": {k: v for k, v in asdict(settings).items() if k != "model"},
                })
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                          "data_index": data_index, "best": best, "steps": settings.steps}
            write_replacing(state_path, functools.partial(torch.save, checkpoint))
        if progress:
            progress(step, {**record, "steps": settings.steps})
    batches.close()
    log.close()
    (run_dir / "settings.json").write_text(json.dumps(asdict(settings), indent=2) + "\n")
    return {"step": step, "best_validation_field_accuracy": best, "export": str(export_dir)}
