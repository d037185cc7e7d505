"""What the gateway says about its engines, read over HTTP as any operator's dashboard would.

`GET /readyz` gives each engine's kind and availability (and why not); `GET /metrics` gives the
live economics per engine (docs/gateway.md, "Metrics"): utilization and throughput over the
metrics window, the effective cost per million output tokens by the cost identity, the fast
engine's fallback rate and its cost with the fallback folded in, and cumulative output tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Prometheus sample name -> EngineGauges field.
SAMPLES = {
    "nowait:engine_utilization": "utilization",
    "nowait:engine_throughput_tokens_per_second": "tokens_per_s",
    "nowait:effective_cost_usd_per_mtok": "usd_per_mtok",
    "nowait:effective_cost_with_fallback_usd_per_mtok": "usd_per_mtok_with_fallback",
    "nowait:fallback_rate": "fallback_rate",
    "nowait:num_requests_running": "running",
    "nowait:num_requests_waiting": "waiting",
    "nowait:generation_tokens_total": "output_tokens",
    "nowait:cost_usd_total": "spent_usd",
}


@dataclass
class EngineGauges:
    """One engine at one scrape; None where the gateway has not set a value (yet)."""

    name: str
    kind: str = ""
    available: bool = True
    reason: str | None = None
    utilization: float | None = None
    tokens_per_s: float | None = None  # output tokens per busy second
    usd_per_mtok: float | None = None
    usd_per_mtok_with_fallback: float | None = None
    fallback_rate: float | None = None
    running: float | None = None
    waiting: float | None = None
    output_tokens: float | None = None
    spent_usd: float | None = None


@dataclass
class Snapshot:
    at_s: float
    engines: dict[str, EngineGauges] = field(default_factory=dict)
    routing: dict = field(default_factory=dict)  # /readyz's: the fallback threshold and its source


def parse_metrics(text: str, engines: dict[str, EngineGauges]) -> None:
    """Fill `engines` from a Prometheus exposition (NaN gauges stay None: nothing produced yet)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            target = SAMPLES.get(sample.name)
            engine = sample.labels.get("engine")
            if target is None or engine is None:
                continue
            gauges = engines.setdefault(engine, EngineGauges(engine))
            value = float(sample.value)
            setattr(gauges, target, None if math.isnan(value) else value)


async def scrape(client: httpx.AsyncClient, root_url: str, at_s: float) -> Snapshot:
    """One look at the gateway: availability from /readyz, the economics from /metrics."""
    snapshot = Snapshot(at_s)
    ready = await client.get(f"{root_url}/readyz", timeout=10.0)
    snapshot.routing = ready.json().get("routing") or {}
    for name, engine in (ready.json().get("engines") or {}).items():
        snapshot.engines[name] = EngineGauges(name, kind=engine.get("kind", ""), available=bool(engine["available"]),
                                              reason=engine.get("reason"))
    metrics = await client.get(f"{root_url}/metrics", timeout=10.0)
    metrics.raise_for_status()
    parse_metrics(metrics.text, snapshot.engines)
    return snapshot
