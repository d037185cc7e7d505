"""The dispatcher as tenants meet it: a key's model scope checked before routing, and every
answered request charged to its caller (tokens per minute, the tenant's spend of the day).

Admission (requests per minute, a spent budget) happens before a request is read (middleware.py)
or before a batch line runs (service.py); this layer sees each Call, so a route that reaches the
dispatcher directly is scoped and charged all the same. A request refused at admission never
becomes a Call, so `refused` writes its audit entry and counts it for its tenant: every decision
says who asked.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from nowait.gateway.dispatch import Dispatcher, Outcome, StreamPlan
from nowait.gateway.domain import Call
from nowait.gateway.errors import APIError, model_not_allowed
from nowait.gateway.limits import TenantLimits
from nowait.gateway.tenants import Caller
from nowait.router import Decision

# A refusal's audit entry names its endpoint as the dispatcher's entries do.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class TenantDispatcher(Dispatcher):
    def __init__(self, *args: Any, limits: TenantLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits

    def decide(self, call: Call) -> Decision:
        # Refused here, inside the dispatcher's own refusal path, so the audit log records it.
        allowed = call.caller.allowed_models
        if allowed is not None and call.model not in allowed:
            raise model_not_allowed(call.model, sorted(allowed))
        return super().decide(call)

    def refused(self, caller: Caller, endpoint: str, error: APIError, request_id: str | None = None) -> None:
        """A request refused before routing (over a rate limit, a spent budget): counted for its
        tenant and written to the audit log with its tenant and key id (never the secret), as
        the dispatcher records the requests it refuses. Its body was never read: no model."""
        self.metrics.observe_error(error.status, error.code)
        error.accounted = True
        self.metrics.observe_tenant(caller.tenant, error.status, 0, 0, 0.0)
        self.audit.record({
            "request_id": request_id or f"refused-{uuid.uuid4().hex[:24]}",
            "endpoint": ENDPOINTS.get(endpoint, endpoint), "model": None,
            "tenant": caller.tenant, "key_id": caller.key_id, "status": error.status, "code": error.code,
            "error": error.message, "route": None, "decision": "", "rule": "none",
            "reason": f"refused before routing: {error.code}", "fallback": False, "fallback_cause": None,
            "engines_tried": [], "prompt_tokens": 0, "completion_tokens": 0, "seconds": 0.0, "cost_usd": 0.0,
        })

    def charge(self, outcome: Outcome) -> None:
        self.limits.charge_outcomes(outcome.call.caller, [outcome])

    async def complete(self, call: Call) -> Outcome:
        outcome = await super().complete(call)
        self.charge(outcome)
        return outcome

    async def open_stream(self, call: Call) -> StreamPlan:
        plan = await super().open_stream(call)
        if plan.replay is not None:  # a held stream: answered before its first byte
            self.charge(plan.outcome)
            return plan
        return ChargedStream(plan, self.charge)  # type: ignore[return-value]


class ChargedStream:
    """A relayed stream whose Outcome is charged once its last delta is out."""

    def __init__(self, plan: StreamPlan, charge) -> None:
        self._plan, self._charge = plan, charge

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)

    async def deltas(self) -> AsyncIterator[str]:
        attempts = len(self._plan.outcome.attempts)
        async for text in self._plan.deltas():
            yield text
        if len(self._plan.outcome.attempts) > attempts:  # the stream's attempt was recorded: answered
            self._charge(self._plan.outcome)

    async def aclose(self) -> None:
        await self._plan.aclose()
