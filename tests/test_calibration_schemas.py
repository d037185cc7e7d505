"""Thresholds per schema and per kind (issue 23, item 5): the AUROC of a confidence against "has a
wrong field" on a hand computation, per-kind choices written to calibration.json and read back
(an older file without them still loads), and the router taking the request's own threshold:
its schema's (by hash), else its kind's, else the global one."""

from __future__ import annotations

import json

import pytest

from nowait.calibration import (
    ScoredAnswer,
    auroc,
    calibrated_threshold,
    calibrated_thresholds,
    discrimination,
    low_confidence_figures,
    per_kind_thresholds,
    write_calibration,
)
from nowait.extraction.corpus import schema_for
from nowait.gateway.config import parse_config
from nowait.router import KindThreshold, RoutingPolicy, schema_hash, threshold_for
from tests.dispatch_support import FakeBackend, answer, make, make_call, run


def test_auroc_against_a_hand_computation():
    # wrong answers' confidences 0.2, 0.6; right ones' 0.5, 0.9, 0.6. Pairs (wrong, right):
    # 0.2 < all three = 3; 0.6 vs 0.5 loses (0), vs 0.9 wins (1), vs 0.6 ties (0.5) -> 4.5 / 6.
    confidences = [0.2, 0.5, 0.6, 0.9, 0.6]
    wrong = [True, False, True, False, False]
    assert auroc(confidences, wrong) == pytest.approx(4.5 / 6)
    assert auroc([0.1, 0.9], [True, False]) == 1.0 and auroc([0.9, 0.1], [True, False]) == 0.0
    assert auroc([0.3, 0.4], [False, False]) is None  # no wrong answer: nothing to discriminate


def test_discrimination_is_reported_per_engine():
    answers = [ScoredAnswer(0.9, 3, 3, 3, "kyc", 0.8), ScoredAnswer(0.4, 2, 3, 3, "kyc", 0.7),
               ScoredAnswer(0.7, 3, 3, 2, "kyc", 0.3)]
    assert discrimination(answers) == {"diffusion": 1.0, "ar": 1.0}
    assert discrimination([ScoredAnswer(0.9, 3, 3), ScoredAnswer(0.4, 2, 3)]) == {"diffusion": 1.0}


def test_low_confidence_figures_give_each_engines_recall_and_false_flags_at_the_floor():
    # Diffusion: the wrong answer at 0.4 is caught, the right ones at 0.9 and 0.3 half falsely flagged.
    # AR (fallback_fields_correct, fallback_confidence): the wrong one at 0.3 caught, right ones above.
    answers = [ScoredAnswer(0.9, 3, 3, 3, "kyc", 0.8), ScoredAnswer(0.4, 2, 3, 3, "kyc", 0.7),
               ScoredAnswer(0.3, 3, 3, 2, "kyc", 0.3)]
    report = low_confidence_figures(answers, floor=0.5)
    diffusion, ar = report["engines"]["diffusion"]["at_floor"], report["engines"]["ar"]["at_floor"]
    assert (diffusion["recall"], diffusion["false_flag_rate"], diffusion["meets_goal"]) == (1.0, 0.5, False)
    assert (ar["recall"], ar["false_flag_rate"], ar["meets_goal"]) == (1.0, 0.0, True)
    assert 0.5 in report["floors"] and report["goal"] == {"recall_at_least": 0.5, "false_flag_rate_at_most": 0.1}
    # Without AR's answers only diffusion is reported; with no wrong answer its recall is undefined.
    alone = low_confidence_figures([ScoredAnswer(0.9, 3, 3), ScoredAnswer(0.2, 3, 3)])
    assert set(alone["engines"]) == {"diffusion"} and alone["engines"]["diffusion"]["at_floor"]["recall"] is None


def test_each_kind_gets_its_own_threshold():
    answers = [ScoredAnswer(0.95, 4, 4, 4, "kyc"), ScoredAnswer(0.6, 4, 4, 4, "kyc"),
               ScoredAnswer(0.99, 4, 4, 4, "letter_of_credit"), ScoredAnswer(0.8, 1, 4, 4, "letter_of_credit")]
    kinds = per_kind_thresholds(answers, None)  # the target: AR's accuracy per kind (1.0 here)
    assert kinds["kyc"]["confidence_threshold"] == 0.6  # every kyc answer is right: keep them all
    assert kinds["letter_of_credit"]["confidence_threshold"] == 0.99  # the 0.8 answer is wrong
    assert kinds["kyc"]["schema_hash"] == schema_hash(schema_for("kyc"))
    assert kinds["kyc"]["fields"] == sorted(schema_for("kyc")["properties"]) and kinds["kyc"]["n"] == 2


def test_the_schema_hash_is_of_canonical_json():
    assert schema_hash({"a": 1, "b": [1, 2]}) == schema_hash({"b": [1, 2], "a": 1})
    assert schema_hash({"a": 1}) != schema_hash({"a": 2})


