"""The cost identity and what is derived from it, on hand-computed cases."""

from __future__ import annotations

import pytest

from nowait.planner.cost import (
    api_usd_per_mtok,
    break_even_utilization,
    cost_per_mtok,
    sensitivity,
    utilization,
    with_fallback,
)


def test_cost_identity():
    # $33/h over 1,000 tok/s at 50% utilization: 1.8M tokens an hour -> $18.33 per million.
    assert cost_per_mtok(33.0, 1000.0, 0.5) == pytest.approx(33 / 1.8)
    assert cost_per_mtok(33.0, 1000.0, 1.0) == pytest.approx(33 / 3.6)


def test_utilization_is_offered_over_fleet_throughput():
    assert utilization(offered_tokens_per_s=1500.0, nodes=2, tokens_per_s_per_node=1000.0) == pytest.approx(0.75)


def test_fallback_is_folded_into_the_price():
    assert with_fallback(10.0, 0.03, 5.0) == pytest.approx(10.15)
    assert with_fallback(10.0, 0.0, 5.0) == 10.0


def test_api_price_per_million_output_tokens():
    # 1,000 input tokens at $3/M and 100 output at $15/M: $0.0045 per request, $45 per million output tokens.
    assert api_usd_per_mtok(1000, 100, 3.0, 15.0) == pytest.approx(45.0)


def test_break_even_utilization():
    assert break_even_utilization(33.0, 1000.0, 15.0) == pytest.approx((33 / 3.6) / 15)  # 61%
    assert break_even_utilization(33.0, 1000.0, 0.4) > 1  # owned never beats a $0.40/M token here
    assert break_even_utilization(33.0, 1000.0, 1.0, surcharge_usd_per_mtok=2.0) == float("inf")


def test_sensitivity_rows():
    rows = sensitivity([33.0, 55.0], 1000.0, 0.5, [15.0])
    assert [r.node_usd_per_hour for r in rows] == [33.0, 55.0]
    assert rows[1].cost_per_mtok_usd == pytest.approx(55 / 1.8)
    assert rows[0].break_even[15.0] == pytest.approx((33 / 3.6) / 15)


def test_sensitivity_rows_price_the_reruns_at_their_own_node_price():
    """Re-runs use the same owned nodes: a row at another node price scales their cost too."""
    rows = sensitivity([33.0, 55.0], 1000.0, 0.5, [15.0], fallback_rate=0.03, fallback_usd_per_mtok=6.0,
                       fallback_priced_at=33.0)
    assert rows[0].cost_per_mtok_usd == pytest.approx(33 / 1.8 + 0.03 * 6.0)
    assert rows[1].cost_per_mtok_usd == pytest.approx(55 / 1.8 + 0.03 * 6.0 * 55 / 33)
