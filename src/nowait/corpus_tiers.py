"""The corpus tier a command reads (`--tier` of eval, calibrate, bench engines, bench load, demo).

`clean` is the corpus every split has always held; `hard` is the scanned, re-worded and packed
documents of docs/corpus.md ("The hard tier"); `mixed` is both. Every command passes its tier to
the corpus's `documents(..., tier=...)`, so clean keeps every earlier number as it was.
"""

from __future__ import annotations

from nowait.extraction import corpus
from nowait.extraction.corpus import Document, documents

DEFAULT_TIER = "clean"
TIER_HELP = "corpus tier: clean (the documents of every earlier run), hard (scanned noise, other layouts and " \
            "wordings, packets, amendments) or mixed (both)"


def tiers() -> tuple[str, ...]:
    """The tiers the corpus offers (a corpus without tiers has only the clean one)."""
    return tuple(getattr(corpus, "TIERS", (DEFAULT_TIER,)))


def check_tier(tier: str) -> str:
    """The tier, or ValueError naming the tiers there are."""
    if tier not in tiers():
        raise ValueError(f"unknown tier {tier!r}; choose one of: {', '.join(tiers())}")
    return tier


def tier_of(doc: Document) -> str:
    return getattr(doc, "tier", DEFAULT_TIER)


def tier_documents(split: str | None = "test", n: int = 100, seed: int | None = None,
                   tier: str = DEFAULT_TIER) -> list[Document]:
    """The corpus's `documents` of a tier (clean: called exactly as before tiers existed)."""
    if tier == DEFAULT_TIER:
        return documents(split, n, seed=seed)
    return documents(split, n, seed=seed, tier=check_tier(tier))
