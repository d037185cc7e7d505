"""What each request cost, and the audit log of every routing decision.

Costs (docs/planner.md, "Cost"): an owned engine is paid by the hour, so a request costs the
compute seconds it held the engine times the node's price per second, where a step shared by B
sequences charges each of them 1/B of the step (engines.py splits it); a remote engine charges
per token. The audit log is JSONL, one object per request, appended and flushed as each request
ends: decision, reason, engines tried, tokens, time, cost, so `jq` answers "why did this go there".
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from nowait.planner.cost import SECONDS_PER_HOUR

TOKENS_PER_MTOK = 1e6


def owned_cost_usd(compute_s: float, node_usd_per_hour: float) -> float:
    """An owned engine's share of its node's hourly price for `compute_s` busy seconds."""
    return compute_s * node_usd_per_hour / SECONDS_PER_HOUR


def remote_cost_usd(prompt_tokens: int, completion_tokens: int, input_usd_per_mtok: float,
                    output_usd_per_mtok: float) -> float:
    """An API's bill for one request: tokens times the price per million, input and output apart."""
    return (prompt_tokens * input_usd_per_mtok + completion_tokens * output_usd_per_mtok) / TOKENS_PER_MTOK


class AuditLog:
    """Append-only JSONL file of decisions; safe to call from any thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def record(self, entry: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 3), **entry}, ensure_ascii=False, default=str)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_audit_log(path: str | Path) -> list[dict[str, Any]]:
    """Every entry of an audit log (tests and `jq`-less inspection)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
