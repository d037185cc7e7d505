"""Today's spend per tenant, read back from the end of the audit log when the server starts, so
that a restart does not hand every tenant a fresh daily budget.

The audit log is read last entry first and only as far back as 00:00 UTC (entries are written in
the order requests end), so a long log costs no more than its last day. What is counted matches
what limits.py charges while serving: the cost of each answered request (status 200), by the
tenant its entry names (an entry from before tenants counts for `default`).
"""

from __future__ import annotations

from pathlib import Path

from nowait.gateway.audit.log import lines_from_end, parse_entry
from nowait.gateway.tenants import DEFAULT_TENANT

DAY_S = 86_400


def start_of_utc_day(moment: float) -> float:
    return moment - moment % DAY_S


def spent_since(path: str | Path, since: float) -> dict[str, float]:
    """USD per tenant of the answered requests the audit log records at or after `since`."""
    path = Path(path)
    spent: dict[str, float] = {}
    if not path.exists():
        return spent
    with path.open("rb") as handle:
        for line in lines_from_end(handle):
            entry = parse_entry(line) if line.strip() else None
            if entry is None:
                continue
            moment = entry.get("time")
            if not isinstance(moment, int | float):
                continue
            if moment < since:
                break
            cost = entry.get("cost_usd")
            if entry.get("status") == 200 and isinstance(cost, int | float):
                tenant = entry.get("tenant") or DEFAULT_TENANT
                spent[tenant] = spent.get(tenant, 0.0) + cost
    return spent
