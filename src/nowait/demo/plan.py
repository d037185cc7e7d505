"""The demo's traffic: who sends what, when, with which metadata. Pure: no I/O, reproducible.

Three kinds of work, one per branch of the routing rule (docs/mission.md):

    real-time KYC       a Poisson stream of onboarding forms while the customer waits: a latency
                        budget, low token value -> the fast engine (diffusion), AR fallback
    overnight batch     letters of credit submitted once through the Batch API: batchable -> AR
                        with continuous batching
    loan decisions      a few loan files feeding a credit decision: high token value -> the
                        frontier engine (owned: restricted data never leaves)

plus a comparison stream: every k-th real-time form is also sent pinned to the batch engine
(AR), so the demo shows what the real-time route would cost in latency and dollars on AR.

Documents come from a fresh seed of the corpus (a held-out stream never seen in training) and
keep their ground truth, so every answer is scored. A share of the real-time forms
(`hard_fraction`) comes from the corpus's hard tier (scanned noise, other layouts and wordings,
packets, amendments: docs/corpus.md), where diffusion is less sure and the fallback works. All
data is `restricted`: customer documents never leave the building.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nowait.bench.load_workload import DEFAULT_MAX_TOKENS, LoadRequest, RoutingMetadata, corpus_documents
from nowait.extraction.corpus import Document
from nowait.tokenizer import document_prompt

REALTIME, COMPARISON, BATCH, LOANS = "realtime", "realtime_on_ar", "batch", "loans"
PAIRED = "/paired"  # label suffix of the real-time arrivals whose form is also pinned to AR
ROUTE_TITLES = {
    REALTIME: "real-time KYC",
    COMPARISON: "same KYC, pinned to AR",
    BATCH: "LoC batch (Batch API)",
    LOANS: "loan decisions",
}
ROUTES = tuple(ROUTE_TITLES)
# A hard-tier form's prompt (instruction and document) in characters, at most: the longest
# packets (about 1% of hard KYC forms) would leave less than the 256-token answer window of the
# demo models' 1024 positions, and the gateway would refuse them (context_length_exceeded).
# 1,450 characters kept every prompt within 760 bundled-tokenizer tokens on 5,000 forms.
HARD_FORM_MAX_PROMPT_CHARS = 1450


@dataclass(frozen=True)
class DemoPlan:
    """The knobs of the workload (the `nowait demo` options)."""

    duration_s: float = 60.0
    realtime_rate: float = 1.5  # real-time arrivals per second
    compare_every: int = 3  # every k-th real-time form is also pinned to AR; 0: never
    batch_size: int | None = None  # letters of credit in the batch; None: one per 2 s of demo
    loans: int = 4
    latency_budget_ms: float = 1000.0
    realtime_value: float = 0.5  # $/Mtok: low value
    loan_value: float = 25.0  # $/Mtok: a credit decision's tokens are worth far more
    batch_submit_at_s: float = 1.0
    seed: int = 2024  # the fresh document stream (never seen in training)
    max_tokens: int = DEFAULT_MAX_TOKENS
    hard_fraction: float = 0.3  # share of the real-time forms from the corpus's hard tier

    @property
    def batch_lines(self) -> int:
        return self.batch_size if self.batch_size is not None else max(4, round(self.duration_s / 2))


@dataclass(frozen=True)
class Arrival:
    """One interactive request: when it is sent, on which route, to which model."""

    at_s: float
    route: str
    model: str
    request: LoadRequest
    paired: bool = False  # a real-time form also sent pinned to AR: the comparison's own set

    @property
    def label(self) -> str:
        return self.route + (PAIRED if self.paired else "")


def realtime_metadata(plan: DemoPlan) -> RoutingMetadata:
    return RoutingMetadata(latency_budget_ms=plan.latency_budget_ms, token_value_usd_per_mtok=plan.realtime_value,
                           data_class="restricted", batchable=False)


def loan_metadata(plan: DemoPlan) -> RoutingMetadata:
    return RoutingMetadata(token_value_usd_per_mtok=plan.loan_value, data_class="restricted", batchable=False)


def poisson_times(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second over [0, duration)."""
    rng = np.random.default_rng(seed)
    times, now = [], 0.0
    while True:
        now += float(rng.exponential(1.0 / rate))
        if now >= duration_s:
            return times
        times.append(round(now, 4))


def fits_the_window(doc: Document) -> bool:
    return len(document_prompt(doc)) <= HARD_FORM_MAX_PROMPT_CHARS


def realtime_forms(count: int, hard_fraction: float, seed: int) -> list[Document]:
    """`count` KYC forms, round(hard_fraction x count) of them hard-tier, at places drawn from
    the seed; the clean ones are the stream's first, in order (hard_fraction 0: the forms of
    every earlier demo), the hard ones the hard stream's first that fit the answer window."""
    hard_count = round(hard_fraction * count)
    clean = corpus_documents(count - hard_count, ("kyc",), None, seed) if count > hard_count else []
    hard: list[Document] = []
    drawn = hard_count
    while len(hard) < hard_count:
        hard = [d for d in corpus_documents(drawn, ("kyc",), None, seed, tier="hard") if fits_the_window(d)]
        drawn += hard_count - len(hard)
    hard = hard[:hard_count]
    places = set(np.random.default_rng(seed + 3).permutation(count)[:hard_count].tolist())
    forms, clean_left, hard_left = [], iter(clean), iter(hard)
    for index in range(count):
        forms.append(next(hard_left) if index in places else next(clean_left))
    return forms


def schedule(plan: DemoPlan, router_model: str, ar_model: str) -> tuple[list[Arrival], list[LoadRequest]]:
    """The interactive arrivals in time order, and the batch's requests."""
    times = poisson_times(plan.realtime_rate, plan.duration_s, plan.seed) if plan.realtime_rate > 0 else []
    kyc = realtime_forms(max(1, len(times)), plan.hard_fraction, plan.seed)
    loans = corpus_documents(max(1, plan.loans), ("loan_application",), None, plan.seed + 1)
    letters = corpus_documents(plan.batch_lines, ("letter_of_credit",), None, plan.seed + 2)
    arrivals: list[Arrival] = []
    meta = realtime_metadata(plan)
    for index, at in enumerate(times):
        request = LoadRequest(kyc[index % len(kyc)], plan.max_tokens, True, meta)
        paired = bool(plan.compare_every) and index % plan.compare_every == 0
        arrivals.append(Arrival(at, REALTIME, router_model, request, paired))
        if paired:
            # The same form, the same metadata, the same moment: only the engine differs.
            arrivals.append(Arrival(at, COMPARISON, ar_model, request))
    for index in range(plan.loans):
        at = round(plan.duration_s * (index + 0.5) / plan.loans, 4)
        arrivals.append(Arrival(at, LOANS, router_model, LoadRequest(loans[index], plan.max_tokens, True,
                                                                     loan_metadata(plan))))
    batch = [LoadRequest(doc, plan.max_tokens, True) for doc in letters]
    return sorted(arrivals, key=lambda a: a.at_s), batch
