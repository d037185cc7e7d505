"""Route, run, fall back, account: one Call in, one Outcome out.

    decision = route(...) (model "nowait") or pin(...) (an engine's name)
    the chosen engine must be available and may receive the request's data class (checked here,
        and again by a remote backend right before its I/O)
    run it; a failing remote upstream fails over to the owned frontier engine
    a fast-engine (diffusion) answer below the confidence threshold, or not valid for the requested
        schema, re-runs on the fallback engine (AR); both runs are paid for
    an answer below its engine's confidence floor is flagged, re-run on the frontier engine, or
        refused (422), as `routing.low_confidence` says (low_confidence.py)
    every request, answered or not, goes to the audit log and the metrics, with its tenant and key id

Streams: a stream routed to the fast engine is held until its confidence is known (diffusion
answers in a few parallel passes, and a stream cannot take back text it already sent), then sent;
every other stream is relayed as the engine produces it, and its route header is known up front.
A relayed stream's confidence is known only after its text is sent, so below the floor it can
only be flagged, in its final chunk (`nowait.low_confidence`), whatever `routing.low_confidence`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from nowait.gateway.audit.log import AuditLog
from nowait.gateway.domain import Attempt, AttemptStream, Backend, Call
from nowait.gateway.errors import APIError, engine_unavailable, forbidden_destination, unknown_model
from nowait.gateway.logprobs import TextWithLogprobs
from nowait.gateway.low_confidence import LowConfidence, LowConfidenceError
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.prompts import conforms
from nowait.gateway.remote import UpstreamFailure
from nowait.gateway.workers import LOGPROBS_UNSUPPORTED, SCHEMA_UNSUPPORTED
from nowait.router import (
    DataClass,
    Decision,
    RoutingPolicy,
    below_floor,
    below_threshold,
    confidence_floor,
    failover,
    low_confidence_rerun,
    pin,
    route,
    threshold_for,
)


@dataclass
class Outcome:
    """A request's answer and its story: the decision, every engine tried, the total cost."""

    call: Call
    decision: Decision
    attempts: list[Attempt] = field(default_factory=list)
    reason: str = ""
    # confidence | confidence_unknown | invalid_output | upstream_failure | schema_unsupported | engine_failure
    fallback_cause: str | None = None
    low_confidence: list[LowConfidence] = field(default_factory=list)  # answers below their engine's floor

    @property
    def flagged(self) -> bool:
        """The answer returned is below its engine's floor (`nowait.low_confidence`)."""
        return bool(self.low_confidence) and self.low_confidence[-1].action == "flag"

    @property
    def fallback(self) -> bool:
        return self.fallback_cause is not None

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def cost_usd(self) -> float:
        return sum(a.cost_usd for a in self.attempts)


