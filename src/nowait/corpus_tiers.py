"""The corpus tier a command reads: `--tier` of eval, calibrate, bench engines, bench load.

`clean` is the corpus every split has always held; `hard` the scanned, re-worded and packed
documents of docs/corpus.md ("Tiers"); `mixed` both. Each command checks its tier here (one
clear line before any model loads) and passes it to `documents(..., tier=...)`, so clean keeps
every earlier number as it was.
"""

from __future__ import annotations

from nowait.extraction.corpus import TIERS

TIER_HELP = ("corpus tier: clean (the documents of every earlier run), hard (scanned noise, other layouts and "
             "wordings, packets, amendments) or mixed (both)")


def check_tier(tier: str) -> str:
    """The tier, or ValueError naming the tiers there are."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of: {', '.join(TIERS)}")
    return tier
