"""Everything the demo has seen so far, and the per-route figures the live view and report show.

Written only from the demo's event loop (no locks). Per route: requests sent and answered,
errors, p50/p99 end-to-end latency as the client saw it, the engines that answered and by which
rule, the fallback rate (answers the gateway re-ran on AR), field accuracy against the ground
truth and the mean cost per request from the gateway's ledger (`nowait.cost_usd`). The batch's
lines have no client-side latency of their own: their percentiles are None and the batch's wall
time is `BatchState.wall_s`. Per corpus tier (clean, hard), the real-time route against the same
tier's forms pinned to AR: accuracy, fallback rate, $ per request (the fallbacks' AR run
included: the ledger charges both) and the answers flagged below their engine's floor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from nowait.bench.load_metrics import RequestRecord, accuracy, percentile
from nowait.demo.gauges import Snapshot
from nowait.demo.plan import BATCH, COMPARISON, PAIRED, REALTIME, ROUTES


@dataclass
class BatchState:
    lines: int = 0
    batch_id: str | None = None
    status: str = "not submitted"
    completed: int = 0
    failed: int = 0
    submitted_s: float | None = None
    finished_s: float | None = None
    error: str | None = None

    @property
    def wall_s(self) -> float | None:
        if self.submitted_s is None or self.finished_s is None:
            return None
        return self.finished_s - self.submitted_s


@dataclass
class RouteStats:
    route: str
    sent: int
    answered: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    engines: dict[str, int]
    rules: dict[str, int]
    fallback_rate: float | None
    field_accuracy: float | None
    usd_per_request: float | None
    output_tokens: int

    @property
    def engine_text(self) -> str:
        return ", ".join(f"{name} {count}" if len(self.engines) > 1 else name for name, count in self.engines.items()) \
            or "-"


@dataclass
class TierStats:
    """One corpus tier of the real-time forms: routed, and the same tier's forms pinned to AR."""

    tier: str
    routed: RouteStats
    pinned: RouteStats
    low_confidence: int  # routed answers the gateway flagged below their engine's floor
    pinned_low_confidence: int

    def as_dict(self) -> dict:
        r, p = self.routed, self.pinned
        return {"forms": r.answered, "errors": r.errors, "routed_field_accuracy": r.field_accuracy,
                "ar_field_accuracy": p.field_accuracy, "ar_forms": p.answered, "fallback_rate": r.fallback_rate,
                "routed_usd_per_request": r.usd_per_request, "ar_usd_per_request": p.usd_per_request,
                "routed_p50_ms": r.p50_ms, "ar_p50_ms": p.p50_ms, "low_confidence_flags": self.low_confidence,
                "ar_low_confidence_flags": self.pinned_low_confidence}