class Dispatcher:
    def __init__(self, backends: dict[str, Backend], policy: RoutingPolicy, router_model: str, metrics: GatewayMetrics,
                 audit: AuditLog, timeout_s: float) -> None:
        self.backends, self.policy, self.router_model = backends, policy, router_model
        self.metrics, self.audit, self.timeout_s = metrics, audit, timeout_s

    def model_names(self) -> list[str]:
        return [self.router_model] + [n for n, b in self.backends.items() if b.available]

    def decide(self, call: Call) -> Decision:
        if call.model == self.router_model:
            return route(call.meta.route_request(), self.policy)
        if call.model in self.backends:
            return pin(call.model, self.policy)
        raise unknown_model(call.model, self.model_names())

    def backend(self, engine: str, call: Call) -> Backend:
        """The engine to run, after the availability and data-class checks."""
        backend = self.backends[engine]
        if not backend.available:
            raise engine_unavailable(engine, backend.unavailable_reason)
        if not backend.may_receive(call.meta.data_class):
            raise forbidden_destination(f"{DataClass(call.meta.data_class).value} data may not be sent to remote "
                                        f"engine {engine!r}")
        if call.logprobs is not None and not getattr(backend, "logprobs", False):
            # Never numbers made up here: an engine that cannot give them says so.
            raise APIError(400, f"engine {engine!r} cannot return logprobs (only nowait's own engines do)",
                           param="logprobs", code=LOGPROBS_UNSUPPORTED)
        return backend

    # --- non-streaming ---

    def _decide(self, call: Call, started: float) -> Decision:
        """`decide`, with a refusal (unknown model) logged like any other answer."""
        try:
            return self.decide(call)
        except APIError as error:
            refused = Decision("", f"refused: {error.message}", rule="none")
            self._account(Outcome(call, refused, reason=refused.reason), started, error)
            raise

    async def complete(self, call: Call) -> Outcome:
        started = time.perf_counter()
        decision = self._decide(call, started)
        outcome = Outcome(call, decision, reason=decision.reason)
        try:
            await self._run_with_fallbacks(outcome)
            await self._check_floor(outcome)
        except APIError as error:
            self._account(outcome, started, error=error)
            raise
        except asyncio.CancelledError:
            self._account(outcome, started, error=APIError(499, "client closed the request", code="cancelled"))
            raise
        self._account(outcome, started)
        return outcome

    async def _run_with_fallbacks(self, outcome: Outcome) -> None:
        call, decision = outcome.call, outcome.decision
        attempt = await self._first_attempt(outcome)
        if attempt.engine != decision.engine or decision.fallback_engine is None:
            return
        found = self.fallback_cause(attempt, call)
        if found is not None:
            outcome.fallback_cause, why = found
            outcome.reason += f"; {why}: re-ran on {decision.fallback_engine}"
            # A speculative fallback engine verifies the answer it replaces instead of drafting:
            # most of a low-confidence answer is usually right, so it costs a few forwards. Greedy
            # calls only: a seeded sampled draft would share its random stream with the re-run's
            # acceptance draws, and the re-run's distribution is exact only for independent drafts.
            greedy = not (call.sampling.temperature or 0) > 0
            retry = replace(call, draft_text=attempt.text) if attempt.text and greedy else call
            outcome.attempts.append(await self._run(decision.fallback_engine, retry))

    async def _first_attempt(self, outcome: Outcome) -> Attempt:
        call, decision = outcome.call, outcome.decision
        try:
            attempt = await self._run(decision.engine, call)
        except APIError as error:
            alternative = self._alternative(decision, error)
            if alternative is None:
                raise
            self._note_failure(outcome, error, alternative)
            attempt = await self._run(alternative, call)
        outcome.attempts.append(attempt)
        return attempt

    @staticmethod
    def _note_failure(outcome: Outcome, error: APIError, alternative: str) -> None:
        outcome.attempts.append(Attempt(engine=outcome.decision.engine, finish_reason="error", outcome=error.message))
        outcome.fallback_cause = ("upstream_failure" if isinstance(error, UpstreamFailure) else
                                  "schema_unsupported" if error.code == SCHEMA_UNSUPPORTED else
                                  "logprobs_unsupported" if error.code == LOGPROBS_UNSUPPORTED else "engine_failure")
        outcome.reason += f"; {error.message}: re-ran on {alternative}"

    def _alternative(self, decision: Decision, error: APIError) -> str | None:
        """Where to go when the first engine could not answer at all (not: answered badly).

        A fast engine that fails (500), is unavailable (503) or full (429) hands the request to
        its fallback engine, as a low-confidence answer would be: the client asked for an
        answer, not for that engine. A timeout (504) does not: the time is already spent."""
        if isinstance(error, UpstreamFailure) and decision.rule != "pinned":
            return failover(decision.engine, self.policy)
        if error.code == LOGPROBS_UNSUPPORTED and decision.rule != "pinned" and (
                owned := failover(decision.engine, self.policy)):
            return owned  # routed to a remote frontier: the owned one has them
        if decision.fallback_engine is None:
            return None
        if error.code in (SCHEMA_UNSUPPORTED, LOGPROBS_UNSUPPORTED) or error.status in (429, 500, 503):
            return decision.fallback_engine
        return None

    def fallback_cause(self, attempt: Attempt, call: Call) -> tuple[str, str] | None:
        """(cause, sentence) when a fast-engine answer is not good enough to hand back, else None."""
        return fallback_cause(attempt, call.schema, call.json_mode, self.policy)

    def _low(self, outcome: Outcome, action: str, why: str = "", then: str = "flagged") -> LowConfidence:
        """Record the final answer as below its floor, handled by `action` (`then` says how)."""
        final = outcome.final
        low = LowConfidence(final.engine, final.confidence, confidence_floor(final.engine, self.policy), action)
        outcome.low_confidence.append(low)
        outcome.reason += (f"; {final.engine} confidence {final.confidence:.3g} is below its floor {low.floor:g}"
                           f"{why}: {then}")
        self.metrics.low_confidence.labels(final.engine, action).inc()
        return low

    async def _check_floor(self, outcome: Outcome) -> None:
        """No silent garbage: an answer below its engine's floor is flagged, re-run once on the
        frontier engine its data class may reach (the re-run's own answer is then kept, flagged
        if it too is below its floor), or refused with a 422, as `routing.low_confidence` says."""
        final = outcome.final
        if not below_floor(final.engine, final.confidence, self.policy):
            return
        if self.policy.low_confidence == "reject":
            raise LowConfidenceError(self._low(outcome, "reject", then="refused"), outcome.attempts)
        why = ""
        if self.policy.low_confidence == "frontier":
            call = outcome.call
            target = low_confidence_rerun(call.meta.data_class, {a.engine for a in outcome.attempts}, self.policy)
            if target is None:
                why = (f" and no other frontier engine may receive {DataClass(call.meta.data_class).value} data")
            else:
                try:
                    attempt = await self._run(target, call)
                except APIError as error:  # the answer in hand is still better than none: flag it
                    why = f" and frontier engine {target} failed ({error.message})"
                else:
                    self._low(outcome, "frontier", then=f"re-ran on {target}")
                    outcome.attempts.append(attempt)
                    if below_floor(attempt.engine, attempt.confidence, self.policy):
                        self._low(outcome, "flag")
                    return
        self._low(outcome, "flag", why)

    def flag_streamed(self, outcome: Outcome) -> None:
        """A relayed stream's answer, already sent: below its floor, a flag is all that is left."""
        final = outcome.final
        if below_floor(final.engine, final.confidence, self.policy):
            self._low(outcome, "flag", " (already streamed)")

    async def _run(self, engine: str, call: Call) -> Attempt:
        attempt = await self.backend(engine, call).run(call, self.timeout_s)
        self.metrics.observe_attempt(attempt)
        return attempt

    # --- streaming ---

    async def open_stream(self, call: Call) -> StreamPlan:
        """Start a stream; raises APIError (as an HTTP error) while nothing has been sent."""
        started = time.perf_counter()
        decision = self._decide(call, started)
        outcome = Outcome(call, decision, reason=decision.reason)
        if decision.fallback_engine is not None:  # held: see the module docstring
            try:
                await self._run_with_fallbacks(outcome)
                await self._check_floor(outcome)
            except APIError as error:
                self._account(outcome, started, error=error)
                raise
            except asyncio.CancelledError:  # the client hung up before the first byte
                self._account(outcome, started, error=APIError(499, "client closed the request", code="cancelled"))
                raise
            self._account(outcome, started)
            final = outcome.final
            replay = final.text if final.logprobs is None else TextWithLogprobs(final.text, final.logprobs)
            return StreamPlan(self, outcome, started, outcome.final.engine, replay=replay)
        engine = decision.engine
        try:
            stream = await self.backend(engine, call).open_stream(call, self.timeout_s)
        except APIError as error:
            alternative = self._alternative(decision, error)
            if alternative is None:
                self._account(outcome, started, error=error)
                raise
            self._note_failure(outcome, error, alternative)
            engine = alternative
            try:
                stream = await self.backend(engine, call).open_stream(call, self.timeout_s)
            except APIError as second:
                self._account(outcome, started, error=second)
                raise
        return StreamPlan(self, outcome, started, engine, stream=stream)

    # --- accounting ---

    def _account(self, outcome: Outcome, started: float, error: APIError | None = None) -> None:
        call, decision = outcome.call, outcome.decision
        answered = error is None and bool(outcome.attempts)
        if answered:
            fast_ran = decision.engine if decision.fallback_engine is not None and any(
                a.engine == decision.engine and a.finish_reason != "error" for a in outcome.attempts) else None
            fell_back_to = outcome.final.engine if outcome.fallback else None
            self.metrics.observe_decision(decision.rule, decision.engine, fast_ran, fell_back_to,
                                          outcome.fallback_cause or "")
            self.metrics.gateway_e2e.labels(outcome.final.engine).observe(time.perf_counter() - started)
        else:
            self.metrics.observe_error(error.status if error else 500, error.code if error else None)
            if error is not None:
                error.accounted = True  # the HTTP error handler must not count it again
        status = 200 if answered else (error.status if error else 500)
        caller = call.caller
        self.metrics.observe_tenant(caller.tenant, status, sum(a.prompt_tokens for a in outcome.attempts),
                                    sum(a.completion_tokens for a in outcome.attempts), outcome.cost_usd)
        self.audit.record({
            "request_id": call.request_id, "endpoint": call.endpoint, "model": call.model,
            "tenant": caller.tenant, "key_id": caller.key_id,  # the key's id, never its secret
            "status": status,
            "error": None if answered else (error.message if error else "no answer"),
            "route": outcome.final.engine if answered else None, "decision": decision.engine, "rule": decision.rule,
            "reason": outcome.reason, "fallback": outcome.fallback, "fallback_cause": outcome.fallback_cause,
            "low_confidence": [low.record() for low in outcome.low_confidence],
            "metadata": {"latency_budget_ms": call.meta.latency_budget_ms,
                         "token_value_usd_per_mtok": call.meta.token_value_usd_per_mtok,
                         "data_class": DataClass(call.meta.data_class).value, "batchable": call.meta.batchable},
            "engines_tried": [attempt_record(a) for a in outcome.attempts],
            "prompt_tokens": outcome.final.prompt_tokens if outcome.attempts else 0,
            "completion_tokens": outcome.final.completion_tokens if outcome.attempts else 0,
            "seconds": round(time.perf_counter() - started, 6), "cost_usd": outcome.cost_usd,
        })


