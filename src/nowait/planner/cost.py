"""The cost identity and what follows from it: owned versus API, break-even, sensitivity.

Every price here is per million *output* tokens, the tokens a workload exists to produce; an API's
price for the same requests (input and output priced separately) is converted to that unit, so
the two columns of a comparison always price the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0


# mission.md, "The economics": effective cost per token = node cost per hour / (throughput x utilization).
def cost_per_mtok(node_usd_per_hour: float, tokens_per_s_per_node: float, utilization: float) -> float:
    tokens_per_hour = tokens_per_s_per_node * SECONDS_PER_HOUR * utilization
    return node_usd_per_hour / tokens_per_hour * 1e6


def utilization(offered_tokens_per_s: float, nodes: int, tokens_per_s_per_node: float) -> float:
    """The share of the fleet's throughput (at the batch the plan uses) that the workload fills."""
    return offered_tokens_per_s / (nodes * tokens_per_s_per_node)


# A diffusion answer below the confidence threshold is re-run on AR: each useful token pays its own
# diffusion cost, and a `fallback_rate` share of tokens pays the AR cost on top (mission.md, routing rule).
def with_fallback(own_usd_per_mtok: float, fallback_rate: float, fallback_usd_per_mtok: float) -> float:
    return own_usd_per_mtok + fallback_rate * fallback_usd_per_mtok


def api_usd_per_mtok(input_tokens: float, output_tokens: float, input_price: float, output_price: float) -> float:
    """An API's price for a request of this shape, per million output tokens."""
    return (input_tokens * input_price + output_tokens * output_price) / output_tokens


# Setting the cost identity (plus any fallback surcharge) equal to the API price and solving for utilization.
def break_even_utilization(node_usd_per_hour: float, tokens_per_s_per_node: float, api_price_per_mtok: float,
                           surcharge_usd_per_mtok: float = 0.0) -> float:
    """The utilization at which owned tokens cost what the API charges (above 1: owned never breaks even)."""
    margin = api_price_per_mtok - surcharge_usd_per_mtok
    if margin <= 0:
        return float("inf")
    return cost_per_mtok(node_usd_per_hour, tokens_per_s_per_node, 1.0) / margin


@dataclass(frozen=True)
class SensitivityRow:
    node_usd_per_hour: float
    cost_per_mtok_usd: float
    break_even: dict[float, float]  # API price per Mtok -> break-even utilization


def sensitivity(node_prices: list[float], tokens_per_s_per_node: float, utilization_at_plan: float,
                api_prices: list[float], fallback_rate: float = 0.0,
                fallback_usd_per_mtok: float = 0.0, fallback_priced_at: float | None = None) -> list[SensitivityRow]:
    """Owned cost per Mtok at each node price, and break-even utilization against each API price.

    `fallback_usd_per_mtok`: what a re-run costs at node price `fallback_priced_at`; the re-runs
    run on the same owned nodes, so each row scales it to its own price."""
    rows = []
    for price in node_prices:
        own = cost_per_mtok(price, tokens_per_s_per_node, utilization_at_plan)
        rerun = fallback_usd_per_mtok * (price / fallback_priced_at if fallback_priced_at else 1.0)
        rows.append(SensitivityRow(
            node_usd_per_hour=price,
            cost_per_mtok_usd=with_fallback(own, fallback_rate, rerun),
            break_even={api: break_even_utilization(price, tokens_per_s_per_node, api, fallback_rate * rerun)
                        for api in api_prices},
        ))
    return rows
