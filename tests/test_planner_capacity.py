"""The discrete-event simulator against queueing closed forms and hand-traced schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from nowait.planner.capacity import (
    Request,
    SimulationResult,
    erlang_c,
    make_requests,
    mmc_mean_wait,
    poisson_arrivals,
    simulate,
    smallest_fleet,
)


@dataclass(frozen=True)
class FixedSteps:
    """A serving model whose every step takes `step_s`, whatever the batch: a clean queueing server."""

    step_s: float = 1.0
    max_batch: int = 1
    kv_token_budget: float = math.inf
    name: str = "fixed"

    @property
    def tokens_per_step(self) -> float:
        return 1.0

    def prefill_seconds(self, prompt_tokens: float, prompts: int) -> float:
        return 0.0

    def step_seconds(self, batch: int, mean_context: float, mean_remaining: float) -> float:
        return self.step_s

    def kv_tokens(self, input_tokens: float, output_tokens: float) -> float:
        return input_tokens + output_tokens


def exponential_work(rate: float, count: int, seed: int, mean_tokens: float = 1000.0) -> tuple[list[Request], float]:
    """Poisson arrivals with exponential work; returns the requests and the step length giving a 1 s mean service.

    A request of L tokens takes ceil(L) steps; E[ceil(L)] = 1 / (1 - exp(-1/m)) for an exponential of mean m,
    a geometric service time whose shape is exponential's to within 1/m.
    """
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rate, count, rng)
    tokens = rng.exponential(mean_tokens, count)
    mean_steps = 1.0 / (1.0 - math.exp(-1.0 / mean_tokens))
    return make_requests(arrivals, np.zeros(count), tokens), 1.0 / mean_steps


def test_erlang_c_hand_cases():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # (1/2 * 2) / (1 + 1 + 1)
    assert mmc_mean_wait(0.5, 1.0, 1) == pytest.approx(1.0)  # rho / (mu - lambda)
    assert mmc_mean_wait(2.0, 1.0, 2) == math.inf


def test_mm1_mean_wait_matches_the_closed_form():
    requests, step = exponential_work(rate=0.5, count=150_000, seed=1)
    result = simulate(FixedSteps(step_s=step), replicas=1, requests=requests, warmup_fraction=0.05)
    assert result.mean_wait_s == pytest.approx(mmc_mean_wait(0.5, 1.0, 1), rel=0.05)
    assert result.busy_fraction == pytest.approx(0.5, abs=0.01)


def test_mmc_mean_wait_matches_erlang_c():
    requests, step = exponential_work(rate=1.2, count=150_000, seed=2)
    result = simulate(FixedSteps(step_s=step), replicas=2, requests=requests, warmup_fraction=0.05)
    assert result.mean_wait_s == pytest.approx(mmc_mean_wait(1.2, 1.0, 2), rel=0.05)
    assert result.busy_fraction == pytest.approx(0.6, abs=0.01)


def test_continuous_batching_shares_steps_and_admits_at_the_next_boundary():
    together = [Request(0.0, 0, 10), Request(0.0, 0, 10), Request(0.0, 0, 10)]
    # The first starts a step at once; the other two join at that step's end and ride with it from then on.
    assert simulate(FixedSteps(max_batch=4), 1, together, 0.0).mean_latency_s == pytest.approx((10 + 11 + 11) / 3)
    one_at_a_time = simulate(FixedSteps(max_batch=1), 1, together, 0.0)
    assert one_at_a_time.mean_latency_s == pytest.approx((10 + 20 + 30) / 3)
    # B arrives at 2.5 s while A runs: it joins at the step boundary at 3 s and is done 2 steps later.
    late_joiner = [Request(0.0, 0, 10), Request(2.5, 0, 2)]
    result = simulate(FixedSteps(max_batch=4), 1, late_joiner, 0.0)
    assert result.mean_latency_s == pytest.approx((10 + (5 - 2.5)) / 2)
    assert result.mean_wait_s == pytest.approx((0 + 0.5) / 2)


def test_the_kv_budget_holds_a_request_back_until_another_retires():
    requests = [Request(0.0, 0, 10), Request(0.0, 0, 10)]
    result = simulate(FixedSteps(max_batch=4, kv_token_budget=15), 1, requests, 0.0)
    assert result.mean_latency_s == pytest.approx((10 + 20) / 2)


def test_idle_replicas_take_arrivals_first():
    requests = [Request(0.0, 0, 10), Request(1.0, 0, 10)]
    assert simulate(FixedSteps(max_batch=4), 2, requests, 0.0).mean_wait_s == 0


def test_a_run_shorter_than_a_few_lifetimes_is_not_steady_and_a_longer_one_is():
    """Requests living 50 s, arriving one a second: 200 arrivals never see a full fleet's steady
    state (the warm-up and cool-down windows, three lifetimes each, cover the whole span); 4,000 do."""
    server = FixedSteps(step_s=1.0, max_batch=1)
    short = simulate(server, 60, make_requests(np.arange(200.0), np.zeros(200), np.full(200, 50.0)), 0.1)
    long = simulate(server, 60, make_requests(np.arange(4000.0), np.zeros(4000), np.full(4000, 50.0)), 0.1)
    assert not short.steady and short.measured == 0
    assert long.steady and long.measured == pytest.approx(4000 - 400 - 150, abs=2)
    assert long.p99_latency_s == pytest.approx(50.0)


def fake_result(p99: float) -> SimulationResult:
    return SimulationResult(replicas=1, completed=1, p50_latency_s=p99, p99_latency_s=p99, mean_latency_s=p99,
                            mean_wait_s=0.0, busy_fraction=0.5, output_tokens_per_s=1.0)


def test_smallest_fleet_doubles_then_bisects():
    tried = []

    def run(nodes):
        tried.append(nodes)
        return fake_result(10.0 / nodes)

    found = smallest_fleet(run, target_p99_s=1.0, lower_bound=1, limit=100)
    assert found.nodes == 10
    assert tried[:5] == [1, 2, 4, 8, 16]
    assert smallest_fleet(run, 1.0, lower_bound=12, limit=100).nodes == 12  # the throughput bound already holds
    assert smallest_fleet(lambda n: fake_result(5.0), 1.0, lower_bound=1, limit=64).nodes is None
