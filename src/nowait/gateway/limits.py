"""Each key's rate limits and each tenant's daily budget, answered as OpenAI answers them.

    requests per minute   a request is admitted while its key's admitted requests of the last
                          60 s are fewer than the limit
    tokens per minute     prompt + completion tokens of the key's answered requests of the last
                          60 s; a request is admitted while that count is under the limit
    budget (USD per day)  the ledger's cost of the tenant's answered requests since 00:00 UTC,
                          owned compute included; the request that crosses the line completes,
                          the next one is refused until the next UTC day

Refusals: 429 `rate_limit_exceeded` with `Retry-After` and the `x-ratelimit-*` headers, 429
`insufficient_quota`. Windows are sliding logs per key and spend is counted per tenant, so one
tenant over its limits never holds up another. The clock is injectable (tests move time). The
windows live in memory; the day's spend is read back from the audit log when the server starts.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from nowait.gateway.errors import APIError
from nowait.gateway.spend_restore import DAY_S
from nowait.gateway.tenants import Caller

WINDOW_S = 60.0


def utc_day(moment: float) -> int:
    """The UTC day a moment falls on, as days since 1970-01-01 (POSIX time has no leap seconds,
    so every UTC day is DAY_S long; a number, not a date, because it is asked on every request)."""
    return int(moment // DAY_S)


class _Window:
    """(time, amount) entries of the last WINDOW_S seconds."""

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - WINDOW_S:
            self.total -= self.entries.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self.entries.append((now, amount))
            self.total += amount

    def seconds_until_below(self, limit: int, now: float) -> int:
        """Seconds until the window's total falls under `limit` (as entries leave it)."""
        total = self.total
        for moment, amount in self.entries:
            total -= amount
            if total < limit:
                return max(1, math.ceil(moment + WINDOW_S - now))
        return 1


class TenantLimits:
    """The admission check before a request runs and the charge after it is answered."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()  # batch lines and HTTP requests share it (and tests on other threads)
        self._windows: dict[str, tuple[_Window, _Window]] = {}  # key -> (its requests, its tokens)
        self._spend: dict[str, tuple[int, float]] = {}  # tenant -> (UTC day, USD spent that day)

    @staticmethod
    def _key(caller: Caller) -> str:
        return caller.key_id or f"tenant:{caller.tenant}"

    def spent_today(self, tenant: str) -> float:
        with self._lock:
            return self._spent(tenant, self.clock())

    def _spent(self, tenant: str, now: float) -> float:
        day, spent = self._spend.get(tenant, (-1, 0.0))
        return spent if day == utc_day(now) else 0.0

    def _windows_of(self, key: str, now: float) -> tuple[_Window, _Window]:
        """The key's requests and tokens windows, expired up to `now` (made on its first use)."""
        windows = self._windows.get(key)
        if windows is None:
            windows = self._windows[key] = (_Window(), _Window())
        windows[0].expire(now)
        windows[1].expire(now)
        return windows

    def admit(self, caller: Caller) -> dict[str, str]:
        """Count one request of `caller`, or raise the 429 that refuses it. Returns the
        `x-ratelimit-*` headers as of its admission, for its answer: taken here, under the same
        lock, so that an answered request asks the limits once, not a second time at its answer."""
        if not caller.limited:
            return {}
        with self._lock:
            now = self.clock()
            budget = caller.budget_usd_per_day
            if budget is not None and self._spent(caller.tenant, now) >= budget:
                raise APIError(429, f"tenant {caller.tenant!r} has spent its budget of ${budget:g} for today "
                                    f"(UTC); requests are served again from 00:00 UTC", type="insufficient_quota",
                               code="insufficient_quota")
            key = self._key(caller)
            requests, tokens = self._windows_of(key, now)
            rpm, tpm = caller.requests_per_minute, caller.tokens_per_minute
            if rpm is not None and requests.total >= rpm:
                self._refuse(caller, "requests", rpm, requests.seconds_until_below(rpm, now), requests, tokens)
            if tpm is not None and tokens.total >= tpm:
                self._refuse(caller, "tokens", tpm, tokens.seconds_until_below(tpm, now), requests, tokens)
            requests.add(now, 1)
            return self._headers(caller, requests, tokens)

    def _refuse(self, caller: Caller, what: str, limit: int, retry_after: int, requests: _Window,
                tokens: _Window) -> None:
        headers = self._headers(caller, requests, tokens)
        headers["Retry-After"] = str(retry_after)
        headers[f"x-ratelimit-reset-{what}"] = f"{retry_after}s"
        raise APIError(429, f"Rate limit reached for key {caller.key_id or caller.tenant} on {what} per minute: "
                            f"limit {limit}; retry in {retry_after} s", type="rate_limit_error",
                       code="rate_limit_exceeded", headers=headers)

    def _headers(self, caller: Caller, requests: _Window, tokens: _Window) -> dict[str, str]:
        headers = {}
        if caller.requests_per_minute is not None:
            headers["x-ratelimit-limit-requests"] = str(caller.requests_per_minute)
            headers["x-ratelimit-remaining-requests"] = str(max(0, caller.requests_per_minute - requests.total))
        if caller.tokens_per_minute is not None:
            headers["x-ratelimit-limit-tokens"] = str(caller.tokens_per_minute)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, caller.tokens_per_minute - tokens.total))
        return headers

    def headers(self, caller: Caller) -> dict[str, str]:
        """The `x-ratelimit-*` headers of a request not counted against the limits (a file, a
        batch), as of now (none for a key without limits); `admit` gives a counted one's."""
        if caller.requests_per_minute is None and caller.tokens_per_minute is None:
            return {}
        with self._lock:
            now, key = self.clock(), self._key(caller)
            return self._headers(caller, *self._windows_of(key, now))

    def restore(self, spent: dict[str, float]) -> None:
        """Today's spend per tenant, as the audit log has it (spend_restore.py), added on start."""
        with self._lock:
            now = self.clock()
            for tenant, usd in spent.items():
                self._spend[tenant] = (utc_day(now), self._spent(tenant, now) + usd)

    def charge(self, caller: Caller, tokens: int, cost_usd: float) -> None:
        """An answered request's tokens (the key's window) and cost (the tenant's day)."""
        with self._lock:
            now = self.clock()
            self._windows_of(self._key(caller), now)[1].add(now, tokens)
            day = utc_day(now)
            self._spend[caller.tenant] = (day, self._spent(caller.tenant, now) + cost_usd)

    def charge_outcomes(self, caller: Caller, outcomes: Iterable) -> None:
        """`charge` for the Outcomes (dispatch.py) of one request."""
        outcomes = [o for o in outcomes if o.attempts]
        tokens = sum(o.final.prompt_tokens + o.final.completion_tokens for o in outcomes)
        self.charge(caller, tokens, sum(o.cost_usd for o in outcomes))