def fallback_cause(attempt: Attempt, schema: dict | None, json_mode: bool,
                   policy: RoutingPolicy) -> tuple[str, str] | None:
    """The fallback rule on one fast-engine answer: (cause, sentence) when it is not good enough
    to hand back, else None. A function of its inputs, so `nowait eval --engine routed` judges
    answers by the gateway's own rule."""
    if attempt.confidence is None:  # an answer of unknown confidence does not pass as a confident one
        return "confidence_unknown", (f"{attempt.engine} gave no confidence "
                                      f"({attempt.confidence_missing or 'none reported'})")
    threshold, source = threshold_for(schema, policy)
    if below_threshold(attempt.confidence, threshold):
        where = "" if source == "global" else f" (the {source}'s threshold)"
        return "confidence", f"{attempt.engine} confidence {attempt.confidence:.3g} is below {threshold:g}{where}"
    if json_mode and not conforms(attempt.text, schema):
        return "invalid_output", f"{attempt.engine} output is not JSON valid for the requested format"
    return None


def attempt_record(attempt: Attempt) -> dict:
    return {"engine": attempt.engine, "outcome": attempt.outcome, "seconds": round(attempt.seconds, 6),
            "compute_s": round(attempt.compute_s, 6), "prompt_tokens": attempt.prompt_tokens,
            "completion_tokens": attempt.completion_tokens, "confidence": attempt.confidence,
            "cost_usd": attempt.cost_usd, "forwards": attempt.forwards}


