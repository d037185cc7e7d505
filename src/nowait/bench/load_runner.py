"""Load profiles, in guidellm's terms, and the loop that runs one of them against a target.

    synchronous     one request at a time: the latency floor (each request alone)
    concurrent N    N streams, each sending its next request as soon as the last one answers
    poisson R       open loop: arrivals with exponential gaps at R requests/s, whatever the
                    answers do (what real users do; queueing shows up as latency)
    sweep K         synchronous, then a throughput run (concurrent at --max-concurrency), then
                    K - 2 Poisson rates evenly spaced between the two measured request rates

Every run stops issuing requests at `max_requests` or `max_seconds`, whichever comes first, then
waits for the requests in flight (each bounded by its timeout). `stop` (Ctrl-C) ends a run at
once: requests in flight are cancelled and what finished is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from nowait.bench.load_metrics import RequestRecord, RunSummary, summarize_run
from nowait.bench.load_workload import LoadRequest

PROFILES = ("synchronous", "concurrent", "poisson", "sweep")
DEFAULT_SWEEP_POINTS = 5


class Target(Protocol):
    """Something requests can be sent to: an HTTP model, or an engine in process."""

    name: str  # the model or engine asked for
    kind: str | None  # its engine kind when known (ar, spec, diffusion, remote, router)

    async def send(self, request: LoadRequest, t0: float) -> RequestRecord: ...


@dataclass(frozen=True)
class RunSpec:
    """One point of a profile: how requests are issued."""

    mode: str  # synchronous | concurrent | poisson
    rate: float | None = None  # streams (concurrent) or requests/s (poisson)
    stage: str = ""  # sweep: synchronous, throughput or a rate

    @property
    def label(self) -> str:
        if self.mode == "synchronous":
            return "synchronous"
        if self.mode == "concurrent":
            return f"concurrent@{int(self.rate)}"
        return f"poisson@{self.rate:.3g}/s"


@dataclass(frozen=True)
class Bounds:
    max_requests: int | None = None
    max_seconds: float | None = None

    def allow(self, issued: int, elapsed_s: float) -> bool:
        if self.max_requests is not None and issued >= self.max_requests:
            return False
        return self.max_seconds is None or elapsed_s < self.max_seconds


@dataclass
class RunResult:
    target: str
    kind: str | None
    spec: RunSpec
    records: list[RequestRecord] = field(default_factory=list)
    interrupted: bool = False

    @property
    def summary(self) -> RunSummary:
        return summarize_run(self.records)

    def as_dict(self) -> dict:
        return {"target": self.target, "kind": self.kind, "profile": self.spec.mode, "rate": self.spec.rate,
                "label": self.spec.label, "interrupted": self.interrupted, **self.summary.as_dict()}


def check_rates(profile: str, rates: list[float]) -> None:
    """ValueError naming what is wrong with --rate for this profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of: {', '.join(PROFILES)}")
    for rate in rates:
        if not rate > 0:
            raise ValueError(f"--rate must be greater than 0 (got {rate:g})")
    if profile == "concurrent" and any(rate != int(rate) for rate in rates):
        raise ValueError("--rate for the concurrent profile is a number of streams: whole numbers only")
    if profile == "poisson" and not rates:
        raise ValueError("the poisson profile needs --rate (requests per second), e.g. --rate 2 or --rate 1,2,4")
    if profile == "sweep" and (len(rates) > 1 or (rates and (rates[0] < 2 or rates[0] != int(rates[0])))):
        raise ValueError("--rate for the sweep profile is its number of runs: one whole number, at least 2")


def fixed_specs(profile: str, rates: list[float]) -> list[RunSpec]:
    """The runs of a non-sweep profile (one per rate)."""
    if profile == "synchronous":
        return [RunSpec("synchronous")]
    if profile == "concurrent":
        return [RunSpec("concurrent", float(int(r))) for r in (rates or [4])]
    return [RunSpec("poisson", float(r)) for r in rates]


def sweep_rates(synchronous_rps: float, throughput_rps: float, points: int) -> list[float]:
    """The Poisson rates between the synchronous and the throughput request rates (both excluded)."""
    inner = max(0, points - 2)
    low, high = sorted((synchronous_rps, throughput_rps))
    if inner == 0 or high <= 0:
        return []
    if high - low < 1e-9:  # no headroom over one-at-a-time: one Poisson run at that rate
        return [round(high, 4)]
    return [round(float(r), 4) for r in np.linspace(low, high, inner + 2)[1:-1]]


async def execute(target: Target, spec: RunSpec, requests: Iterator[LoadRequest], bounds: Bounds,
                  stop: asyncio.Event, on_record: Callable[[RequestRecord], None] | None = None,
                  seed: int = 0) -> RunResult:
    """Run one profile point against a target; records keep the order they finished in."""
    result = RunResult(target.name, target.kind, spec)
    t0 = time.perf_counter()
    issued = 0

    def may_issue() -> bool:
        return not stop.is_set() and bounds.allow(issued, time.perf_counter() - t0)

    def keep(record: RequestRecord) -> None:
        result.records.append(record)
        if on_record is not None:
            on_record(record)

    async def stream_worker() -> None:
        nonlocal issued
        while may_issue():
            issued += 1
            keep(await target.send(next(requests), t0))

    tasks: set[asyncio.Task] = set()
    try:
        if spec.mode in ("synchronous", "concurrent"):
            streams = 1 if spec.mode == "synchronous" else int(spec.rate or 1)
            tasks = {asyncio.ensure_future(stream_worker()) for _ in range(streams)}
            await _until_done_or_stopped(tasks, stop)
        else:
            rng = np.random.default_rng(seed)
            arrival = 0.0
            while True:
                arrival += float(rng.exponential(1.0 / float(spec.rate)))
                wait = t0 + arrival - time.perf_counter()
                if wait > 0:
                    with contextlib.suppress(asyncio.TimeoutError):  # woken by stop, or time to send
                        await asyncio.wait_for(stop.wait(), wait)
                if not may_issue() or (bounds.max_seconds is not None and arrival >= bounds.max_seconds):
                    break
                issued += 1
                task = asyncio.ensure_future(target.send(next(requests), t0))
                task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else keep(t.result()))
                tasks.add(task)
            await _until_done_or_stopped(tasks, stop)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    result.interrupted = stop.is_set()
    return result


async def _until_done_or_stopped(tasks: set[asyncio.Task], stop: asyncio.Event) -> None:
    """Wait for every task, or for `stop` (then the caller cancels what is left)."""
    if not tasks:
        return
    stopper = asyncio.ensure_future(stop.wait())
    try:
        pending = set(tasks)
        while pending and not stop.is_set():
            _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopper)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
    finally:
        stopper.cancel()
