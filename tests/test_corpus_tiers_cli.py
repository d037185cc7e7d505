"""`--tier` on calibrate, bench engines and bench load (eval's is in test_routed_eval.py): the
tier reaches the corpus, the JSON says which, and mixed documents report per tier."""

from __future__ import annotations

import inspect
import json

import pytest
import yaml
from typer.testing import CliRunner

from nowait.bench.load import load, settings_from_arguments
from nowait.bench.load_session import LoadSession
from nowait.cli import app
from nowait.corpus_tiers import check_tier
from nowait.evaluation import scored_summary
from nowait.extraction.corpus import HELD_OUT_LAYOUTS, documents
from tests.load_support import save_corpus_models

runner = CliRunner()
# `bench load`'s arguments as the command passes them: its defaults, an in-process AR engine
LOAD_DEFAULTS = {name: (None if param.default.default is ... else param.default.default)
                 for name, param in inspect.signature(load).parameters.items()} | {"engine": "ar"}


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec):
    return save_corpus_models(tmp_path_factory.mktemp("tier-models"), codec, diffusion=True)


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_the_summary_of_mixed_documents_has_one_entry_per_tier():
    docs = documents("test", 6, tier="mixed")
    texts = [d.answer_json() if d.tier == "clean" else "not json" for d in docs]
    summary = scored_summary(texts, docs)
    assert summary["per_tier"]["clean"]["field_accuracy"] == 1.0
    assert summary["per_tier"]["hard"]["field_accuracy"] == 0.0
    assert set(summary["per_tier"]["hard"]["per_kind"]) == {"kyc", "letter_of_credit", "loan_application"}
    assert "per_tier" not in scored_summary(texts[:1], docs[:1])  # one tier: the summary is that tier's
    with pytest.raises(ValueError, match="unknown tier 'glossy'"):
        check_tier("glossy")


def test_hard_documents_are_also_scored_over_held_out_and_training_layouts():
    docs = documents("test", 30, tier="hard")  # 40% of the test split's hard documents are held-out layouts
    held_out = [d.layout in HELD_OUT_LAYOUTS for d in docs]
    assert any(held_out) and not all(held_out)
    texts = [d.answer_json() if out else "not json" for d, out in zip(docs, held_out, strict=True)]
    layouts = scored_summary(texts, docs)["hard_layouts"]
    assert layouts["held_out"]["field_accuracy"] == 1.0 and layouts["training"]["field_accuracy"] == 0.0
    assert layouts["held_out"]["n"] == sum(held_out)
    validation = documents("validation", 6, tier="hard")  # training layouts only: no empty group
    assert set(scored_summary(["not json"] * 6, validation)["hard_layouts"]) == {"training"}
    assert "hard_layouts" not in scored_summary(["not json"] * 2, documents("test", 2))  # clean: none


def test_calibrate_reads_the_tier_and_reports_each(models):
    result = runner.invoke(app, ["calibrate", "--model", str(models / "diffusion"), "--ar-model", str(models / "ar"),
                                 "--n", "4", "--batch-size", "4", "--target", "0.5", "--no-write", "--tier", "mixed",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    assert report["tier"] == "mixed" and {t: e["n"] for t, e in report["per_tier"].items()} == {"clean": 2, "hard": 2}
    assert all(0 <= e["acceptance_rate"] <= 1 for e in report["per_tier"].values())
    assert all(e["low_confidence"]["engines"]["ar"]["n"] == 2 for e in report["per_tier"].values())
    refused = runner.invoke(app, ["calibrate", "--model", str(models / "diffusion"), "--ar-model",
                                  str(models / "ar"), "--tier", "glossy", "--no-write"])
    assert refused.exit_code != 0 and "unknown tier 'glossy'" in refused.output


def test_bench_engines_reads_the_tier(models):
    result = runner.invoke(app, ["bench", "engines", "--only", "ar", "--n", "2", "--tier", "mixed", "--json",
                                 "--ar-model", str(models / "ar"), "--host-budget", "0.05"])
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    assert report["tier"] == "mixed" and set(report["engines"][0]["per_tier"]) == {"clean", "hard"}


def test_bench_load_sends_documents_of_the_tier(models, tmp_path):
    config = {"server": {"torch_threads": 1}, "engines": {"ar": {"kind": "ar", "model": str(models / "ar")}},
              "routing": {"fast_engine": None}, "data_dir": str(tmp_path / "data")}
    (tmp_path / "nowait.yaml").write_text(yaml.safe_dump(config))
    result = runner.invoke(app, ["bench", "load", "--engine", "ar", "--config", str(tmp_path / "nowait.yaml"),
                                 "--max-requests", "2", "--max-tokens", "4", "--kinds", "kyc", "--tier", "hard",
                                 "--no-warmup", "--json"])
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    assert report["tier"] == "hard" and report["runs"][0]["successful"] == 2
    session = LoadSession(settings_from_arguments(**{**LOAD_DEFAULTS, "tier": "hard", "kinds": "kyc"}))
    sent = session.documents()
    assert {d.tier for d in sent} == {"hard"} and {d.kind for d in sent} == {"kyc"}
    assert {d.tier for d in LoadSession(settings_from_arguments(**LOAD_DEFAULTS)).documents()} == {"clean"}
