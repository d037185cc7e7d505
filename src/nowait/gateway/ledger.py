"""What each request cost, and the audit log of every routing decision.

Costs (docs/planner.md, "Cost"): an owned engine is paid by the hour, so a request costs the
compute seconds it held the engine times the node's price per second, where a step shared by B
sequences charges each of them 1/B of the step (engines.py splits it); a remote engine charges
per token. The audit log (gateway/audit/: one hash-chained JSONL entry per request, appended and
flushed as each request ends: decision, reason, engines tried, tokens, time, cost, tenant) is
re-exported here for the modules that record and read it.
"""

from __future__ import annotations

from nowait.gateway.audit.log import AuditLog, read_audit_log
from nowait.planner.cost import SECONDS_PER_HOUR

__all__ = ["AuditLog", "owned_cost_usd", "read_audit_log", "remote_cost_usd"]

TOKENS_PER_MTOK = 1e6


def owned_cost_usd(compute_s: float, node_usd_per_hour: float) -> float:
    """An owned engine's share of its node's hourly price for `compute_s` busy seconds."""
    return compute_s * node_usd_per_hour / SECONDS_PER_HOUR


def remote_cost_usd(prompt_tokens: int, completion_tokens: int, input_usd_per_mtok: float,
                    output_usd_per_mtok: float) -> float:
    """An API's bill for one request: tokens times the price per million, input and output apart."""
    return (prompt_tokens * input_usd_per_mtok + completion_tokens * output_usd_per_mtok) / TOKENS_PER_MTOK