@dataclass
class Scoreboard:
    started: bool = False
    records: dict[str, list[RequestRecord]] = field(default_factory=lambda: {r: [] for r in ROUTES})
    by_tier: dict[str, dict[str, list[RequestRecord]]] = field(default_factory=dict)  # route -> tier -> records
    sent: Counter = field(default_factory=Counter)
    batch: BatchState = field(default_factory=BatchState)
    snapshots: list[Snapshot] = field(default_factory=list)
    scrape_errors: int = 0
    elapsed_s: float = 0.0
    phase: str = "starting"

    def add(self, route: str, record: RequestRecord, tier: str = "clean") -> None:
        self.records[route].append(record)
        self.by_tier.setdefault(route, {}).setdefault(tier, []).append(record)

    def tier_stats(self) -> list[TierStats]:
        """Per tier of the real-time forms (clean first), once that tier has answers."""
        tiers = sorted(self.by_tier.get(REALTIME, {}))
        out = []
        for tier in tiers:
            routed = self.by_tier[REALTIME][tier]
            pinned = self.by_tier.get(COMPARISON, {}).get(tier, [])
            out.append(TierStats(tier, self.route_stats(REALTIME, routed), self.route_stats(COMPARISON, pinned),
                                 sum(r.ok and r.low_confidence for r in routed),
                                 sum(r.ok and r.low_confidence for r in pinned)))
        return out

    @property
    def latest(self) -> Snapshot | None:
        return self.snapshots[-1] if self.snapshots else None

    def fast_engines(self) -> set[str]:
        """Engines whose answers can fall back: the diffusion engines the gateway reports."""
        latest = self.latest
        return {name for name, g in latest.engines.items() if g.kind == "diffusion"} if latest else set()

    def route_stats(self, route: str, records: list[RequestRecord] | None = None) -> RouteStats:
        """The figures of a route (or of `records`, a subset of its records)."""
        subset = records is not None
        records = self.records[route] if records is None else records
        ok = [r for r in records if r.ok]
        latencies = [r.e2e_s * 1000 for r in ok]
        sent, answered, errors = len(records) if subset else self.sent[route], len(ok), len(records) - len(ok)
        if route == BATCH:
            # The lines have no latency of their own (the batch's wall time is `BatchState.wall_s`);
            # until the output file is read, the batch's own counts are all there is.
            latencies = []
            sent = self.batch.lines if self.batch.batch_id else 0
            if not records:
                answered, errors = self.batch.completed, self.batch.failed
        costs = [r.cost_usd for r in ok if r.cost_usd is not None]
        fast = self.fast_engines()
        first_fast = [r for r in ok if r.attempts and r.attempts[0].engine in fast]
        return RouteStats(
            route=route, sent=sent, answered=answered, errors=errors,
            p50_ms=percentile(latencies, 50), p99_ms=percentile(latencies, 99),
            engines=dict(Counter(r.engine or r.target for r in ok).most_common()),
            rules=dict(Counter(r.rule or "-" for r in ok).most_common()),
            fallback_rate=(sum(r.fallback for r in first_fast) / len(first_fast)) if first_fast else None,
            field_accuracy=(accuracy(r.score for r in ok) or {}).get("field_accuracy"),
            usd_per_request=(sum(costs) / len(costs)) if costs else None,
            output_tokens=sum(r.output_tokens for r in ok))

    def all_stats(self) -> list[RouteStats]:
        return [self.route_stats(route) for route in ROUTES]

    def errors(self) -> int:
        return sum(s.errors for s in self.all_stats())

    def output_tokens_per_s(self) -> float:
        tokens = sum(s.output_tokens for s in self.all_stats())
        return tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def comparison(self) -> dict | None:
        """The real-time route as served against the same forms pinned to AR (None until both
        have answers): the routed figures cover the forms that were also pinned (`PAIRED`), so
        both sides are the same documents. `fast_available`: a diffusion engine could serve;
        when it could not, both rows ran on AR and the comparison says so."""
        paired = [r for r in self.records[REALTIME] if r.label.endswith(PAIRED)]
        routed, pinned = self.route_stats(REALTIME, paired), self.route_stats(COMPARISON)
        if routed.p50_ms is None or pinned.p50_ms is None:
            return None
        latest = self.latest
        fast = {n for n, g in latest.engines.items() if g.kind == "diffusion" and g.available} if latest else set()
        first = Counter(r.attempts[0].engine for r in paired if r.ok and r.attempts)
        # The answers the fast engine kept (no re-run): what diffusion itself delivers, apart
        # from the fallbacks' AR time that the route's p50 also carries.
        kept = [r.e2e_s * 1000 for r in paired if r.ok and not r.fallback and r.attempts
                and r.attempts[0].engine in fast]
        return {"fast_available": bool(fast), "routed_to": first.most_common(1)[0][0] if first else None,
                "answered_by": routed.engine_text, "fallback_rate": routed.fallback_rate,
                "routed_p50_ms": routed.p50_ms, "kept_p50_ms": percentile(kept, 50),
                "ar_engine": pinned.engine_text, "ar_p50_ms": pinned.p50_ms,
                "speedup": pinned.p50_ms / routed.p50_ms if routed.p50_ms else None,
                "routed_usd_per_request": routed.usd_per_request, "ar_usd_per_request": pinned.usd_per_request,
                "forms": min(routed.answered, pinned.answered), "routed_field_accuracy": routed.field_accuracy,
                "ar_field_accuracy": pinned.field_accuracy}
