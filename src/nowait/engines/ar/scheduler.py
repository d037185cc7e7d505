"""Continuous batching: which sequences run in the next forward (Orca, OSDI 2022; vLLM, SOSP 2023).

At every step the scheduler admits waiting sequences and the engine retires finished ones, so
a short request never waits for a long one to finish. The rules:

- **Prefill before decode.** If any running sequence still has prompt left, or a waiting one
  can be admitted, the step is a prefill; otherwise every running sequence decodes one token.
  Prefills are bounded (admissions need a free cache row), so decodes cannot be starved.
- **Caps.** At most `max_num_seqs` sequences hold a cache row; a step computes at most
  `max_num_batched_tokens` token positions, right padding included (the batch is a padded
  [rows, length] tensor, so padding is real work). A prompt longer than the budget is prefilled
  in chunks across steps.
- **Back-pressure, no preemption.** A sequence is admitted only with a cache row of its own,
  sized for its whole prompt and output, so memory cannot run out mid-decode and nothing needs
  preempting; when rows run out new requests wait in the queue, and `max_waiting` (optional)
  refuses new ones beyond that, which a gateway turns into "try again later".
- **No starvation.** Admission is first come, first served, and a later request never jumps an
  earlier one that does not fit yet; every running sequence advances in every decode step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from nowait.engines.ar.sequence import Sequence, SequenceStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: the caller should retry later (HTTP 429)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_waiting: int | None = None

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # A decode step feeds one token per running sequence; the cap must allow a full batch.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


@dataclass
class ScheduledBatch:
    """One step's work: prefill chunks (`chunks[i]` prompt tokens of `seqs[i]`) or one decode."""

    kind: Literal["prefill", "decode"]
    seqs: list[Sequence]
    chunks: list[int]

    @property
    def num_positions(self) -> int:
        """Token positions the forward computes: rows x longest chunk (padding included)."""
        return len(self.seqs) * max(self.chunks, default=0)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; refused when `max_waiting` requests already wait beyond the free rows
        (a request with a free row waits only for the next step, which admits it)."""
        free_rows = max(0, self.config.max_num_seqs - len(self.running))
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting + free_rows:
            raise QueueFullError(f"{len(self.waiting) - free_rows} requests already waiting for a row (max_waiting)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch; None when nothing is left to do."""
        prefill = self._schedule_prefill()
        if prefill is not None:
            return prefill
        if not self.running:
            return None
        return ScheduledBatch("decode", list(self.running), [1] * len(self.running))

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        chunks: list[int] = []
        # Sequences already holding a row but with prompt left go first (chunked prefill),
        # then the queue in arrival order; the first that does not fit ends the batch.
        candidates = [s for s in self.running if s.is_prefilling]
        free_rows = self.config.max_num_seqs - len(self.running)
        admitted = 0
        while True:
            if candidates:
                seq, new = candidates[0], False
            elif self.waiting and admitted < free_rows:
                seq, new = self.waiting[0], True
            else:
                break
            remaining = seq.num_prompt_tokens - seq.num_cached
            longest = max([*chunks, remaining])
            if (len(seqs) + 1) * longest > budget:
                if seqs:
                    break
                remaining = budget  # alone and still too long: one budget-sized chunk now
            if new:
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                admitted += 1
            else:
                candidates.pop(0)
            seqs.append(seq)
            chunks.append(remaining)
        return ScheduledBatch("prefill", seqs, chunks) if seqs else None

    def retire(self, seqs: list[Sequence]) -> None:
        """Drop finished sequences from the running set (their rows are freed by the runner)."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]

    def abort_waiting(self, seq: Sequence) -> bool:
        """Remove a sequence that has not started (a cancelled request)."""
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True
