"""The arithmetic of a load test: per-request timings in, the figures guidellm reports out.

Every request of a run becomes one `RequestRecord` (times in seconds since the run started, as
the client saw them); `summarize_run` turns a run's records into its figures. Definitions
(docs/bench.md repeats them):

    TTFT            first content token received - request sent
    e2e             last byte of the answer received - request sent
    ITL             (e2e - TTFT) / (output tokens - 1), per request with at least 2 output tokens
                    (the mean gap between tokens after the first, as guidellm and vLLM define it)
    output tok/s    output tokens of successful requests / run duration
    requests/s      successful requests / run duration
    goodput         successful requests whose e2e is within their latency target (count, share of
                    all requests sent, and per second)
    concurrency     mean requests in flight = sum of e2e / run duration (Little's law)
    run duration    first request sent -> last request finished

Percentiles interpolate linearly between order statistics (numpy's default), so p50 of 1..100
is 50.5. Output tokens are the server's count (`usage`), not the number of stream chunks: a
diffusion engine sends a whole block per chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from nowait.extraction.scorer import DocumentScore, summarize

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class EngineRun:
    """One engine's part in answering a request (the gateway's `nowait.engines_tried`, or the
    in-process attempt): what the planner profile is derived from."""

    engine: str
    seconds: float  # engine side: submission to answer
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forwards: int | None = None
    outcome: str = ""


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the run started."""

    target: str  # the model the client asked for (an engine name, or the router's model)
    sent_s: float
    done_s: float
    first_token_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    status: int = 200  # HTTP status; 0 when the transport failed
    error: str | None = None
    engine: str | None = None  # the engine that produced the answer (x-nowait-route), when known
    rule: str | None = None  # the routing rule that decided (nowait gateway)
    fallback: bool = False
    low_confidence: bool = False  # the gateway flagged the answer as below its engine's floor
    cost_usd: float | None = None
    attempts: tuple[EngineRun, ...] = ()
    latency_target_s: float | None = None
    score: DocumentScore | None = None
    label: str = ""  # a caller's grouping (the demo's route names)
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from the server's prefix cache (usage says so)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def ttft_s(self) -> float:
        """Time to the first content token; a request that produced no content counts its e2e."""
        first = self.first_token_s if self.first_token_s is not None else self.done_s
        return first - self.sent_s

    @property
    def itl_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def within_target(self) -> bool:
        """Answered, and in time (a request without a target is in time when answered)."""
        if not self.ok:
            return False
        return self.latency_target_s is None or self.e2e_s <= self.latency_target_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not len(values):
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def distribution_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """p50/p90/p99 and mean of second-valued samples, in milliseconds; None for no samples."""
    if not len(values_s):
        return None
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"p{q}": round(float(np.percentile(ms, q)), 3) for q in PERCENTILES}
    out["mean"] = round(float(ms.mean()), 3)
    return out


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First request sent to last request finished (0 for no records)."""
    if not records:
        return 0.0
    return max(r.done_s for r in records) - min(r.sent_s for r in records)


def accuracy(scores: Iterable[DocumentScore | None]) -> dict[str, float] | None:
    """Field accuracy, document accuracy and JSON validity against the ground truth; None when
    nothing was scored (a workload without ground truth, or no successful request)."""
    scored = [s for s in scores if s is not None]
    if not scored:
        return None
    summary = summarize(scored)
    return {key: round(float(summary[key]), 4) for key in
            ("field_accuracy", "doc_accuracy", "json_valid_rate")}


@dataclass
class RunSummary:
    """The aggregated figures of one run (one profile point against one target)."""

    requests: int
    successful: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    mean_concurrency: float
    ttft_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    e2e_ms: dict[str, float] | None
    goodput: dict[str, float]
    accuracy: dict[str, float] | None
    mean_prompt_tokens: float
    mean_cached_prompt_tokens: float  # of those, restored from a prefix cache, as the server reported
    mean_output_tokens: float
    # Medians: the lengths of a request at the e2e p50 when lengths drive the latency (batch 1),
    # which `nowait plan --check` predicts for.
    median_prompt_tokens: float
    median_output_tokens: float
    error_examples: list[str] = field(default_factory=list)
    engines: dict[str, int] = field(default_factory=dict)  # answering engine -> requests

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def summarize_run(records: Sequence[RequestRecord], duration_s: float | None = None) -> RunSummary:
    """A run's figures (module docstring); `duration_s` overrides the span of the records."""
    ok = [r for r in records if r.ok]
    duration = run_duration(records) if duration_s is None else duration_s
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    in_time = sum(r.within_target for r in records)
    itls = [r.itl_s for r in ok if r.itl_s is not None]
    engines: dict[str, int] = {}
    for r in ok:
        name = r.engine or r.target
        engines[name] = engines.get(name, 0) + 1
    errors = [r for r in records if not r.ok]
    return RunSummary(
        requests=len(records), successful=len(ok), errors=len(errors), duration_s=round(duration, 4),
        requests_per_s=round(per_s(len(ok)), 4),
        output_tokens_per_s=round(per_s(sum(r.output_tokens for r in ok)), 3),
        mean_concurrency=round(per_s(sum(r.e2e_s for r in ok)), 3),
        ttft_ms=distribution_ms([r.ttft_s for r in ok]), itl_ms=distribution_ms(itls),
        e2e_ms=distribution_ms([r.e2e_s for r in ok]),
        goodput={"within_target": in_time, "fraction": round(in_time / len(records), 4) if records else 0.0,
                 "requests_per_s": round(per_s(in_time), 4)},
        accuracy=accuracy(r.score for r in ok),
        mean_prompt_tokens=round(float(np.mean([r.prompt_tokens for r in ok])), 2) if ok else 0.0,
        mean_cached_prompt_tokens=round(float(np.mean([r.cached_prompt_tokens for r in ok])), 2) if ok else 0.0,
        mean_output_tokens=round(float(np.mean([r.output_tokens for r in ok])), 2) if ok else 0.0,
        median_prompt_tokens=float(np.median([r.prompt_tokens for r in ok])) if ok else 0.0,
        median_output_tokens=float(np.median([r.output_tokens for r in ok])) if ok else 0.0,
        error_examples=list(dict.fromkeys(f"{r.status}: {r.error}" for r in errors))[:3],
        engines=engines,
    )
