"""The fallback threshold chosen on held-out data: the choice on hand-made answers, `nowait
calibrate` end to end on tiny checkpoints, and the gateway picking the written threshold up."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nowait.calibration import (
    CALIBRATION_FILE,
    ScoredAnswer,
    acceptance_curve,
    calibrated_threshold,
    calibrated_thresholds,
    choose_threshold,
)
from nowait.checkpoints import save_pretrained
from nowait.cli import app
from nowait.gateway.config import parse_config
from nowait.router import DEFAULT_CONFIDENCE_THRESHOLD
from tests.conftest import build_model


def save_tiny_models(directory, codec) -> dict[str, str]:
    """An AR and a diffusion checkpoint long enough for a corpus prompt plus the answer window."""
    vocab, longer = codec.vocab_size, {"max_position": 1024}
    return {"ar": str(save_pretrained(build_model(0, vocab_size=vocab, **longer), codec, directory / "ar")),
            "diffusion": str(save_pretrained(build_model(2, vocab_size=vocab, causal=False, mask_token_id=codec.mask_id,
                                                         **longer), codec, directory / "diffusion"))}


def answers(*rows: tuple[float, int, int]) -> list[ScoredAnswer]:
    return [ScoredAnswer(confidence, correct, total) for confidence, correct, total in rows]


def test_the_curve_keeps_every_answer_at_or_above_each_threshold():
    curve = acceptance_curve(answers((0.9, 10, 10), (0.5, 5, 10), (0.9, 8, 10), (0.2, 0, 10)))
    assert curve == [(0.9, 0.5, 0.9), (0.5, 0.75, 23 / 30), (0.2, 1.0, 23 / 40)]


def test_the_lowest_threshold_that_reaches_the_target_is_chosen():
    scored = answers((0.99, 10, 10), (0.95, 10, 10), (0.8, 9, 10), (0.6, 9, 10), (0.3, 2, 10))
    choice = choose_threshold(scored, target_field_accuracy=0.95)
    # At 0.6 the kept answers score 38/40 = 0.95; adding the 0.3 answer would drop to 0.8.
    assert choice.threshold == 0.6 and choice.reached
    assert choice.acceptance_rate == 0.8 and choice.accepted_field_accuracy == pytest.approx(0.95)
    assert choice.fast_field_accuracy == pytest.approx(40 / 50)
    assert choice.routed_field_accuracy is None  # no AR answers were measured


def test_routed_accuracy_takes_the_ar_answer_below_the_threshold():
    scored = [ScoredAnswer(0.99, 10, 10, 9), ScoredAnswer(0.4, 3, 10, 10)]
    choice = choose_threshold(scored, target_field_accuracy=1.0)
    assert choice.threshold == 0.99 and choice.routed_field_accuracy == pytest.approx(20 / 20)


def test_an_unreachable_target_sends_every_answer_back():
    choice = choose_threshold(answers((0.7, 5, 10), (0.6, 6, 10)), target_field_accuracy=0.99)
    assert not choice.reached and choice.acceptance_rate == 0.0
    assert all(a.confidence < choice.threshold for a in answers((0.7, 5, 10), (0.6, 6, 10)))
    # Even answers the model was certain of go back when the target is out of reach.
    certain = choose_threshold(answers((1.0, 5, 10), (0.6, 6, 10)), target_field_accuracy=0.99)
    assert not certain.reached and certain.threshold > 1.0


def test_the_written_threshold_never_moves_past_an_answer_it_accepted():
    """Floored to six places: rounding up could drop the answer that set the cut."""
    choice = choose_threshold(answers((0.9999996, 10, 10), (0.5, 0, 10)), target_field_accuracy=1.0)
    assert choice.reached and choice.threshold <= 0.9999996
    with pytest.raises(ValueError):
        choose_threshold([], 0.9)


def test_calibrate_writes_a_threshold_the_gateway_uses(tmp_path, codec):
    models = save_tiny_models(tmp_path, codec)
    result = CliRunner().invoke(app, ["calibrate", "--model", models["diffusion"], "--ar-model", models["ar"],
                                      "--n", "3", "--batch-size", "3", "--target", "0.5", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu"
    assert report["n"] == 3 and report["structured"] is True and 0 <= report["confidence_threshold"] <= 1
    assert report["target_field_accuracy"] == 0.5 and 0 <= report["ar_field_accuracy"] <= 1
    written = tmp_path / "diffusion" / CALIBRATION_FILE
    assert report["written_to"] == str(written)
    assert calibrated_threshold(written.parent) == report["confidence_threshold"]
    # A threshold per kind of the documents decoded, keyed for the router by its schema's hash too,
    # and the confidence's discrimination per engine (None where every answer is alike).
    assert report["per_kind"] and set(report["discrimination"]) == {"diffusion", "ar"}
    by_schema, _ = calibrated_thresholds(written.parent)
    assert by_schema == {entry["schema_hash"]: entry["confidence_threshold"] for entry in report["per_kind"].values()}

    engines = {"ar": {"kind": "ar", "model": models["ar"]},
               "diffusion": {"kind": "diffusion", "model": models["diffusion"]}}
    config = parse_config({"engines": engines})
    assert config.confidence_threshold() == (report["confidence_threshold"], str(written))
    assert config.routing_policy().confidence_threshold == report["confidence_threshold"]
    # The config's own number wins; without a calibration file the default applies.
    assert parse_config({"engines": engines, "routing": {"confidence_threshold": 0.42}}
                        ).routing_policy().confidence_threshold == 0.42
    written.unlink()
    assert parse_config({"engines": engines}).confidence_threshold() == (DEFAULT_CONFIDENCE_THRESHOLD, "default")


def test_calibrate_refuses_bad_arguments(tmp_path, codec):
    models = save_tiny_models(tmp_path, codec)
    runner = CliRunner()
    for args, message in ((["--target", "1.5"], "--target"), (["--split", "train"], "unknown split"),
                          (["--model", models["ar"]], "cannot run"), (["--n", "0"], "at least 1"),
                          (["--split", "test"], "--no-write")):
        result = runner.invoke(app, ["calibrate", "--model", models["diffusion"], "--ar-model", models["ar"], *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    assert calibrated_threshold(tmp_path / "diffusion") is None


def test_calibrate_seed_draws_fresh_documents_and_records_the_seed(tmp_path, codec, monkeypatch):
    import nowait.extraction.corpus as corpus

    models = save_tiny_models(tmp_path, codec)
    drawn: list[list[str]] = []
    real = corpus.documents

    def recording(*args, **kwargs):
        docs = real(*args, **kwargs)
        drawn.append([d.doc_id for d in docs])
        return docs

    monkeypatch.setattr(corpus, "documents", recording)

    def run(*args: str) -> dict:
        result = CliRunner().invoke(app, ["calibrate", "--model", models["diffusion"], "--ar-model", models["ar"],
                                          "--n", "3", "--batch-size", "3", "--target", "0.5", "--no-write", "--json",
                                          *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])

    first, again, other, validation = run("--seed", "11"), run("--seed", "11"), run("--seed", "12"), run()
    assert first["seed"] == 11 and first["split"] is None and other["seed"] == 12
    assert validation["seed"] is None and validation["split"] == "validation"
    assert drawn[0] == drawn[1] == [d.doc_id for d in real(None, 3, seed=11)]
    assert drawn[0] != drawn[2] and drawn[0] != drawn[3] and drawn[2] != drawn[3]
    assert first == again  # the same seed, the same documents, the same result
    assert first["curve"] != other["curve"]  # other documents, other confidences
    # a seed is not the test split: choosing a threshold on it may be written
    written = CliRunner().invoke(app, ["calibrate", "--model", models["diffusion"], "--ar-model", models["ar"],
                                       "--n", "2", "--batch-size", "2", "--target", "0.5", "--split", "test",
                                       "--seed", "11", "--json"])
    assert written.exit_code == 0, written.output
    assert json.loads((tmp_path / "diffusion" / CALIBRATION_FILE).read_text())["seed"] == 11