def test_per_kind_thresholds_round_trip_and_an_old_file_still_loads(tmp_path):
    kinds = per_kind_thresholds([ScoredAnswer(0.7, 4, 4, 4, "kyc"), ScoredAnswer(0.95, 4, 4, 4, "loan_application"),
                                 ScoredAnswer(0.5, 0, 4, 4, "loan_application")], None)
    write_calibration(tmp_path, {"confidence_threshold": 0.9, "per_kind": kinds})
    by_schema, by_kind = calibrated_thresholds(tmp_path)
    assert by_schema == {schema_hash(schema_for("kyc")): 0.7, schema_hash(schema_for("loan_application")): 0.95}
    assert by_kind["kyc"] == KindThreshold(threshold=0.7, fields=tuple(sorted(schema_for("kyc")["properties"])))
    assert calibrated_threshold(tmp_path) == 0.9

    write_calibration(tmp_path, {"confidence_threshold": 0.8})  # written before per-kind thresholds
    assert calibrated_thresholds(tmp_path) == ({}, {}) and calibrated_threshold(tmp_path) == 0.8
    (tmp_path / "calibration.json").write_text(json.dumps({"confidence_threshold": 0.8, "per_kind": {
        "kyc": {"confidence_threshold": "high"}, "bad": [1], "loan": {"confidence_threshold": 0.4}}}))
    assert calibrated_thresholds(tmp_path) == ({}, {})  # malformed entries are skipped
    assert calibrated_thresholds(tmp_path / "nowhere") == ({}, {})


def test_the_router_takes_the_schema_then_the_kind_then_the_global_threshold():
    kyc = schema_for("kyc")
    rules = RoutingPolicy(confidence_threshold=0.9, schema_thresholds={schema_hash(kyc): 0.3},
                          kind_thresholds={"kyc": KindThreshold(threshold=0.6, fields=tuple(kyc["properties"]))})
    assert threshold_for(kyc, rules) == (0.3, "schema")
    # The same fields in a schema of the caller's own wording: the kind's threshold.
    own = {"type": "object", "properties": {k: {"type": "string"} for k in reversed(list(kyc["properties"]))}}
    assert threshold_for(own, rules) == (0.6, "kind kyc")
    assert threshold_for({"type": "object", "properties": {"x": {}}}, rules) == (0.9, "global")
    assert threshold_for(None, rules) == (0.9, "global")


def test_the_dispatcher_falls_back_by_the_requests_threshold():
    kyc = schema_for("kyc")
    overrides = {"schema_thresholds": {schema_hash(kyc): 0.5}}
    for schema, fell_back in ((kyc, False), (None, True)):  # 0.6 passes kyc's 0.5, not the global 0.9
        fast = FakeBackend("diffusion", answer=answer("diffusion", text="{}", confidence=0.6))
        dispatcher, _, _ = make(fast, FakeBackend("ar", answer=answer("ar", confidence=0.95)), **overrides)
        outcome = run(dispatcher.complete(make_call(schema=schema)))
        assert outcome.fallback is fell_back, schema
    assert outcome.reason.endswith("diffusion confidence 0.6 is below 0.9: re-ran on ar")
    fast = FakeBackend("diffusion", answer=answer("diffusion", text="{}", confidence=0.4))
    dispatcher, _, _ = make(fast, FakeBackend("ar", answer=answer("ar", confidence=0.95)), **overrides)
    outcome = run(dispatcher.complete(make_call(schema=kyc)))
    assert "diffusion confidence 0.4 is below 0.5 (the schema's threshold)" in outcome.reason


def test_the_gateway_reads_them_from_the_fast_engines_calibration(tmp_path):
    kinds = per_kind_thresholds([ScoredAnswer(0.7, 4, 4, 4, "kyc")], None)
    write_calibration(tmp_path, {"confidence_threshold": 0.9, "per_kind": kinds})
    engines = {"ar": {"kind": "ar", "model": "ar"}, "diffusion": {"kind": "diffusion", "model": str(tmp_path)}}
    rules = parse_config({"engines": engines}).routing_policy()
    assert rules.confidence_threshold == 0.9 and threshold_for(schema_for("kyc"), rules) == (0.7, "schema")
    # The operator's own number holds for every request: no calibrated refinement under it.
    fixed = parse_config({"engines": engines, "routing": {"confidence_threshold": 0.42}}).routing_policy()
    assert threshold_for(schema_for("kyc"), fixed) == (0.42, "global")


def test_calibrate_prints_the_kinds_and_the_auroc(tmp_path, codec):
    from typer.testing import CliRunner

    from nowait.cli import app
    from tests.test_calibration import save_tiny_models

    models = save_tiny_models(tmp_path, codec)
    result = CliRunner().invoke(app, ["calibrate", "--model", models["diffusion"], "--ar-model", models["ar"],
                                      "--n", "3", "--batch-size", "3", "--target", "0.5", "--no-write"])
    assert result.exit_code == 0, result.output
    assert "low-confidence flags (n=3)" in result.output and "recall" in result.output
    assert "per kind (and its schema): kyc " in result.output and "AUROC of confidence against a wrong field: " \
                                                                  "diffusion " in result.output
