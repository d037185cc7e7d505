"""Capacity: a discrete-event simulation of Poisson arrivals into replicas running a serving engine.

Requests wait in one FIFO queue. A replica runs its batch step by step; at each step boundary it
retires finished requests and admits waiting ones up to its batch cap and KV-cache budget (prefill
before decode, as vLLM schedules). Between admissions and retirements nothing changes but the
context length, so the loop advances a replica by many steps at once ("macro-steps"), and an
arrival cuts the running macro-step of a replica with a free slot at its next step boundary. The
cost is a few events per request, whatever the number of decode steps.

Checked against the M/M/1 and M/M/c closed forms (Erlang C) in the tests: with a batch cap of 1
and exponential work, the replicas are c servers with one queue.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nowait.planner.engines import ServingModel


@dataclass(frozen=True)
class Request:
    arrival_s: float
    input_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class SimulationResult:
    replicas: int
    completed: int
    p50_latency_s: float
    p99_latency_s: float
    mean_latency_s: float
    mean_wait_s: float
    busy_fraction: float  # share of replica-time with a batch running
    output_tokens_per_s: float  # over the whole run, all replicas
    measured: int = 0  # requests the latency statistics describe (see `steady_window`)

    @property
    def steady(self) -> bool:
        """Whether most arrivals fell in the steady window: else the run was too short for its
        latencies (a fleet that never filled), and its statistics are optimistic."""
        return self.measured >= STEADY_SHARE * self.completed


# A fleet fills (and, once arrivals stop, empties) within a few request lifetimes.
FILL_LIFETIMES = 3
STEADY_SHARE = 0.5  # of the arrivals, in the steady window, for a run to count as long enough


def steady_window(arrivals: np.ndarray, latency: np.ndarray, warmup_fraction: float) -> np.ndarray:
    """The arrivals whose latencies describe the steady state (a boolean mask): after the warm-up
    (the first `warmup_fraction` of the arrival span, and at least FILL_LIFETIMES median
    latencies, while the fleet fills) and before the cool-down (the last FILL_LIFETIMES median
    latencies, whose requests meet a fleet emptying as arrivals stop). Discarding by count would
    keep requests that saw a half-empty fleet whenever a request outlives the warm-up count."""
    lifetime = float(np.median(latency)) if len(latency) else 0.0
    first, last = float(arrivals[0]), float(arrivals[-1])
    start = first + max(warmup_fraction * (last - first), FILL_LIFETIMES * lifetime)
    return (arrivals >= start) & (arrivals <= last - FILL_LIFETIMES * lifetime)


def poisson_arrivals(rate_per_s: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process: exponential inter-arrival gaps with mean 1/rate."""
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=count))


def make_requests(arrivals: Sequence[float], input_tokens: Sequence[float],
                  output_tokens: Sequence[float]) -> list[Request]:
    return [Request(float(a), float(i), float(o)) for a, i, o in zip(arrivals, input_tokens, output_tokens,
                                                                      strict=True)]


class _Replica:
    __slots__ = ("context", "free_at", "ids", "kv_used", "prefill_s", "remaining", "started_at", "step_s",
                 "steps", "version")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.remaining: list[float] = []
        self.context: list[float] = []
        self.kv_used = 0.0
        self.version = 0
        self.free_at: float | None = None  # end of the running macro-step; None when idle
        self.started_at = self.prefill_s = self.step_s = 0.0
        self.steps = 0

    def next_boundary_after(self, time: float) -> tuple[float, int]:
        """The first step boundary at or after `time` of the running macro-step, and its step count."""
        if self.step_s <= 0:
            return self.free_at or time, self.steps
        done = math.ceil((time - self.started_at - self.prefill_s) / self.step_s - 1e-12)
        steps = min(self.steps, max(1, done))
        return self.started_at + self.prefill_s + steps * self.step_s, steps


