"""A run of two tenants through a real Dispatcher with priced stand-in engines, so every dollar
and token of it is known (the audit and tenant-metrics tests)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nowait.gateway.audit import AuditLog
from nowait.gateway.dispatch import Dispatcher
from nowait.gateway.domain import Attempt, Call, Metadata
from nowait.gateway.errors import APIError
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.tenants import Caller
from nowait.router import DataClass, RoutingPolicy


class PricedBackend:
    """Answers with fixed tokens and cost (or fails), so every dollar of the run is known."""

    owned, available, unavailable_reason, stats, admits = True, True, "", None, 8

    def __init__(self, name: str, cost_usd: float, confidence: float | None = None, fails: bool = False) -> None:
        self.name, self.kind, self.cost_usd, self.confidence, self.fails = name, name, cost_usd, confidence, fails

    def may_receive(self, data_class) -> bool:
        return True

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        if self.fails:
            raise APIError(504, "simulated timeout", type="timeout_error", code="timeout")
        tokens = len(call.messages[0]["content"])
        return Attempt(engine=self.name, text="{}", confidence=self.confidence, prompt_tokens=tokens,
                       completion_tokens=3, cost_usd=self.cost_usd * tokens)


def two_tenant_run(path: Path, metrics: GatewayMetrics | None = None) -> dict[str, list]:
    """Requests of team-a and team-b through a real Dispatcher: answered by ar, by diffusion after
    a fallback to ar (both paid), and a timeout (its time unpaid, its failure counted)."""
    meta = Metadata(latency_budget_ms=None, token_value_usd_per_mtok=0.0, data_class=DataClass.internal,
                    batchable=False)
    engines = {"ar": PricedBackend("ar", 0.01), "diffusion": PricedBackend("diffusion", 0.002, confidence=0.1),
               "slow": PricedBackend("slow", 0.0, fails=True)}
    policy = RoutingPolicy(confidence_threshold=0.9, fallback_engine="ar")
    audit = AuditLog(path)
    dispatcher = Dispatcher(engines, policy, "nowait", metrics or GatewayMetrics(), audit, timeout_s=5)
    costs: dict[str, list] = {"team-a": [], "team-b": []}
    plan = [("team-a", "ar", "Name: Ann"), ("team-b", "diffusion", "Name: Bob Stone"), ("team-a", "diffusion", "x"),
            ("team-b", "ar", "Amount: 12"), ("team-b", "slow", "late")]
    for number, (tenant, model, text) in enumerate(plan):
        call = Call(f"req-{number}", "chat", model, meta, messages=[{"role": "user", "content": text}],
                    caller=Caller(tenant=tenant, key_id=f"key-{tenant}"))
        try:
            outcome = asyncio.run(dispatcher.complete(call))
            costs[tenant].append(outcome.cost_usd)
        except APIError:
            costs[tenant].append(0.0)
    audit.close()
    return costs
