"""The load bench's arithmetic on hand-made timings, and the profile loop on an in-memory target."""

from __future__ import annotations

import asyncio
from itertools import pairwise

import pytest

from nowait.bench.load_metrics import RequestRecord, distribution_ms, percentile, run_duration, summarize_run
from nowait.bench.load_runner import Bounds, RunSpec, check_rates, execute, fixed_specs, sweep_rates
from nowait.bench.load_workload import LoadRequest, RoutingMetadata, corpus_documents, parse_kinds
from nowait.extraction.scorer import score_document


def record(sent: float, first: float | None, done: float, tokens: int, status: int = 200,
           target_s: float | None = 1.0, error: str | None = None) -> RequestRecord:
    return RequestRecord(target="m", sent_s=sent, first_token_s=first, done_s=done, output_tokens=tokens,
                         prompt_tokens=100, status=status, error=error, latency_target_s=target_s)


def test_percentiles_interpolate_linearly():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert distribution_ms([0.1, 0.2, 0.3]) == {"p50": 200.0, "p90": 280.0, "p99": 298.0, "mean": 200.0}
    assert distribution_ms([]) is None


def test_ttft_e2e_and_inter_token_latency_of_one_request():
    r = record(sent=1.0, first=1.2, done=2.0, tokens=9)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(1.0)
    assert r.itl_s == pytest.approx(0.8 / 8)  # eight gaps after the first of nine tokens
    assert record(0.0, 0.5, 0.5, tokens=1).itl_s is None  # one token: no gap to measure
    no_content = record(0.0, None, 0.7, tokens=0)
    assert no_content.ttft_s == pytest.approx(0.7)  # nothing streamed: the answer's end is its first token


def test_goodput_counts_answered_requests_within_their_target():
    assert record(0, 0.1, 0.9, 5, target_s=1.0).within_target
    assert not record(0, 0.1, 1.1, 5, target_s=1.0).within_target
    assert not record(0, None, 0.1, 0, status=503, error="down").within_target
    assert record(0, 0.1, 9.0, 5, target_s=None).within_target  # no target: answered is enough


def test_run_summary_on_hand_made_timings():
    records = [
        record(0.0, 0.1, 0.5, 5),   # e2e 0.5, itl 0.1
        record(0.5, 0.6, 1.5, 10),  # e2e 1.0, itl 0.1
        record(1.0, 1.2, 2.0, 9),   # e2e 1.0, itl 0.1
        record(1.5, None, 1.6, 0, status=429, error="queue full"),
    ]
    summary = summarize_run(records)
    assert run_duration(records) == pytest.approx(2.0)
    assert (summary.requests, summary.successful, summary.errors) == (4, 3, 1)
    assert summary.requests_per_s == pytest.approx(1.5)
    assert summary.output_tokens_per_s == pytest.approx(12.0)
    assert summary.mean_concurrency == pytest.approx(1.25)  # (0.5 + 1 + 1) s in flight over 2 s
    assert summary.e2e_ms["p50"] == pytest.approx(1000.0)
    assert summary.e2e_ms["mean"] == pytest.approx(2500 / 3, abs=1e-3)
    assert summary.ttft_ms["p50"] == pytest.approx(100.0)
    assert summary.ttft_ms["p99"] == pytest.approx(198.0)  # [100, 100, 200]: 100 + 0.98 x 100
    assert summary.itl_ms["p50"] == pytest.approx(100.0)
    assert summary.goodput == {"within_target": 3, "fraction": 0.75, "requests_per_s": 1.5}
    assert summary.error_examples == ["429: queue full"]
    # Lengths of the answered requests: answers of 5, 10 and 9 tokens (the 429 counts for nothing).
    assert (summary.mean_output_tokens, summary.median_output_tokens, summary.median_prompt_tokens) == (8.0, 9.0, 100.0)
    assert summarize_run(records, duration_s=4.0).requests_per_s == pytest.approx(0.75)