def simulate(serving: ServingModel, replicas: int, requests: Sequence[Request],
             warmup_fraction: float = 0.1) -> SimulationResult:
    """Run every request to completion; latency statistics cover the steady window (`steady_window`)."""
    count = len(requests)
    started = np.zeros(count)
    finished = np.zeros(count)
    tokens_per_step = serving.tokens_per_step
    cap = max(1, serving.max_batch)
    budget = serving.kv_token_budget
    kv_need = [serving.kv_tokens(r.input_tokens, r.output_tokens) for r in requests]
    pool = [_Replica() for _ in range(replicas)]
    idle = list(range(replicas - 1, -1, -1))  # a stack: the lowest-numbered idle replica is woken first
    queue: deque[int] = deque()
    events: list[tuple[float, int, int]] = []  # (time, replica, version)
    busy = 0.0
    now = 0.0

    def has_room(replica: _Replica, index: int) -> bool:
        if len(replica.ids) >= cap:
            return False
        return not replica.ids or replica.kv_used + kv_need[index] <= budget

    def start_macro_step(r: int) -> None:
        """At a boundary of replica r: admit from the queue, plan the steps until the next retirement."""
        replica = pool[r]
        admitted: list[int] = []
        while queue and has_room(replica, queue[0]):
            index = queue.popleft()
            admitted.append(index)
            replica.ids.append(index)
            replica.remaining.append(requests[index].output_tokens)
            replica.context.append(requests[index].input_tokens)
            replica.kv_used += kv_need[index]
            started[index] = now
        if not replica.ids:
            replica.free_at = None
            idle.append(r)
            return
        prefill = 0.0
        if admitted:
            mean_prompt = sum(requests[i].input_tokens for i in admitted) / len(admitted)
            prefill = serving.prefill_seconds(mean_prompt, len(admitted))
        steps = max(1, min(math.ceil(rem / tokens_per_step - 1e-9) for rem in replica.remaining))
        batch = len(replica.ids)
        advance = steps * tokens_per_step / 2  # context and remaining at the middle of the macro-step
        mean_context = sum(replica.context) / batch + advance
        mean_remaining = max(sum(replica.remaining) / batch - advance, 0.0)
        step_s = serving.step_seconds(batch, mean_context, mean_remaining)
        replica.started_at, replica.prefill_s, replica.step_s, replica.steps = now, prefill, step_s, steps
        replica.free_at = now + prefill + steps * step_s
        replica.version += 1
        heapq.heappush(events, (replica.free_at, r, replica.version))

    def end_macro_step(r: int) -> None:
        nonlocal busy
        replica = pool[r]
        busy += now - replica.started_at
        moved = replica.steps * tokens_per_step
        keep_ids, keep_remaining, keep_context = [], [], []
        for index, remaining, context in zip(replica.ids, replica.remaining, replica.context, strict=True):
            remaining -= moved
            if remaining <= 1e-9:
                finished[index] = now
                replica.kv_used -= kv_need[index]
            else:
                keep_ids.append(index)
                keep_remaining.append(remaining)
                keep_context.append(context + moved)
        replica.ids, replica.remaining, replica.context = keep_ids, keep_remaining, keep_context
        if not keep_ids:
            replica.kv_used = 0.0
        start_macro_step(r)

    def on_arrival(index: int) -> None:
        queue.append(index)
        if idle:
            start_macro_step(idle.pop())
            return
        # No idle replica: cut the running macro-steps of the replicas with room that reach a boundary
        # first, as many as it takes to seat the whole queue there.
        candidates = sorted((*replica.next_boundary_after(now), r) for r, replica in enumerate(pool)
                            if has_room(replica, index))
        unseated = len(queue)
        for boundary, steps, r in candidates:
            replica = pool[r]
            if steps < replica.steps:
                replica.steps, replica.free_at = steps, boundary
                replica.version += 1
                heapq.heappush(events, (boundary, r, replica.version))
            unseated -= cap - len(replica.ids)
            if unseated <= 0:
                break

    next_arrival = 0
    while next_arrival < count or events:
        if next_arrival < count and (not events or requests[next_arrival].arrival_s < events[0][0]):
            now = requests[next_arrival].arrival_s
            on_arrival(next_arrival)
            next_arrival += 1
            continue
        time, r, version = heapq.heappop(events)
        if version != pool[r].version:
            continue  # superseded by a cut
        now = time
        end_macro_step(r)

    arrivals = np.array([r.arrival_s for r in requests])
    window = steady_window(arrivals, finished - arrivals, warmup_fraction)
    if not window.any():  # too short to have a steady state: report it all, flagged by `steady`
        window = np.ones(count, dtype=bool)
        measured = 0
    else:
        measured = int(window.sum())
    latency = finished[window] - arrivals[window]
    wait = started[window] - arrivals[window]
    horizon = max(now, 1e-12)
    return SimulationResult(
        replicas=replicas, completed=count,
        p50_latency_s=float(np.percentile(latency, 50)), p99_latency_s=float(np.percentile(latency, 99)),
        mean_latency_s=float(latency.mean()), mean_wait_s=float(wait.mean()),
        busy_fraction=busy / (replicas * horizon),
        output_tokens_per_s=sum(r.output_tokens for r in requests) / horizon,
        measured=measured,
    )


# Erlang C (Erlang 1917) via the Erlang B recursion B(k) = A B(k-1) / (k + A B(k-1)) (Kleinrock 1975, vol. 1):
# the probability that an arrival to an M/M/c queue with offered load A = lambda / mu has to wait.
def erlang_c(servers: int, offered_load: float) -> float:
    if offered_load >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return servers * blocking / (servers - offered_load * (1 - blocking))


# M/M/c mean wait in queue: Wq = C(c, A) / (c mu - lambda) (Kleinrock 1975, vol. 1, eq. 3.40).
def mmc_mean_wait(arrival_rate: float, service_rate: float, servers: int) -> float:
    if arrival_rate >= servers * service_rate:
        return math.inf
    return erlang_c(servers, arrival_rate / service_rate) / (servers * service_rate - arrival_rate)


@dataclass(frozen=True)
class FleetSearch:
    nodes: int | None  # None: no fleet up to the search limit holds the target
    result: SimulationResult | None  # the simulation of the chosen fleet (or of the largest tried)


def smallest_fleet(run: Callable[[int], SimulationResult], target_p99_s: float, lower_bound: int,
                   limit: int) -> FleetSearch:
    """The fewest nodes whose simulated p99 holds the target, searching up from a throughput lower bound.

    p99 falls as nodes are added (same random arrivals for every size), so the search doubles until
    the target holds, then bisects between the last failing and the first holding size.
    """
    nodes = max(1, lower_bound)
    result = run(nodes)
    if result.p99_latency_s <= target_p99_s:
        return FleetSearch(nodes, result)
    failing = nodes
    holding: tuple[int, SimulationResult] | None = None
    while holding is None:
        if failing >= limit:
            return FleetSearch(None, result)
        nodes = min(limit, failing * 2)
        result = run(nodes)
        if result.p99_latency_s <= target_p99_s:
            holding = (nodes, result)
        else:
            failing = nodes
    while holding[0] - failing > 1:
        middle = (holding[0] + failing) // 2
        result = run(middle)
        if result.p99_latency_s <= target_p99_s:
            holding = (middle, result)
        else:
            failing = middle
    return FleetSearch(*holding)
