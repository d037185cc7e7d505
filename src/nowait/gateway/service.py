"""What a running server holds (`Gateway`): config, engines, dispatcher, metrics, ledger, the batch
store and its runner, the key store and the tenants' limits; and the one path a batch line takes
through them (`Gateway.execute`, as the key that created its batch).

The app (app.py) builds one in its lifespan and keeps it in `app.state`; the route handlers
(routes/) reach it with `gateway_of(request)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from pydantic import ValidationError

from nowait.gateway.auth import Authenticator, unauthorized
from nowait.gateway.batches import DEFAULT_OWNER, BatchOwner, BatchRunner
from nowait.gateway.calls import chat_calls, completion_calls, prompts_of
from nowait.gateway.config import GatewayConfig
from nowait.gateway.dispatch import Outcome
from nowait.gateway.domain import Backend, Call
from nowait.gateway.errors import APIError, bad_request
from nowait.gateway.limits import TenantLimits
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.responses import chat_completion, text_completion
from nowait.gateway.schemas import ChatCompletionRequest, CompletionRequest
from nowait.gateway.spend_restore import start_of_utc_day
from nowait.gateway.stores import open_stores
from nowait.gateway.tenant_dispatch import TenantDispatcher
from nowait.gateway.tenants import CURRENT_CALLER, Caller
from nowait.router import restrict_to_available

log = logging.getLogger("nowait.gateway")


class Gateway:
    """Everything a running server holds: config, engines, dispatcher, metrics, ledger, batches."""

    def __init__(self, config: GatewayConfig, backends: dict[str, Backend]) -> None:
        self.config = config
        self.backends = backends
        available = {name for name, backend in backends.items() if backend.available}
        self.policy = restrict_to_available(config.routing_policy(), available)
        # Where the fallback threshold came from (config, calibration file, default), read once.
        self.threshold_source = config.confidence_threshold()[1]
        if config.routing.fast_engine and self.policy.fast_engine is None:
            log.warning("fast engine %r is not available: latency-bound requests go to %r",
                        config.routing.fast_engine, self.policy.batch_engine)
        self.metrics = GatewayMetrics()
        self.stores = open_stores(config)
        self.audit = self.stores.audit
        self.limits = TenantLimits()
        self.dispatcher = TenantDispatcher(backends, self.policy, config.server.router_model, self.metrics,
                                           self.audit, config.server.request_timeout_s, limits=self.limits)
        self.store = self.stores.batches
        self.runner = BatchRunner(self.store, self.execute, config.batches.max_concurrent_lines,
                                  replica=config.replica_name, lease_s=config.store.lease_s)
        self.keys = self.stores.keys
        self.authenticator = Authenticator(config.auth.keys(), config.auth.admin(), self.keys)

    def use_clock(self, clock: Callable[[], float]) -> None:
        """One clock for key expiry, rate windows and budget days (tests move time with it)."""
        self.limits.clock = self.authenticator.clock = self.keys.clock = clock

    async def start(self) -> None:
        # Today's spend survives a restart: a tenant's budget is not renewed by one.
        since = start_of_utc_day(self.limits.clock())
        self.limits.restore(await asyncio.to_thread(self.stores.spent_since, since))
        for backend in self.backends.values():
            await backend.start()
        await self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        for backend in self.backends.values():
            await backend.stop()
        self.stores.close()

    def ready(self) -> bool:
        batch = self.backends.get(self.policy.batch_engine)
        return batch is not None and batch.available

    def calls_at_once(self, model: str) -> int:
        """The most calls of one request that `model` takes at once: what its engine admits; for
        the router, what the smallest available engine admits (it may send them anywhere)."""
        named = self.backends.get(model)
        engines = [named] if named is not None else [b for b in self.backends.values() if b.available]
        return max(1, min((b.admits for b in engines), default=1))

    async def complete_all(self, calls: list[Call]) -> list[Outcome]:
        """The choices of one request (n x prompts), at most `calls_at_once` at a time: a
        request is never refused for asking more of an engine than it can ever hold, only for
        what others hold (429, which a batch line waits out)."""
        if len(calls) == 1:
            return [await self.dispatcher.complete(calls[0])]
        gate = asyncio.Semaphore(self.calls_at_once(calls[0].model))

        async def complete(call: Call) -> Outcome:
            async with gate:
                return await self.dispatcher.complete(call)

        results = await asyncio.gather(*(complete(c) for c in calls), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    def batch_caller(self, owner: BatchOwner) -> Caller:
        """The caller a batch's lines run as: the key that created it, as the store holds it now (a
        revoked or expired key's lines are refused), or its tenant for a configured key's batch."""
        if owner.key_id is None:
            return Caller(tenant=owner.tenant)
        record = self.keys.get(owner.key_id)
        if record is None or not record.usable_at(self.authenticator.clock()):
            raise unauthorized(f"API key {owner.key_id}, which created this batch, has been revoked or has expired")
        return record.caller()

    async def execute(self, endpoint: str, body: dict, request_id: str,
                      owner: BatchOwner = DEFAULT_OWNER) -> tuple[int, dict, float | None]:
        """One batch line, through the same path as an HTTP request (batchable by default), as the
        batch's key: its models, floor, limits and budget."""
        defaults, data_class = self.config.defaults, self.config.batches.data_class
        try:
            try:
                caller = await asyncio.to_thread(self.batch_caller, owner)
            except APIError as error:
                if error.status == 401:  # the batch's key revoked or expired: who asked is still known
                    self.dispatcher.refused(Caller(tenant=owner.tenant, key_id=owner.key_id), endpoint, error,
                                            request_id)
                raise
            CURRENT_CALLER.set(caller)  # this line's task only: the Calls below take it
            try:
                self.limits.admit(caller)
            except APIError as error:  # audited and counted as the HTTP path's refusal is
                self.dispatcher.refused(caller, endpoint, error, request_id)
                raise
            if endpoint == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(body)
                if chat.stream:
                    raise bad_request("stream is not supported in a batch", param="stream")
                outcomes = await self.complete_all(chat_calls(chat, {}, defaults, request_id, True, data_class))
                return 200, chat_completion(request_id, chat.model, outcomes).model_dump(), None
            text = CompletionRequest.model_validate(body)
            if text.stream:
                raise bad_request("stream is not supported in a batch", param="stream")
            outcomes = await self.complete_all(completion_calls(text, {}, defaults, request_id, True, data_class))
            return 200, text_completion(request_id, text.model, outcomes, len(prompts_of(text))).model_dump(), None
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            return 400, bad_request(f"{param}: {first['msg']}", param=param, code="invalid_value").body(), None
        except APIError as error:
            retry = error.headers.get("Retry-After")
            return error.status, error.body(), float(retry) if retry else None
        except Exception as error:  # one bad line must not stop the batch
            log.exception("batch line %s failed", request_id)
            return 500, APIError(500, f"internal error ({type(error).__name__})", type="server_error").body(), None


def gateway_started(app: FastAPI) -> Gateway | None:
    """The app's running gateway; None until its lifespan has loaded the engines."""
    return getattr(app.state, "gateway", None)


def gateway_of(request: Request) -> Gateway:
    """The running gateway, or a 503 while it is still starting."""
    gateway = gateway_started(request.app)
    if gateway is None:
        raise APIError(503, "the gateway is starting: its engines are loading", type="server_error", code="starting")
    return gateway