def test_field_accuracy_is_scored_against_the_ground_truth():
    doc = corpus_documents(1, ("kyc",), seed=5)[0]
    good = record(0, 0.1, 0.2, 3)
    good.score = score_document(doc.answer_json(), doc.fields, doc.kind)
    bad = record(0, 0.1, 0.2, 3)
    bad.score = score_document("not json", doc.fields, doc.kind)
    summary = summarize_run([good, bad])
    assert summary.accuracy["field_accuracy"] == pytest.approx(0.5)
    assert summary.accuracy["json_valid_rate"] == pytest.approx(0.5)


def test_requests_carry_schema_and_routing_metadata_as_headers():
    doc = corpus_documents(1, ("letter_of_credit",), split="test")[0]
    request = LoadRequest(doc, 128, True, RoutingMetadata(800, 0.5, "restricted", False))
    body = request.body("nowait", stream=True)
    assert body["response_format"]["json_schema"]["schema"]["type"] == "object"
    assert body["stream_options"] == {"include_usage": True} and "nowait" not in body
    assert request.metadata.headers() == {"x-nowait-latency-budget-ms": "800", "x-nowait-token-value": "0.5",
                                          "x-nowait-data-class": "restricted", "x-nowait-batchable": "false"}
    assert request.latency_target_s == pytest.approx(0.8)
    assert request.batch_line("a", "nowait")["url"] == "/v1/chat/completions"
    assert parse_kinds("kyc, loan_application") == ("kyc", "loan_application")
    with pytest.raises(ValueError, match="unknown document kind"):
        parse_kinds("passport")


class SleepyTarget:
    """Answers every request after `seconds`, with 4 tokens."""

    name, kind = "sleepy", "ar"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def send(self, request, t0):
        import time

        sent = time.perf_counter() - t0
        await asyncio.sleep(self.seconds)
        done = time.perf_counter() - t0
        return RequestRecord("sleepy", sent, done, first_token_s=sent + self.seconds / 2, output_tokens=4)


def requests():
    doc = corpus_documents(1, ("kyc",))[0]
    while True:
        yield LoadRequest(doc)


def run(spec: RunSpec, bounds: Bounds, stop_after: int | None = None, seconds: float = 0.01):
    async def go():
        stop = asyncio.Event()
        seen = []

        def on_record(r):
            seen.append(r)
            if stop_after is not None and len(seen) >= stop_after:
                stop.set()

        return await execute(SleepyTarget(seconds), spec, requests(), bounds, stop, on_record)

    return asyncio.run(go())


def test_synchronous_sends_one_at_a_time_and_stops_at_max_requests():
    result = run(RunSpec("synchronous"), Bounds(max_requests=4))
    records = sorted(result.records, key=lambda r: r.sent_s)
    assert len(records) == 4 and not result.interrupted
    assert all(later.sent_s >= earlier.done_s for earlier, later in pairwise(records))


def test_concurrent_keeps_n_in_flight():
    result = run(RunSpec("concurrent", 3.0), Bounds(max_requests=9), seconds=0.03)
    assert len(result.records) == 9
    assert result.summary.mean_concurrency > 2.0


def test_poisson_is_bounded_by_time_and_stop_ends_a_run_early():
    result = run(RunSpec("poisson", 200.0), Bounds(max_seconds=0.2))
    assert 5 < len(result.records) < 100  # ~40 expected
    assert max(r.sent_s for r in result.records) < 0.25
    stopped = run(RunSpec("concurrent", 2.0), Bounds(max_requests=1000), stop_after=3)
    assert stopped.interrupted and 3 <= len(stopped.records) < 10


def test_profile_arguments_and_sweep_rates():
    for profile, rates, message in (("poisson", [0.0], "greater than 0"), ("poisson", [], "needs --rate"),
                                    ("concurrent", [1.5], "whole numbers"), ("sweep", [1.0], "at least 2"),
                                    ("bursty", [], "unknown profile")):
        with pytest.raises(ValueError, match=message):
            check_rates(profile, rates)
    check_rates("sweep", [4.0])
    assert [s.label for s in fixed_specs("concurrent", [1, 4])] == ["concurrent@1", "concurrent@4"]
    assert fixed_specs("poisson", [2.5])[0].label == "poisson@2.5/s"
    assert sweep_rates(1.0, 4.0, 5) == [1.75, 2.5, 3.25]
    assert sweep_rates(1.0, 4.0, 2) == []
