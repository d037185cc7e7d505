"""Stand-in engines, a recording audit log and metric readers for the Dispatcher's own tests
(tests/test_dispatch_*.py): each engine answers or fails exactly as told and keeps what it was
given, so every branch of routing, fallback and accounting is reached in milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from nowait.gateway.dispatch import Dispatcher
from nowait.gateway.domain import Attempt, Call, Metadata, Sampling
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.tenants import Caller
from nowait.router import DataClass, RemoteEngine, RoutingPolicy

THRESHOLD = 0.9


@dataclass
class FakeStream:
    """Deltas of one attempt; `fail` is raised after the deltas, `attempt` is set once they end."""

    pieces: list[str]
    final: Attempt | None
    fail: BaseException | None = None
    attempt: Attempt | None = None
    closed: bool = False

    async def deltas(self) -> AsyncIterator[str]:
        for piece in self.pieces:
            yield piece
        if self.fail is not None:
            raise self.fail
        self.attempt = self.final

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeBackend:
    """An engine that answers `answer` (or raises `error`) and records each call and timeout."""

    name: str
    answer: Attempt | None = None
    error: BaseException | None = None
    available: bool = True
    unavailable_reason: str = ""
    receives: tuple[DataClass, ...] = tuple(DataClass)
    stream: FakeStream | None = None
    owned: bool = True
    calls: list[Call] = field(default_factory=list)
    timeouts: list[float] = field(default_factory=list)
    asked_classes: list[DataClass] = field(default_factory=list)
    streams_opened: int = 0

    @property
    def kind(self) -> str:
        return self.name

    def may_receive(self, data_class: DataClass) -> bool:
        self.asked_classes.append(data_class)
        return data_class in self.receives

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        self.calls.append(call)
        self.timeouts.append(timeout_s)
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer

    async def open_stream(self, call: Call, timeout_s: float) -> FakeStream:
        self.calls.append(call)
        self.timeouts.append(timeout_s)
        self.streams_opened += 1
        if self.error is not None:
            raise self.error
        assert self.stream is not None
        return self.stream


class RecordingAudit:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def record(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)


def policy(**overrides: Any) -> RoutingPolicy:
    base: dict[str, Any] = {"confidence_threshold": THRESHOLD, "high_value_usd_per_mtok": 5.0,
                            "remote_frontier_engines": (RemoteEngine(name="frontier",
                                                                     data_classes=(DataClass.public,
                                                                                   DataClass.internal)),)}
    return RoutingPolicy(**{**base, **overrides})


def make(*backends: FakeBackend, timeout_s: float = 7.5, **policy_overrides: Any
         ) -> tuple[Dispatcher, GatewayMetrics, RecordingAudit]:
    metrics, audit = GatewayMetrics(), RecordingAudit()
    dispatcher = Dispatcher({b.name: b for b in backends}, policy(**policy_overrides), "nowait", metrics,
                            audit, timeout_s=timeout_s)  # type: ignore[arg-type]
    return dispatcher, metrics, audit


def make_call(model: str = "nowait", value: float = 0.0, data_class: DataClass = DataClass.internal,
              temperature: float | None = None, json_mode: bool = False, schema: dict | None = None,
              budget_ms: float | None = None, batchable: bool = False) -> Call:
    meta = Metadata(latency_budget_ms=budget_ms, token_value_usd_per_mtok=value, data_class=data_class,
                    batchable=batchable)
    return Call("req-7", "chat", model, meta, sampling=Sampling(temperature=temperature),
                messages=[{"role": "user", "content": "Name: Ann Lee"}], schema=schema, json_mode=json_mode,
                caller=Caller(tenant="team-a", key_id="key-1"))


def answer(engine: str, text: str = "ok", confidence: float | None = None, prompt: int = 5, completion: int = 3,
           cost: float = 0.0, **more: Any) -> Attempt:
    return Attempt(engine=engine, text=text, confidence=confidence, prompt_tokens=prompt,
                   completion_tokens=completion, cost_usd=cost, **more)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    """A metric's value (0 where the series was never touched)."""
    return metrics.registry.get_sample_value(name, labels) or 0.0
