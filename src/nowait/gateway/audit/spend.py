"""`nowait audit spend`: what each tenant (or engine) spent, summed from the audit log.

Each entry's `cost_usd` is what the request cost (every engine it ran on: a fallback pays both
runs) and `engines_tried` lists those runs with their own cost and tokens. By tenant, a row sums
its requests' entries; by engine, the runs on each engine. Tokens are those of every run, as the
cost is, so the two views have the same totals.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

DEFAULT_TENANT = "default"  # what an entry written without a tenant (before tenants) is counted as
Grouping = Literal["tenant", "engine"]
FAILED_RUN_CAUSES = {"engine_failure", "upstream_failure", "schema_unsupported"}  # dispatch.py's _note_failure


@dataclass
class SpendRow:
    requests: int = 0  # by engine: the runs on it
    errors: int = 0  # answered with an error status
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, status: int, prompt_tokens: int, completion_tokens: int, cost_usd: float) -> None:
        self.requests += 1
        self.errors += status != 200
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cost_usd += cost_usd


def since_timestamp(text: str) -> float:
    """An ISO 8601 date or time as a Unix time (a time without a zone is UTC)."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def spend(entries: Iterable[dict[str, Any]], by: Grouping = "tenant", since: float | None = None
          ) -> dict[str, SpendRow]:
    """Rows by tenant or engine, largest cost first, for the entries at or after `since`."""
    rows: dict[str, SpendRow] = {}
    for entry in entries:
        if since is not None and entry.get("time", 0) < since:
            continue
        status = entry.get("status", 200)
        runs = [run for run in entry.get("engines_tried", []) if isinstance(run, dict)]
        if by == "tenant":
            rows.setdefault(entry.get("tenant") or DEFAULT_TENANT, SpendRow()).add(
                status, sum(r.get("prompt_tokens", 0) for r in runs), sum(r.get("completion_tokens", 0) for r in runs),
                entry.get("cost_usd", 0.0))
            continue
        for number, run in enumerate(runs, 1):
            # The last run ends as the request does; an earlier one failed only when it is why
            # the request moved on (a low-confidence answer is an answer).
            failed = status != 200 if number == len(runs) else entry.get("fallback_cause") in FAILED_RUN_CAUSES
            rows.setdefault(run.get("engine", "?"), SpendRow()).add(
                500 if failed else 200, run.get("prompt_tokens", 0), run.get("completion_tokens", 0),
                run.get("cost_usd", 0.0))
    return dict(sorted(rows.items(), key=lambda item: (-item[1].cost_usd, item[0])))


def total(rows: dict[str, SpendRow]) -> SpendRow:
    whole = SpendRow()
    for row in rows.values():
        whole.requests += row.requests
        whole.errors += row.errors
        whole.prompt_tokens += row.prompt_tokens
        whole.completion_tokens += row.completion_tokens
        whole.cost_usd += row.cost_usd
    return whole


def spend_json(rows: dict[str, SpendRow], by: Grouping, since: float | None) -> dict[str, Any]:
    return {"by": by, "since": since, "rows": {name: asdict(row) for name, row in rows.items()},
            "total": asdict(total(rows))}
