"""The live page's numbers (`GET /dashboard/data`), read from the gateway's own Prometheus registry
at the moment of asking, so the page and `/metrics` can never disagree: requests and latency
p50/p99 per route and per engine, fallback rate, utilization, $/Mtok, queue depth, errors by code.

Quantiles come from the histogram buckets, interpolated inside a bucket as Prometheus's
`histogram_quantile` does, so they match what Grafana draws from the same buckets.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

Labels = tuple[tuple[str, str], ...]


def samples(registry: CollectorRegistry) -> dict[str, dict[Labels, float]]:
    """Every sample the registry exposes: name -> labels -> value (the names /metrics prints)."""
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in registry.collect():
        for sample in family.samples:
            out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return out


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram given as (upper bound, cumulative count); None when empty."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: its bound is the best estimate (as Prometheus)
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return lower


def _by(values: dict[Labels, float], label: str) -> dict[str, float]:
    """Sum of the values per value of one label (the other labels summed over)."""
    out: dict[str, float] = defaultdict(float)
    for labels, value in values.items():
        out[dict(labels).get(label, "")] += value
    return dict(out)


def latency(found: dict[str, dict[Labels, float]], histogram: str, label: str) -> dict[str, dict[str, float | None]]:
    """Count, p50 and p99 of one histogram, per value of `label`."""
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for labels, value in found.get(f"{histogram}_bucket", {}).items():
        named = dict(labels)
        buckets[named.get(label, "")].append((float(named["le"]), value))
    counts = _by(found.get(f"{histogram}_count", {}), label)
    return {key: {"requests": counts.get(key, 0.0), "p50_s": histogram_quantile(0.5, series),
                  "p99_s": histogram_quantile(0.99, series)} for key, series in sorted(buckets.items())}


def _gauge(found: dict[str, dict[Labels, float]], name: str) -> dict[str, float | None]:
    """A per-engine gauge; NaN (no answer in the window yet) is None, which JSON can carry."""
    per_engine = _by(found.get(name, {}), "engine")
    return {engine: (None if math.isnan(value) else value) for engine, value in per_engine.items()}


def tenants(found: dict[str, dict[Labels, float]]) -> dict[str, dict[str, float]]:
    """Per tenant: requests (answered or refused by the router), those answered 200, tokens, dollars."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"requests": 0.0, "answered": 0.0, "prompt_tokens": 0.0,
                                                            "completion_tokens": 0.0, "cost_usd": 0.0})
    for labels, value in found.get("nowait:tenant_requests_total", {}).items():
        named = dict(labels)
        out[named["tenant"]]["requests"] += value
        if named.get("code") == "200":
            out[named["tenant"]]["answered"] += value
    for labels, value in found.get("nowait:tenant_tokens_total", {}).items():
        named = dict(labels)
        out[named["tenant"]][f"{named.get('kind', '')}_tokens"] += value
    for labels, value in found.get("nowait:tenant_cost_usd_total", {}).items():
        out[dict(labels)["tenant"]]["cost_usd"] += value
    return {tenant: dict(numbers) for tenant, numbers in sorted(out.items())}


def dashboard_numbers(registry: CollectorRegistry) -> dict:
    """What the live page shows, from the registry's current samples."""
    found = samples(registry)
    runs = _by(found.get("nowait:request_success_total", {}), "engine")
    engine_latency = latency(found, "nowait:e2e_request_latency_seconds", "engine")
    gauges = {key: _gauge(found, f"nowait:{name}") for key, name in (
        ("available", "engine_available"), ("running", "num_requests_running"), ("waiting", "num_requests_waiting"),
        ("utilization", "engine_utilization"), ("throughput_tokens_per_s", "engine_throughput_tokens_per_second"),
        ("usd_per_mtok", "effective_cost_usd_per_mtok"),
        ("usd_per_mtok_with_fallback", "effective_cost_with_fallback_usd_per_mtok"),
        ("fallback_rate", "fallback_rate"))}
    totals = {key: _by(found.get(f"nowait:{name}_total", {}), "engine") for key, name in (
        ("prompt_tokens", "prompt_tokens"), ("generation_tokens", "generation_tokens"), ("cost_usd", "cost_usd"))}
    engines = {}
    for engine in sorted(set(gauges["available"]) | set(runs)):
        timing = engine_latency.get(engine, {})
        engines[engine] = {"runs": runs.get(engine, 0.0), "p50_s": timing.get("p50_s"), "p99_s": timing.get("p99_s"),
                           **{key: values.get(engine) for key, values in gauges.items()},
                           **{key: values.get(engine, 0.0) for key, values in totals.items()}}
    routes = latency(found, "nowait:gateway_request_latency_seconds", "route")
    errors = [{"status": dict(labels).get("status", ""), "code": dict(labels).get("code", ""), "count": value}
              for labels, value in sorted(found.get("nowait:request_errors_total", {}).items())]
    fallbacks = [dict(labels) | {"count": value}
                 for labels, value in sorted(found.get("nowait:fallbacks_total", {}).items())]
    return {"time": time.time(), "engines": engines, "routes": routes, "errors": errors, "fallbacks": fallbacks,
            "tenants": tenants(found),
            "totals": {"requests": sum(r["requests"] for r in routes.values()),
                       "errors": sum(e["count"] for e in errors)}}
