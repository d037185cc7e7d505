"""Whole-run economics per engine, from the gateway's ledger (its audit log).

The live gauges cover the last metrics window; the summary covers the whole run. Per engine,
summing the ledger's attempts:

    busy seconds    the compute each answer held the engine (the ledger's `compute_s`: each
                    step's time split among the sequences in it), summed
    throughput      output tokens / busy seconds (what the engine does while it works)
    utilization     busy seconds / the run's wall time (the node is paid for all of it)
    $/Mtok          node $/h / (throughput x utilization)   (planner.cost.cost_per_mtok)

so an engine that sat mostly idle shows the high cost per token the routing rule is about.
"""

from __future__ import annotations

from dataclasses import dataclass

from nowait.planner.cost import cost_per_mtok


@dataclass(frozen=True)
class EngineTotals:
    engine: str
    answers: int
    busy_s: float
    output_tokens: int
    spent_usd: float  # the ledger's charge: busy share x node price
    node_usd_per_hour: float | None
    wall_s: float

    @property
    def tokens_per_busy_s(self) -> float | None:
        return self.output_tokens / self.busy_s if self.busy_s > 0 else None

    @property
    def utilization(self) -> float:
        return min(1.0, self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def usd_per_mtok(self) -> float | None:
        """The cost identity over the run; None without a node price or without output."""
        throughput = self.tokens_per_busy_s
        if self.node_usd_per_hour is None or not throughput or not self.utilization:
            return None
        return cost_per_mtok(self.node_usd_per_hour, throughput, self.utilization)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "answers": self.answers, "busy_s": round(self.busy_s, 4),
                "output_tokens": self.output_tokens, "spent_usd": self.spent_usd,
                "node_usd_per_hour": self.node_usd_per_hour, "wall_s": round(self.wall_s, 3),
                "tokens_per_busy_s": self.tokens_per_busy_s, "utilization": self.utilization,
                "usd_per_mtok": self.usd_per_mtok}


def engine_totals(audit: list[dict], prices: dict[str, float], wall_s: float) -> list[EngineTotals]:
    """One row per engine that ran at least one attempt, in order of output tokens."""
    sums: dict[str, list[float]] = {}
    for entry in audit:
        for attempt in entry.get("engines_tried") or []:
            if attempt.get("outcome") not in ("stop", "length"):
                continue
            row = sums.setdefault(attempt["engine"], [0, 0.0, 0, 0.0])
            row[0] += 1
            row[1] += float(attempt.get("compute_s") or 0.0)
            row[2] += int(attempt.get("completion_tokens") or 0)
            row[3] += float(attempt.get("cost_usd") or 0.0)
    totals = [EngineTotals(engine, int(n), busy, int(tokens), spent, prices.get(engine), wall_s)
              for engine, (n, busy, tokens, spent) in sums.items()]
    return sorted(totals, key=lambda t: -t.output_tokens)