class StreamPlan:
    """A started stream: the engine that answers (the route header), its deltas, and the Outcome
    once the deltas are exhausted."""

    def __init__(self, dispatcher: Dispatcher, outcome: Outcome, started: float, route: str,
                 replay: str | None = None, stream: AttemptStream | None = None) -> None:
        self.dispatcher, self.outcome, self.started, self.route = dispatcher, outcome, started, route
        self.replay, self.stream = replay, stream

    async def deltas(self) -> AsyncIterator[str]:
        if self.replay is not None:
            if self.replay or getattr(self.replay, "logprobs", None):
                yield self.replay
            return
        try:
            async for text in self.stream.deltas():
                yield text
        except APIError as error:
            self.dispatcher._account(self.outcome, self.started, error=error)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.dispatcher._account(self.outcome, self.started,
                                     error=APIError(499, "client closed the request", code="cancelled"))
            raise
        except Exception as error:  # a bug: counted as the 500 the client is sent
            self.dispatcher._account(self.outcome, self.started, error=APIError(
                500, f"internal error ({type(error).__name__})", type="server_error"))
            raise
        attempt = self.stream.attempt
        if attempt is not None:
            self.dispatcher.metrics.observe_attempt(attempt)
            self.outcome.attempts.append(attempt)
            self.dispatcher.flag_streamed(self.outcome)
            self.dispatcher._account(self.outcome, self.started)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
