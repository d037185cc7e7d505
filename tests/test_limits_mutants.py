"""The rate limiter and the daily budget (gateway/limits.py) stated boundary by boundary on a
clock the test moves: when a window lets a request in, the Retry-After and `x-ratelimit-*`
headers it answers, what a charge and a restore add, where a UTC day ends. Written against
mutmut's survivors (docs/testing.md)."""

from __future__ import annotations

import time
from datetime import date, datetime, timezone

import pytest

from nowait.gateway.dispatch import Outcome
from nowait.gateway.domain import Attempt, Call, Metadata
from nowait.gateway.errors import APIError
from nowait.gateway.limits import WINDOW_S, TenantLimits, _Window, utc_day
from nowait.gateway.tenants import Caller
from nowait.router import DataClass, Decision
from tests.tenant_support import ManualClock

DAY = 86_400.0
START = DAY * 20_000  # midnight UTC


def refused(limits: TenantLimits, caller: Caller) -> APIError:
    with pytest.raises(APIError) as caught:
        limits.admit(caller)
    return caught.value


def test_a_utc_day_ends_at_midnight_utc_whatever_the_local_zone(monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert utc_day(0) == 0 and utc_day(DAY - 3600) == 0  # 08:00 the next day in Tokyo
        assert utc_day(DAY) == 1
        assert utc_day(-1) == -1  # a clock before 1970 (a test's) still falls on whole days
        noon = datetime(2026, 12, 2, 12, tzinfo=timezone.utc).timestamp()
        assert utc_day(noon) == (date(2026, 12, 2) - date(1970, 1, 1)).days
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_window_forgets_entries_exactly_one_window_old():
    window = _Window()
    window.add(10.0, 2)
    window.add(20.0, 0)  # nothing to count: no entry
    window.add(30.0, 3)
    assert list(window.entries) == [(10.0, 2), (30.0, 3)] and window.total == 5
    window.expire(10.0 + WINDOW_S - 0.001)
    assert window.total == 5
    window.expire(10.0 + WINDOW_S)
    assert list(window.entries) == [(30.0, 3)] and window.total == 3
    window.expire(1_000.0)
    assert not window.entries and window.total == 0


def test_retry_after_is_when_enough_entries_have_left():
    window = _Window()
    for moment in (0.2, 10.0, 20.0):
        window.add(moment, 1)
    assert window.seconds_until_below(3, 30.0) == 31  # the first leaves at 60.2: ceil(30.2)
    assert window.seconds_until_below(2, 30.0) == 40  # the second must leave too
    assert window.seconds_until_below(0, 30.0) == 1  # never below: the smallest wait
    assert window.seconds_until_below(3, 100.0) == 1  # already due: at least a second


def test_requests_per_minute_admit_up_to_the_limit_and_say_when_to_retry():
    clock = ManualClock(START)
    limits = TenantLimits(clock)
    caller = Caller(tenant="team", key_id="key_a", requests_per_minute=2, tokens_per_minute=100)
    limits.admit(caller)
    clock.advance(15)
    limits.admit(caller)
    clock.advance(5)
    error = refused(limits, caller)
    assert (error.status, error.code, error.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert error.message == "Rate limit reached for key key_a on requests per minute: limit 2; retry in 40 s"
    assert error.headers == {"Retry-After": "40", "x-ratelimit-reset-requests": "40s",
                             "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0",
                             "x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "100"}
    clock.advance(40)  # the first request's minute is over; the refused one was never counted
    limits.admit(caller)
    assert refused(limits, caller).headers["Retry-After"] == "15"


def test_a_key_without_an_id_is_its_tenants_and_named_by_it():
    clock = ManualClock(START)
    limits = TenantLimits(clock)
    first, same_tenant = (Caller(tenant="team", requests_per_minute=1) for _ in range(2))
    limits.admit(first)
    error = refused(limits, same_tenant)
    assert "for key team on requests" in error.message
    limits.admit(Caller(tenant="other", requests_per_minute=1))


def test_tokens_per_minute_count_what_was_charged():
    clock = ManualClock(START)
    limits = TenantLimits(clock)
    caller = Caller(tenant="team", key_id="key_t", tokens_per_minute=50)
    limits.admit(caller)
    limits.charge(caller, 49, 0.0)
    limits.admit(caller)  # 49 < 50
    clock.advance(10)
    limits.charge(caller, 1, 0.0)
    error = refused(limits, caller)
    assert error.message == "Rate limit reached for key key_t on tokens per minute: limit 50; retry in 50 s"
    assert error.headers == {"Retry-After": "50", "x-ratelimit-reset-tokens": "50s",
                             "x-ratelimit-limit-tokens": "50", "x-ratelimit-remaining-tokens": "0"}
    clock.advance(50)  # the 49 tokens leave; the 1 stays
    limits.admit(caller)
    other_key = Caller(tenant="team", key_id="key_u", tokens_per_minute=1)
    limits.admit(other_key)  # tokens are counted per key


def test_a_tokens_refusal_shows_the_requests_left_too():
    limits = TenantLimits(ManualClock(START))
    caller = Caller(tenant="team", key_id="k", requests_per_minute=10, tokens_per_minute=5)
    limits.admit(caller)
    limits.charge(caller, 5, 0.0)
    headers = refused(limits, caller).headers
    assert headers["x-ratelimit-remaining-requests"] == "9" and headers["x-ratelimit-reset-tokens"] == "60s"
    assert "x-ratelimit-reset-requests" not in headers


def test_a_caller_without_limits_is_neither_refused_nor_counted():
    limits = TenantLimits(ManualClock(START))
    for _ in range(5):
        limits.admit(Caller(tenant="team", key_id="k"))
    limits.admit(Caller(tenant="team", key_id="k", requests_per_minute=1))


def test_the_budget_refuses_from_the_request_that_reached_it():
    clock = ManualClock(START + DAY - 100)
    limits = TenantLimits(clock)
    caller = Caller(tenant="team", key_id="k", budget_usd_per_day=1.0)
    limits.charge(caller, 10, 0.999)
    limits.admit(caller)
    limits.charge(caller, 10, 0.001)  # exactly the budget: spent
    error = refused(limits, caller)
    assert (error.status, error.code, error.type) == (429, "insufficient_quota", "insufficient_quota")
    assert error.message == ("tenant 'team' has spent its budget of $1 for today (UTC); requests are served "
                             "again from 00:00 UTC")
    limits.admit(Caller(tenant="team", key_id="k2"))  # no budget on this key: served
    clock.advance(100)
    limits.admit(caller)
    assert limits.spent_today("team") == 0.0


def test_charges_of_a_new_day_start_from_zero():
    clock = ManualClock(START + DAY - 1)
    limits = TenantLimits(clock)
    caller = Caller(tenant="team")
    limits.charge(caller, 0, 0.6)
    clock.advance(1)
    limits.charge(caller, 0, 0.1)
    assert limits.spent_today("team") == pytest.approx(0.1) and limits.spent_today("nobody") == 0.0


def test_a_restore_adds_to_the_days_spend():
    limits = TenantLimits(ManualClock(START))
    limits.charge(Caller(tenant="a"), 0, 0.25)
    limits.restore({"a": 0.5, "b": 2.0})
    limits.restore({"a": 0.5})
    assert limits.spent_today("a") == pytest.approx(1.25) and limits.spent_today("b") == 2.0


def test_answered_headers_show_what_is_left():
    clock = ManualClock(START)
    limits = TenantLimits(clock)
    assert limits.headers(Caller(tenant="team", budget_usd_per_day=5.0)) == {}
    caller = Caller(tenant="team", key_id="k", requests_per_minute=5, tokens_per_minute=10)
    # admit gives the answer's headers as of its admission: this request counted, its tokens not yet.
    assert limits.admit(caller) == {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "4",
                                    "x-ratelimit-limit-tokens": "10", "x-ratelimit-remaining-tokens": "10"}
    limits.charge(caller, 4, 0.0)
    assert limits.admit(caller)["x-ratelimit-remaining-tokens"] == "6"
    assert limits.admit(Caller(tenant="team", budget_usd_per_day=5.0)) == {}  # limited, but by no rate
    limits.charge(caller, 21, 0.0)
    assert limits.headers(caller) == {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "3",
                                      "x-ratelimit-limit-tokens": "10", "x-ratelimit-remaining-tokens": "0"}
    clock.advance(WINDOW_S)
    assert limits.headers(caller)["x-ratelimit-remaining-requests"] == "5"
    assert limits.headers(Caller(tenant="t", tokens_per_minute=7)) == {"x-ratelimit-limit-tokens": "7",
                                                                      "x-ratelimit-remaining-tokens": "7"}
    assert limits.headers(Caller(tenant="t", requests_per_minute=3)) == {"x-ratelimit-limit-requests": "3",
                                                                        "x-ratelimit-remaining-requests": "3"}


def test_a_requests_outcomes_are_charged_by_their_answers():
    limits = TenantLimits(ManualClock(START))
    caller = Caller(tenant="team", key_id="k", tokens_per_minute=100)
    meta = Metadata(latency_budget_ms=None, token_value_usd_per_mtok=0.0, data_class=DataClass.internal,
                    batchable=False)
    call = Call("r", "chat", "nowait", meta, messages=[], caller=caller)
    answered = Outcome(call, Decision("diffusion", ""), attempts=[
        Attempt("diffusion", prompt_tokens=50, completion_tokens=50, cost_usd=0.25),
        Attempt("ar", prompt_tokens=30, completion_tokens=9, cost_usd=0.5)])
    unanswered = Outcome(call, Decision("ar", ""))
    limits.charge_outcomes(caller, [answered, unanswered])
    assert limits.spent_today("team") == 0.75
    assert limits.headers(caller)["x-ratelimit-remaining-tokens"] == "61"  # the answer's 39 tokens
