"""`nowait bench peers`: the ratio arithmetic on hand-made timings, transformers missing, and a
short run against transformers' generate on the bundled AR weights."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from nowait.bench.peers import MISSING, PeersError, Timing, answer_ids, import_transformers, peer_ratios, summarize
from nowait.cli import app


def entry(name: str, engine: str, batch: int, p50: float) -> dict:
    return {"name": name, "engine": engine, "batch": batch, "latency_ms_p50": p50, "tokens_per_s": 0.0,
            "identical": True}


def test_ratios_are_peer_time_over_nowaits_at_the_same_batch():
    entries = [entry("nowait-ar", "nowait", 1, 100.0), entry("generate-dynamic", "transformers", 1, 150.0),
               entry("generate-static", "transformers", 1, 50.0),
               entry("nowait-continuous-batching", "nowait", 64, 200.0),
               entry("generate-dynamic", "transformers", 64, 520.0),
               entry("generate-dynamic", "transformers", 8, 90.0)]  # no nowait entry at 8: no ratio
    assert peer_ratios(entries) == {"generate-dynamic/nowait-ar@1": 1.5, "generate-static/nowait-ar@1": 0.5,
                                    "generate-dynamic/nowait-continuous-batching@64": 2.6}


def test_summary_takes_the_median_run_and_tokens_over_all_time():
    summary = summarize(Timing("nowait-ar", "nowait", 1, seconds=[0.1, 0.5, 0.2], tokens=[10, 40, 30],
                               identical=False))
    assert summary["latency_ms_p50"] == 200.0
    assert summary["tokens_per_s"] == 100.0  # 80 tokens in 0.8 s
    assert summary["identical"] is False and summary["runs"] == 3


def test_answer_stops_before_the_first_end_token():
    assert answer_ids([5, 6, 2, 7, 2], end_id=2) == [5, 6]
    assert answer_ids([5, 6], end_id=2) == [5, 6]


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it raises ImportError
    with pytest.raises(PeersError, match=r"nowait\[peers\]"):
        import_transformers()
    result = CliRunner().invoke(app, ["bench", "peers", "--n", "1", "--batches", "1"])
    assert result.exit_code == 2
    assert MISSING in result.output


def test_short_run_matches_transformers_token_for_token():
    pytest.importorskip("transformers")
    result = CliRunner().invoke(app, ["bench", "peers", "--n", "2", "--batches", "1,2", "--max-tokens", "12",
                                      "--rounds", "1", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    names = [(e["name"], e["engine"], e["batch"]) for e in report["peers"]]
    assert names == [("nowait-ar", "nowait", 1), ("generate-dynamic", "transformers", 1),
                     ("generate-static", "transformers", 1), ("nowait-continuous-batching", "nowait", 2),
                     ("generate-dynamic", "transformers", 2)]
    assert all(e["identical"] for e in report["peers"])
    assert all(e["latency_ms_p50"] > 0 and e["tokens_per_s"] > 0 for e in report["peers"])
    assert set(report["ratios"]) == {"generate-dynamic/nowait-ar@1", "generate-static/nowait-ar@1",
                                     "generate-dynamic/nowait-continuous-batching@2"}
