"""The command line: eval's JSON, extract's output, and one clear line for bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nowait.checkpoints import save_pretrained
from nowait.cli import app

from .conftest import build_model, swapped_codec

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory, codec):
    """Tiny random AR, draft and diffusion checkpoints in the Hugging Face layout, and a draft
    trained with another tokenizer of the same size."""
    root = tmp_path_factory.mktemp("checkpoints")
    ar = save_pretrained(build_model(vocab_size=codec.vocab_size), codec, root / "ar")
    diffusion = save_pretrained(build_model(vocab_size=codec.vocab_size, causal=False, logits_shift=True,
                                            mask_token_id=codec.mask_id), codec, root / "diffusion")
    draft = build_model(1, vocab_size=codec.vocab_size, num_layers=1)
    return {"ar": ar, "diffusion": diffusion, "draft": save_pretrained(draft, codec, root / "draft"),
            "alien-draft": save_pretrained(draft, swapped_codec(codec), root / "alien-draft")}


def assert_one_clear_line(result, *fragments: str) -> None:
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("engine", ["ar", "diffusion"])
def test_eval_prints_one_json_object_with_the_metrics(tiny_checkpoints, engine):
    result = runner.invoke(app, ["eval", "--engine", engine, "--n", "3", "--split", "test", "--json",
                                 "--model", str(tiny_checkpoints[engine])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    for key in ("field_accuracy", "doc_accuracy", "json_valid_rate", "n", "settings", "per_kind"):
        assert key in report
    assert report["n"] == 3 and report["settings"]["engine"] == engine
    assert 0.0 <= report["field_accuracy"] <= 1.0


@pytest.mark.parametrize("flags", [["--engine", "spec", "--method", "ngram"], ["--engine", "ar", "--structured"]])
def test_eval_runs_the_ar_serving_engines(tiny_checkpoints, flags):
    result = runner.invoke(app, ["eval", *flags, "--n", "2", "--json", "--model", str(tiny_checkpoints["ar"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["n"] == 2 and "latency_ms_p50" in report and "tokens_per_forward" in report
    assert report["settings"]["structured"] == ("--structured" in flags)


@pytest.mark.parametrize("method", ["hybrid", "draft"])
def test_eval_spec_loads_the_draft_for_the_methods_that_use_it(tiny_checkpoints, method):
    result = runner.invoke(app, ["eval", "--engine", "spec", "--method", method, "--n", "1", "--json",
                                 "--model", str(tiny_checkpoints["ar"]), "--draft", str(tiny_checkpoints["draft"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert f"speculative ({method}, gamma" in report["settings"]["decoding"]
    assert report["draft_forwards_per_doc"] > 0  # the draft model did propose


def test_eval_spec_diffusion_drafts_with_the_diffusion_model(tiny_checkpoints):
    result = runner.invoke(app, ["eval", "--engine", "spec", "--method", "diffusion", "--n", "1", "--json",
                                 "--model", str(tiny_checkpoints["ar"]), "--draft", str(tiny_checkpoints["diffusion"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert "speculative (diffusion, gamma" in report["settings"]["decoding"]
    assert report["draft_forwards_per_doc"] > 0  # the diffusion model drafted
    causal = runner.invoke(app, ["eval", "--engine", "spec", "--method", "diffusion", "--n", "1",
                                 "--model", str(tiny_checkpoints["ar"]), "--draft", str(tiny_checkpoints["draft"])])
    assert_one_clear_line(causal, "causal")


def test_eval_spec_refuses_a_draft_with_another_tokenizer(tiny_checkpoints):
    alien = str(tiny_checkpoints["alien-draft"])
    result = runner.invoke(app, ["eval", "--engine", "spec", "--method", "hybrid", "--n", "1",
                                 "--model", str(tiny_checkpoints["ar"]), "--draft", alien])
    assert_one_clear_line(result, alien, "tokenizer", "--method ngram")


def test_eval_spec_rejects_an_unknown_method(tiny_checkpoints):
    result = runner.invoke(app, ["eval", "--engine", "spec", "--method", "magic",
                                 "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "unknown speculative method", "hybrid")


def test_eval_fresh_seed_is_recorded(tiny_checkpoints):
    result = runner.invoke(app, ["eval", "--n", "2", "--seed", "11", "--json", "--model", str(tiny_checkpoints["ar"])])
    assert result.exit_code == 0, result.output
    settings = json.loads(result.output.strip().splitlines()[-1])["settings"]
    assert settings["seed"] == 11 and settings["split"] is None


def test_extract_reports_how_the_answer_was_made(tiny_checkpoints, tmp_path):
    document = tmp_path / "form.txt"
    document.write_text("KYC ONBOARDING FORM\nFull name: Ada Okafor\nNationality: NG\n")
    result = runner.invoke(app, ["extract", str(document), "--json", "--model", str(tiny_checkpoints["ar"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["kind"] == "kyc" and report["engine"] == "ar"
    assert report["forwards"] >= 1 and report["prompt_tokens"] > 10


def test_unknown_engine(tiny_checkpoints):
    result = runner.invoke(app, ["eval", "--engine", "gpt", "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "unknown engine", "gpt")


def test_engine_that_cannot_run_the_model(tiny_checkpoints):
    result = runner.invoke(app, ["eval", "--engine", "diffusion", "--n", "1", "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "causal")


def test_extract_missing_file(tiny_checkpoints, tmp_path):
    result = runner.invoke(app, ["extract", str(tmp_path / "nope.txt"), "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "no such file")


def test_extract_empty_document(tiny_checkpoints, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    result = runner.invoke(app, ["extract", str(empty), "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "empty")


def test_extract_over_long_document(tiny_checkpoints, tmp_path):
    long_document = tmp_path / "long.txt"
    long_document.write_text("Full name: Ada Okafor\n" * 200)
    result = runner.invoke(app, ["extract", str(long_document), "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "tokens", "at most")


def test_missing_model_directory(tmp_path):
    result = runner.invoke(app, ["eval", "--model", str(tmp_path / "missing")])
    assert_one_clear_line(result, "no such checkpoint directory")


def test_unknown_split(tiny_checkpoints):
    result = runner.invoke(app, ["eval", "--split", "train", "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "unknown split")


@pytest.mark.parametrize(("args", "message"), [(["--prompt-isolation", "1.5"], "--prompt-isolation"),
                                               (["--minutes", "0"], "--minutes"),
                                               (["--device", "bogus"], "unknown device")])
def test_train_refuses_bad_settings_in_one_line(args, message, tmp_path):
    result = runner.invoke(app, ["train", "diffusion", *args, "--run-dir", str(tmp_path / "run"),
                                 "--out", str(tmp_path / "out")])
    assert_one_clear_line(result, message)
    assert not (tmp_path / "out").exists()


def test_extract_with_diffusion_uses_the_engines_fast_default(tiny_checkpoints, tmp_path):
    document = tmp_path / "form.txt"
    document.write_text("KYC ONBOARDING FORM\nFull name: Ada Okafor\nNationality: NG\n")
    result = runner.invoke(app, ["extract", str(document), "--json", "--engine", "diffusion",
                                 "--model", str(tiny_checkpoints["diffusion"])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert "fast default" in report["decoding"] and report["forwards"] >= 1


def test_extract_and_eval_refuse_what_they_cannot_run(tiny_checkpoints):
    result = runner.invoke(app, ["extract", "--engine", "spec", "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "unknown engine", "ar or diffusion")
    result = runner.invoke(app, ["eval", "--device", "bogus", "--n", "1", "--model", str(tiny_checkpoints["ar"])])
    assert_one_clear_line(result, "unknown device")
    result = runner.invoke(app, ["eval", "--threads", "-1", "--n", "1", "--model", str(tiny_checkpoints["ar"])])
    assert result.exit_code == 2 and "--threads" in result.output


@pytest.mark.parametrize("args", [["--steps", "0"], ["--steps", "-5"], ["--batch-size", "0"], ["--threads", "0"]])
def test_train_refuses_counts_below_one_before_any_work(args, tmp_path):
    """Checked as the options are parsed (a usage error naming the option); --steps 0 used to
    start a full default run."""
    result = runner.invoke(app, ["train", "ar", *args, "--run-dir", str(tmp_path / "run"),
                                 "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and args[0] in result.output
    assert not (tmp_path / "run").exists()
