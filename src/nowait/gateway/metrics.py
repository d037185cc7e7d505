"""Prometheus metrics, named as vLLM names them with a `nowait:` prefix, plus the live economics.

Latency histograms (TTFT, inter-token, end to end, queue) and token counters are per engine, as
vLLM's are per model. The gauges that make the mission's argument visible are computed at each
scrape from a sliding window (`metrics_window_s`):

    utilization                 = busy seconds / window
    throughput                  = output tokens / busy second
    effective $/Mtok (owned)    = node $/h / (throughput x utilization)    (planner.cost.cost_per_mtok)
    effective $/Mtok (remote)   = spend / output tokens
    with fallback (fast engine) = own + fallback rate x fallback engine's  (planner.cost.with_fallback)

so an idle owned engine shows its cost per token rising, which is what the routing rule is about.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nowait.planner.cost import with_fallback

if TYPE_CHECKING:
    from nowait.gateway.domain import Attempt, Backend
    from nowait.router import RoutingPolicy

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class GatewayMetrics:
    """The gateway's registry (one per app, so several apps in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        engine = ["engine"]
        self.ttft = Histogram("nowait:time_to_first_token_seconds", "Time to first token", engine,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("nowait:inter_token_latency_seconds", "Time between output tokens", engine,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("nowait:e2e_request_latency_seconds", "Engine time of a request, submission to answer",
                             engine, buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("nowait:request_queue_time_seconds", "Time waiting before the engine started it",
                                    engine, buckets=E2E_BUCKETS, registry=r)
        self.gateway_e2e = Histogram("nowait:gateway_request_latency_seconds",
                                     "Whole request at the gateway, fallback included", ["route"],
                                     buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("nowait:prompt_tokens", "Prompt tokens processed", engine, registry=r)
        self.generation_tokens = Counter("nowait:generation_tokens", "Output tokens generated", engine, registry=r)
        self.prefix_cache_hits = Counter("nowait:prefix_cache_hits", "Prompt tokens served from the prefix cache "
                                         "instead of computed", engine, registry=r)
        self.request_success = Counter("nowait:request_success", "Engine runs finished", [*engine, "finished_reason"],
                                       registry=r)
        self.routed = Counter("nowait:routed_requests", "Requests by routing rule and first engine",
                              ["rule", "engine"], registry=r)
        self.fallbacks = Counter("nowait:fallbacks", "Requests re-run on another engine", ["engine", "to", "cause"],
                                 registry=r)
        self.low_confidence = Counter("nowait:low_confidence", "Answers below their engine's confidence floor, by "
                                      "that engine and what routing.low_confidence did (flag, frontier, reject)",
                                      ["engine", "action"], registry=r)
        self.errors = Counter("nowait:request_errors", "Requests answered with an error", ["status", "code"],
                              registry=r)
        self.cost = Counter("nowait:cost_usd", "Dollars spent, per engine", engine, registry=r)
        self.tenant_requests = Counter("nowait:tenant_requests", "Requests that reached the router, by tenant and "
                                       "HTTP status", ["tenant", "code"], registry=r)
        self.tenant_tokens = Counter("nowait:tenant_tokens", "Tokens of every engine run, by tenant (kind: prompt "
                                     "or completion)", ["tenant", "kind"], registry=r)
        self.tenant_cost = Counter("nowait:tenant_cost_usd", "Dollars spent, by tenant", ["tenant"], registry=r)
        self.running = Gauge("nowait:num_requests_running", "Requests being decoded", engine, registry=r)
        self.waiting = Gauge("nowait:num_requests_waiting", "Requests queued for an engine", engine, registry=r)
        self.utilization = Gauge("nowait:engine_utilization", "Busy share of the window", engine, registry=r)
        self.throughput = Gauge("nowait:engine_throughput_tokens_per_second", "Output tokens per busy second",
                                engine, registry=r)
        self.effective_cost = Gauge("nowait:effective_cost_usd_per_mtok",
                                    "Live cost per million output tokens: node $/h / (throughput x utilization)",
                                    engine, registry=r)
        self.effective_cost_with_fallback = Gauge(
            "nowait:effective_cost_with_fallback_usd_per_mtok",
            "Fast engine's cost per million tokens with its fallback's share folded in", engine, registry=r)
        self.fallback_rate = Gauge("nowait:fallback_rate", "Share of this engine's answers re-run elsewhere", engine,
                                   registry=r)
        self.available = Gauge("nowait:engine_available", "1 when the engine can serve", engine, registry=r)
        self.replica_retries = Counter("nowait:replica_retries", "Requests retried on another replica after theirs "
                                       "was lost (a fleet's engines)", engine, registry=r)
        self._retries_seen: dict[str, int] = {}
        # A fleet's engines, per replica (the ids Ray Serve gives them): what each answered here.
        replica = [*engine, "replica"]
        self.replica_requests = Counter("nowait:replica_requests", "Requests a fleet engine's replica answered",
                                        replica, registry=r)
        self.replica_tokens = Counter("nowait:replica_generation_tokens", "Output tokens of a fleet engine's replica",
                                      replica, registry=r)
        self.replica_busy = Counter("nowait:replica_busy_seconds", "Engine seconds a fleet engine's replica spent on "
                                    "the requests it answered (its share of each step)", replica, registry=r)
        self.replica_cost = Counter("nowait:replica_cost_usd", "Dollars of a fleet engine's replica's answers",
                                    replica, registry=r)
        self.replica_running = Gauge("nowait:replica_num_requests_running", "Requests a fleet engine's replica is "
                                     "decoding", replica, registry=r)
        self.replica_waiting = Gauge("nowait:replica_num_requests_waiting", "Requests queued on a fleet engine's "
                                     "replica", replica, registry=r)
        self._replica_seen: dict[tuple[str, str], tuple[float, ...]] = {}
        self._lock = threading.Lock()
        self._answers: dict[str, int] = {}
        self._fell_back: dict[str, int] = {}

    def observe_attempt(self, attempt: Attempt) -> None:
        e = attempt.engine
        if attempt.prompt_tokens:
            self.prompt_tokens.labels(e).inc(attempt.prompt_tokens)
        if attempt.completion_tokens:
            self.generation_tokens.labels(e).inc(attempt.completion_tokens)
        if attempt.cached_prompt_tokens:
            self.prefix_cache_hits.labels(e).inc(attempt.cached_prompt_tokens)
        self.cost.labels(e).inc(attempt.cost_usd)
        self.request_success.labels(e, attempt.outcome).inc()
        if attempt.outcome not in ("stop", "length"):
            return
        self.e2e.labels(e).observe(attempt.seconds)
        self.queue_time.labels(e).observe(attempt.queued_s)
        if attempt.first_token_s is not None:
            self.ttft.labels(e).observe(attempt.first_token_s)
            if attempt.completion_tokens > 1:
                self.itl.labels(e).observe((attempt.seconds - attempt.first_token_s) / (attempt.completion_tokens - 1))

    def observe_decision(self, rule: str, engine: str, fast_engine_ran: str | None, fell_back_to: str | None,
                         cause: str) -> None:
        """One answered request: its rule, and for a fast-engine answer whether it was re-run."""
        self.routed.labels(rule, engine).inc()
        if fast_engine_ran is not None:
            with self._lock:
                self._answers[fast_engine_ran] = self._answers.get(fast_engine_ran, 0) + 1
                if fell_back_to is not None:
                    self._fell_back[fast_engine_ran] = self._fell_back.get(fast_engine_ran, 0) + 1
        if fell_back_to is not None:
            self.fallbacks.labels(fast_engine_ran or engine, fell_back_to, cause).inc()

    def observe_tenant(self, tenant: str, status: int, prompt_tokens: int, completion_tokens: int,
                       cost_usd: float) -> None:
        """One request of `tenant` ended (answered or not): what it used, as its audit entry says."""
        self.tenant_requests.labels(tenant, str(status)).inc()
        self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant, "completion").inc(completion_tokens)
        self.tenant_cost.labels(tenant).inc(cost_usd)

    def observe_error(self, status: int, code: str | None) -> None:
        self.errors.labels(str(status), code or "").inc()

    def fallback_share(self, engine: str) -> float:
        with self._lock:
            answers = self._answers.get(engine, 0)
            return self._fell_back.get(engine, 0) / answers if answers else 0.0

    def refresh(self, backends: Iterable[Backend], policy: RoutingPolicy) -> None:
        """Set the gauges from the engines' current state (called at each scrape)."""
        costs = {}
        for backend in backends:
            name = backend.name
            self.available.labels(name).set(1.0 if backend.available else 0.0)
            self._count_replica_retries(backend)
            self._count_replicas(backend)
            if not backend.available:
                continue
            self.running.labels(name).set(backend.running())
            self.waiting.labels(name).set(backend.waiting())
            self.utilization.labels(name).set(backend.stats.utilization())
            self.throughput.labels(name).set(backend.stats.throughput())
            costs[name] = backend.stats.effective_usd_per_mtok()
            self.effective_cost.labels(name).set(costs[name])
        fast = policy.fast_engine
        if fast is not None and fast in costs:
            rate = self.fallback_share(fast)
            self.fallback_rate.labels(fast).set(rate)
            fallback_cost = costs.get(policy.fallback_engine, math.nan)
            own = costs[fast]
            folded = own if rate == 0 else with_fallback(own, rate, fallback_cost)
            self.effective_cost_with_fallback.labels(fast).set(folded)

    def _count_replica_retries(self, backend: Backend) -> None:
        """A fleet backend counts its retries itself (it knows nothing of this registry); the
        counter takes what it added since the last scrape."""
        retries = getattr(backend, "replica_retries", None)
        if retries is None:
            return
        added = retries - self._retries_seen.get(backend.name, 0)
        if added > 0:
            self.replica_retries.labels(backend.name).inc(added)
            self._retries_seen[backend.name] = retries
        elif backend.name not in self._retries_seen:
            self.replica_retries.labels(backend.name)  # shown at 0 from the first scrape
            self._retries_seen[backend.name] = 0

    def _count_replicas(self, backend: Backend) -> None:
        """A fleet backend's replicas, each by its own totals since it started (the same whichever
        gateway replica is scraped): counters take what was added since the last scrape."""
        for replica, totals in dict(getattr(backend, "replica_totals", {})).items():
            labels = (backend.name, replica)
            now = tuple(float(totals.get(k, 0)) for k in ("requests", "generation_tokens", "busy_seconds", "cost_usd"))
            seen = self._replica_seen.get(labels, (0.0,) * len(now))
            counters = (self.replica_requests, self.replica_tokens, self.replica_busy, self.replica_cost)
            for counter, n, s in zip(counters, now, seen, strict=True):
                counter.labels(*labels).inc(max(0.0, n - s))
            self._replica_seen[labels] = tuple(max(n, s) for n, s in zip(now, seen, strict=True))
            self.replica_running.labels(*labels).set(totals.get("running", 0))
            self.replica_waiting.labels(*labels).set(totals.get("waiting", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
