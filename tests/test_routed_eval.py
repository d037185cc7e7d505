"""`nowait eval --engine routed`: the gateway's fallback rule, thresholds, floors and prices on
held-out documents, with stand-in engines whose answers and confidences the test sets, and once
through the CLI on the bundled demo models."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from nowait.cli import app
from nowait.engines.base import Completion, Timings
from nowait.extraction.corpus import documents, schema_for
from nowait.gateway.ledger import owned_cost_usd
from nowait.routed_eval import RoutedEngine, low_confidence_figures, route_documents, routed_metrics
from nowait.router import RoutingPolicy, schema_hash

runner = CliRunner()
PRICE = {"diffusion": 36.0, "ar": 72.0}  # $/h: a second of each is $0.01 and $0.02
SECONDS = {"diffusion": 0.01, "ar": 0.05}


class StandIn:
    """An engine that answers each document with its ground truth (or `text`), at a set confidence."""

    def __init__(self, name: str, docs, confidence: float, text: str | None = None) -> None:
        self.name, self.confidence, self.text = name, confidence, text
        self.truth = {d.doc_id: d.answer_json() for d in docs}
        self.calls = 0

    def generate(self, requests):
        self.calls += len(requests)
        return [Completion(request_id=r.request_id, engine=self.name, token_ids=[1, 2], text=self.text
                           if self.text is not None else self.truth[r.request_id], finish_reason="stop",
                           prompt_tokens=len(r.prompt_ids), confidence=self.confidence, forwards=3,
                           timings=Timings(total_s=SECONDS[self.name])) for r in requests]


def engines(docs, fast_confidence=0.95, fallback_confidence=0.99, fast_text=None):
    fast = StandIn("diffusion", docs, fast_confidence, fast_text)
    fallback = StandIn("ar", docs, fallback_confidence)
    return (RoutedEngine("diffusion", fast, PRICE["diffusion"], "diffusion"),
            RoutedEngine("ar", fallback, PRICE["ar"], "ar"), fast, fallback)


def routed(docs, codec, policy, structured=False, **stand_ins):
    fast, fallback, fast_engine, fallback_engine = engines(docs, **stand_ins)
    answers = route_documents(docs, codec, fast, fallback, policy, structured)
    return routed_metrics(answers, docs), fast_engine, fallback_engine


def test_a_threshold_under_every_confidence_keeps_every_answer_on_diffusion(codec):
    docs = documents("test", 6)
    result, fast, fallback = routed(docs, codec, RoutingPolicy(confidence_threshold=0.0))
    assert result["kept_on_diffusion"] == 1.0 and result["fallback_rate"] == 0.0
    assert fast.calls == 6 and fallback.calls == 0
    assert result["field_accuracy"] == 1.0 and result["answered_by"] == {"diffusion": 6}
    assert result["latency_ms_p50"] == pytest.approx(10.0)
    assert result["usd_per_request"] > 0
    assert result["usd_per_request"] == pytest.approx(owned_cost_usd(0.01, PRICE["diffusion"]))
    assert result["busy_s"] == {"diffusion": pytest.approx(0.06)}
    assert result["threshold_sources"] == {"global": 6}


def test_a_threshold_over_every_confidence_sends_every_answer_to_ar_and_pays_both(codec):
    docs = documents("test", 6)
    result, fast, fallback = routed(docs, codec, RoutingPolicy(confidence_threshold=2.0))
    assert result["kept_on_diffusion"] == 0.0 and result["fallback_rate"] == 1.0
    assert result["fallback_causes"] == {"confidence": 6} and result["answered_by"] == {"ar": 6}
    assert fast.calls == 6 and fallback.calls == 6
    assert result["latency_ms_p50"] == pytest.approx(60.0)  # diffusion's time plus AR's
    both = owned_cost_usd(0.01, PRICE["diffusion"]) + owned_cost_usd(0.05, PRICE["ar"])
    assert result["usd_per_request"] == pytest.approx(both)
    assert result["per_kind"]["kyc"]["kept_on_diffusion"] == 0.0


def test_an_answer_that_is_not_json_falls_back_whatever_its_confidence(codec):
    docs = documents("test", 3)
    result, _, _ = routed(docs, codec, RoutingPolicy(confidence_threshold=0.0), fast_text='{"name": ')
    assert result["fallback_causes"] == {"invalid_output": 3}
    assert result["field_accuracy"] == 1.0 and result["diffusion_field_accuracy"] < 1.0


def test_the_kept_answer_below_its_engines_floor_is_flagged(codec):
    docs = documents("test", 4)
    policy = RoutingPolicy(confidence_threshold=2.0, confidence_floors={"ar": 0.5})
    low, _, _ = routed(docs, codec, policy, fallback_confidence=0.3)
    sure, _, _ = routed(docs, codec, policy, fallback_confidence=0.6)
    assert low["low_confidence_flags"] == 4 and sure["low_confidence_flags"] == 0


def test_low_confidence_figures_judge_each_engines_answers_and_the_returned_ones(codec):
    docs = documents("test", 4)
    floors = {"diffusion": 0.5, "ar": 0.7}
    policy = RoutingPolicy(confidence_threshold=2.0, confidence_floors=floors)
    fast, fallback, _, _ = engines(docs, fast_confidence=0.3, fallback_confidence=0.6, fast_text='{"name": ')
    answers = route_documents(docs, codec, fast, fallback, policy)
    report = low_confidence_figures(answers, docs, "diffusion", floors)
    diffusion, ar, returned = report["engines"]["diffusion"], report["engines"]["ar"], report["routed"]
    # Diffusion's broken answers are all wrong and all below 0.5: every one caught.
    assert diffusion["at_floor"]["recall"] == 1.0 and diffusion["at_floor"]["false_flag_rate"] is None
    # AR's re-runs are all right, yet at 0.6 below AR's 0.7: every one a false flag, no recall to speak of.
    assert ar["n"] == 4 and ar["at_floor"]["false_flag_rate"] == 1.0 and ar["at_floor"]["recall"] is None
    at_floor = returned["at_floor"]
    assert at_floor["wrong_flagged"] + at_floor["correct_flagged"] == routed_metrics(answers, docs)[
        "low_confidence_flags"] == 4
    assert [r["correct_flagged"] for r in returned["sweep"] if r["floor"] in (0.6, 0.7)] == [0, 4]
    sure_fast, sure_fallback, _, _ = engines(docs)  # right answers at 0.95: none falls back
    kept = route_documents(docs, codec, sure_fast, sure_fallback, RoutingPolicy(confidence_threshold=0.0))
    assert low_confidence_figures(kept, docs, "diffusion", floors)["engines"]["ar"]["n"] == 0  # AR never ran


def test_a_schemas_own_threshold_decides_for_its_kind(codec):
    docs = documents("test", 6)
    policy = RoutingPolicy(confidence_threshold=0.0, schema_thresholds={schema_hash(schema_for("kyc")): 2.0})
    result, _, _ = routed(docs, codec, policy, structured=True)
    assert result["per_kind"]["kyc"]["kept_on_diffusion"] == 0.0
    assert result["per_kind"]["letter_of_credit"]["kept_on_diffusion"] == 1.0
    assert result["threshold_sources"] == {"schema": 2, "global": 4}  # only kyc's schema has its own


def test_mixed_documents_report_the_route_per_tier(codec):
    docs = documents("test", 12, tier="mixed")
    result, _, _ = routed(docs, codec, RoutingPolicy(confidence_threshold=0.0))
    assert set(result["per_tier"]) == {"clean", "hard"}
    assert sum(entry["n"] for entry in result["per_tier"].values()) == 12
    assert all("kept_on_diffusion" in entry and "per_kind" in entry for entry in result["per_tier"].values())


def eval_routed(*flags: str) -> dict:
    result = runner.invoke(app, ["eval", "--engine", "routed", "--n", "3", "--json", "--threads", "1", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_eval_routed_on_the_bundled_models_falls_back_as_the_threshold_says(tmp_path):
    everything = eval_routed("--threshold", "2")
    assert everything["kept_on_diffusion"] == 0.0 and everything["answered_by"] == {"ar": 3}
    assert everything["tier"] == "clean" and everything["settings"]["engine"] == "routed"
    assert everything["usd_per_request"] > 0 and everything["latency_ms_p50"] > 0
    assert set(everything["busy_s"]) == {"diffusion", "ar"}
    flags = everything["low_confidence"]
    assert set(flags["engines"]) == {"diffusion", "ar"} and flags["routed"]["n"] == 3
    assert flags["routed"]["floor"] == everything["settings"]["confidence_floors"]
    at_floor = flags["routed"]["at_floor"]
    assert at_floor["wrong_flagged"] + at_floor["correct_flagged"] == everything["low_confidence_flags"]
    config = tmp_path / "nowait.yaml"
    config.write_text(yaml.safe_dump({"routing": {"confidence_threshold": 0.0}}))
    nothing = eval_routed("--config", str(config), "--structured")  # template answers are schema-valid JSON
    assert nothing["kept_on_diffusion"] == 1.0 and nothing["answered_by"] == {"diffusion": 3}
    assert nothing["settings"]["confidence_threshold_source"] == "routing.confidence_threshold"


def test_eval_routed_on_mixed_documents_reports_the_flags_per_tier_and_keeps_the_tier():
    result = eval_routed("--tier", "mixed", "--threshold", "0")
    assert result["tier"] == "mixed" and set(result["per_tier"]) == {"clean", "hard"}
    assert sum(e["low_confidence"]["routed"]["n"] for e in result["per_tier"].values()) == 3


def test_eval_routed_prints_the_low_confidence_table():
    result = runner.invoke(app, ["eval", "--engine", "routed", "--n", "1", "--threads", "1", "--threshold", "2"])
    assert result.exit_code == 0, result.output
    assert "low-confidence flags" in result.output and "returned" in result.output and "recall" in result.output


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--engine", "routed", "--tau", "0.9"], "do not apply to --engine routed"),
    (["--engine", "ar", "--threshold", "0.5"], "apply to --engine routed only"),
    (["--engine", "ar", "--tier", "glossy"], "unknown tier 'glossy'"),
])
def test_eval_refuses_flags_that_do_not_fit_in_one_line(flags, fragment):
    result = runner.invoke(app, ["eval", *flags, "--n", "1"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert fragment in result.output
