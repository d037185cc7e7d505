"""One engine's busy time, tokens and spend over a sliding window: what its utilization,
throughput and live cost per token are computed from.

Every backend carries one (`domain.Backend.stats`); its worker writes it, the metrics scrape
(`metrics.py`) and the Retry-After estimate read it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from nowait.gateway.ledger import TOKENS_PER_MTOK
from nowait.planner.cost import cost_per_mtok


class EngineStats:
    """One engine's busy time, tokens and spend over a sliding window; written by its worker
    thread (or the event loop for remote engines), read at scrape time."""

    def __init__(self, window_s: float, node_usd_per_hour: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.node_usd_per_hour = node_usd_per_hour  # None: priced per token (remote)
        self._clock = clock
        self._started = clock()
        self._samples: deque[tuple[float, float, int, float]] = deque()  # (time, busy_s, tokens, spend)
        self._lock = threading.Lock()
        self._mean_request_s = 0.0

    def record(self, busy_s: float = 0.0, tokens: int = 0, spend_usd: float = 0.0) -> None:
        now = self._clock()
        with self._lock:
            self._samples.append((now, busy_s, tokens, spend_usd))
            self._trim(now)

    def record_request(self, seconds: float) -> None:
        """A finished request's wall time (a moving average, for Retry-After estimates)."""
        with self._lock:
            self._mean_request_s = seconds if not self._mean_request_s else 0.8 * self._mean_request_s + 0.2 * seconds

    @property
    def mean_request_s(self) -> float:
        return self._mean_request_s

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def window(self) -> tuple[float, float, int, float]:
        """(span_s, busy_s, tokens, spend_usd) over the window (shorter right after start)."""
        now = self._clock()
        with self._lock:
            self._trim(now)
            busy = sum(s[1] for s in self._samples)
            tokens = sum(s[2] for s in self._samples)
            spend = sum(s[3] for s in self._samples)
        return max(min(self.window_s, now - self._started), 1e-9), busy, tokens, spend

    def utilization(self) -> float:
        span, busy, _, _ = self.window()
        return min(1.0, busy / span)

    def throughput(self) -> float:
        """Output tokens per busy second (what the engine does while it works)."""
        _, busy, tokens, _ = self.window()
        return tokens / busy if busy > 0 else 0.0

    def effective_usd_per_mtok(self) -> float:
        """The live cost identity; NaN while nothing was produced in the window."""
        span, busy, tokens, spend = self.window()
        if tokens == 0:
            return math.nan
        if self.node_usd_per_hour is None:
            return spend / tokens * TOKENS_PER_MTOK
        return cost_per_mtok(self.node_usd_per_hour, tokens / busy, min(1.0, busy / span))
