"""Drive the gateway's engine workers (gateway/workers.py) step by step, without their thread:
tickets whose events land at once in their queue, a clock that advances one second per
reading (so each engine step lasts exactly one second), and stats that keep what they are told."""

from __future__ import annotations

from typing import Any

from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.gateway.workers import Event, Ticket


class ImmediateLoop:
    """Stands in for the event loop: a posted event is queued at once."""

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        callback(*args)


class ClosedLoop:
    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        raise RuntimeError("Event loop is closed")


class SecondClock:
    """`time` for workers.py: perf_counter advances by one second at each reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


class RecordingStats:
    def __init__(self) -> None:
        self.records: list[tuple[float, int]] = []

    def record(self, busy_s: float = 0.0, tokens: int = 0, spend_usd: float = 0.0) -> None:
        self.records.append((busy_s, tokens))

    @property
    def busy_s(self) -> float:
        return sum(r[0] for r in self.records)

    @property
    def tokens(self) -> int:
        return sum(r[1] for r in self.records)


def make_ticket(prompt_ids: list[int], max_tokens: int = 6, stream: bool = False, stop: tuple[str, ...] = (),
                where: str = "messages", loop: Any = None, request_id: str = "") -> Ticket:
    request = GenerationRequest(list(prompt_ids), SamplingParams(max_tokens=max_tokens), request_id=request_id)
    return Ticket(request, stream, stop, loop or ImmediateLoop(), where=where)


def drain(ticket: Ticket) -> list[Event]:
    events = []
    while not ticket.events.empty():
        events.append(ticket.events.get_nowait())
    return events


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def streamed(events: list[Event]) -> str:
    return "".join(e.text for e in events if e.kind == "delta")
