"""`nowait bench engines` and `nowait eval --engine diffusion` on tiny checkpoints (smoke runs)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nowait.bench.engines import DEFAULT_ENTRIES, ENTRIES, BenchContext, ratios, register_entry, run_bench
from nowait.checkpoints import save_pretrained
from nowait.cli import app
from nowait.extraction.corpus import documents

from .conftest import build_model, swapped_codec

runner = CliRunner()
EVAL_FIELDS = ("field_accuracy", "doc_accuracy", "json_valid_rate", "forwards_per_doc", "tokens_per_forward",
               "latency_ms_p50", "latency_ms_p95")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("bench")
    ar = save_pretrained(build_model(vocab_size=codec.vocab_size, max_position=1024), codec, root / "ar")
    diffusion = save_pretrained(build_model(vocab_size=codec.vocab_size, causal=False, logits_shift=True,
                                            mask_token_id=codec.mask_id, max_position=1024), codec, root / "diffusion")
    return {"ar": str(ar), "diffusion": str(diffusion)}


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_bench_engines_runs_every_configuration_on_the_same_documents(checkpoints):
    result = runner.invoke(app, ["bench", "engines", "--n", "1", "--json", "--ar-model", checkpoints["ar"],
                                 "--diffusion-model", checkpoints["diffusion"]])
    assert result.exit_code == 0, result.output
    report = last_json(result.output)
    assert [e["name"] for e in report["engines"]] == list(DEFAULT_ENTRIES)
    for entry in report["engines"]:
        assert all(field in entry for field in EVAL_FIELDS), entry["name"]
        assert entry["n"] == 1
    by_name = {e["name"]: e for e in report["engines"]}
    assert by_name["diffusion-reference"]["tokens_per_forward"] <= 1.0  # one position per forward
    assert by_name["diffusion-structured"]["json_valid_rate"] == 1.0  # valid by construction
    assert set(report["ratios"]["latency_p50"]) == {f"{name}/diffusion" for name in DEFAULT_ENTRIES
                                                    if name != "diffusion"}
    assert by_name["spec"]["greedy_identical_to_ar"] is True  # speculation never changes greedy output
    assert report["settings"]["batch_size"] == 1
    head_to_head = by_name["diffusion"]["vs_ar_interleaved"]  # the same two decodes, taking turns
    assert head_to_head["speedup_p50_vs_ar"] == pytest.approx(
        head_to_head["ar_latency_ms_p50"] / head_to_head["diffusion_latency_ms_p50"], rel=0.01)


def test_bench_cache_modes_takes_turns_on_each_document(checkpoints):
    from nowait.bench.cache_modes import CACHE_CONFIGS, DEFAULT_CONFIG

    result = runner.invoke(app, ["bench", "cache-modes", "--n", "2", "--json", "--model", checkpoints["diffusion"]])
    assert result.exit_code == 0, result.output
    report = last_json(result.output)
    names = [m["name"] for m in report["modes"]]
    assert names[0] == DEFAULT_CONFIG and sorted(names) == sorted(CACHE_CONFIGS)
    for mode in report["modes"]:
        assert all(field in mode for field in EVAL_FIELDS if field != "doc_accuracy"), mode["name"]
    assert report["modes"][0]["latency_ratio_median"] == 1.0  # the default against itself
    refused = runner.invoke(app, ["bench", "cache-modes", "--n", "1", "--model", checkpoints["ar"]])
    assert refused.exit_code != 0 and "AR model" in refused.output and "Traceback" not in refused.output


def test_bench_engines_fails_clearly(checkpoints, tmp_path):
    result = runner.invoke(app, ["bench", "engines", "--n", "1", "--only", "diffusion",
                                 "--diffusion-model", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "diffusion model" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["bench", "engines", "--n", "1", "--only", "warp-drive"])
    assert result.exit_code != 0 and "unknown entry warp-drive" in result.output


def test_spec_entry_refuses_a_draft_with_another_tokenizer(checkpoints, tmp_path, codec):
    """A --draft-model that does not fit the target stops the bench with the reason; the bundled
    draft that no longer fits the bundled AR model is left out, and prompt lookup still runs."""
    from nowait.checkpoints import load_pretrained

    alien = save_pretrained(build_model(1, vocab_size=codec.vocab_size, num_layers=1, max_position=1024),
                            swapped_codec(codec), tmp_path / "alien")
    result = runner.invoke(app, ["bench", "engines", "--n", "1", "--only", "spec", "--ar-model", checkpoints["ar"],
                                 "--draft-model", str(alien)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "tokenizer" in result.output and "alien" in result.output, result.output
    ctx = BenchContext(docs=documents("test", 1))  # no paths: the bundled pair, stood in for by these
    ctx._loaded.update(ar=load_pretrained(checkpoints["ar"]), draft=load_pretrained(alien))
    entry = ENTRIES["spec"](ctx)
    assert "tokenizer" in entry["draft_refused"] and set(entry["methods"]) == {"ngram"}


def test_fallback_entry_verifies_the_diffusion_answer_instead_of_decoding(checkpoints, tmp_path, codec):
    result = runner.invoke(app, ["bench", "engines", "--n", "2", "--only", "fallback", "--json",
                                 "--ar-model", checkpoints["ar"], "--diffusion-model", checkpoints["diffusion"]])
    assert result.exit_code == 0, result.output
    [entry] = last_json(result.output)["engines"]
    assert all(field in entry for field in EVAL_FIELDS)
    assert entry["verifier"] == "diffusion" and set(entry["verifiers"]) == {"diffusion"}  # no draft model named
    verified = entry["verifiers"]["diffusion"]
    assert verified["greedy_identical_to_ar"] and verified["answer_gamma"] == 64
    assert verified["draft_forwards_per_doc"] == 0  # the answer came with the request: nothing drafted
    assert entry["ar"]["forwards_per_doc"] > 0
    alien = save_pretrained(build_model(2, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id),
                            swapped_codec(codec), tmp_path / "alien-diffusion")
    refused = runner.invoke(app, ["bench", "engines", "--n", "1", "--only", "fallback", "--ar-model",
                                  checkpoints["ar"], "--diffusion-model", str(alien)])
    assert refused.exit_code != 0 and "tokenizer" in refused.output and "Traceback" not in refused.output


def test_routed_entry_falls_back_by_the_calibrated_threshold(tmp_path, codec):
    """The diffusion answers the route starts from, decoded here as the route asks for them; a
    threshold written beside the model between their confidences: every answer below it must fall
    back for its confidence, every other one is kept only if it is a JSON object."""
    from nowait.calibration import CALIBRATION_FILE
    from nowait.engines.base import GenerationRequest, SamplingParams
    from nowait.engines.config import DiffusionEngineConfig
    from nowait.engines.factory import build_engine
    from nowait.evaluation import ANSWER_WINDOW
    from nowait.tokenizer import document_prompt

    # Long enough for a hard document's prompt in the test tokenizer's ids (up to ~950) and its answer.
    longer = {"vocab_size": codec.vocab_size, "max_position": 2048}
    ar = save_pretrained(build_model(**longer), codec, tmp_path / "ar")
    model = save_pretrained(build_model(**longer, causal=False, logits_shift=True, mask_token_id=codec.mask_id),
                            codec, tmp_path / "diffusion")
    docs = documents("test", 4, tier="mixed")
    built = build_engine(DiffusionEngineConfig(kind="diffusion", model=str(model)))
    answers = [built.engine.generate([GenerationRequest(built.codec.encode(document_prompt(d)),
                                                        SamplingParams(max_tokens=ANSWER_WINDOW),
                                                        request_id=d.doc_id)])[0] for d in docs]
    confidences = sorted({a.confidence for a in answers})
    assert len(confidences) >= 3, confidences  # the tiny model's answers differ in confidence
    threshold = (confidences[1] + confidences[2]) / 2
    (model / CALIBRATION_FILE).write_text(json.dumps({"confidence_threshold": threshold}))

    def is_object(text: str) -> bool:
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False

    below = sum(a.confidence < threshold for a in answers)
    kept = sum(a.confidence >= threshold and is_object(a.text) for a in answers)
    result = runner.invoke(app, ["bench", "engines", "--n", "4", "--tier", "mixed", "--only", "routed", "--json",
                                 "--host-budget", "0.05", "--ar-model", str(ar), "--diffusion-model", str(model)])
    assert result.exit_code == 0, result.output
    report = last_json(result.output)
    [entry] = report["engines"]
    assert all(field in entry for field in EVAL_FIELDS) and entry["tier"] == "mixed" == report["tier"]
    assert entry["routed_settings"]["confidence_threshold"] == threshold
    assert entry["routed_settings"]["confidence_threshold_source"].endswith(CALIBRATION_FILE)
    assert entry["kept_on_diffusion"] == pytest.approx(kept / 4, abs=1e-4)
    assert entry["fallback_causes"].get("confidence", 0) == below >= 2
    assert entry["fallback_causes"].get("invalid_output", 0) == 4 - below - kept
    assert entry["answered_by"].get("ar", 0) == 4 - kept
    assert set(entry["per_tier"]) == {"clean", "hard"}
    assert entry.get("compute_floor_ms") is None  # two engines taking turns: no one model's floor


def test_registry_takes_new_entries(checkpoints):
    @register_entry("fake")
    def fake(ctx: BenchContext) -> dict:
        return {"field_accuracy": 0.5, "latency_ms_p50": 30.0, "docs": len(ctx.docs)}

    try:
        ctx = BenchContext(docs=documents("test", 2), model_paths=checkpoints)
        report = run_bench(ctx, ["fake"])
        assert report["engines"] == [{"name": "fake", "field_accuracy": 0.5, "latency_ms_p50": 30.0, "docs": 2}]
    finally:
        ENTRIES.pop("fake")


def test_ratios_compare_with_the_fast_default():
    entries = [{"name": "ar", "latency_ms_p50": 300.0, "field_accuracy": 0.9},
               {"name": "diffusion", "latency_ms_p50": 100.0, "field_accuracy": 0.88}]
    assert ratios(entries) == {"latency_p50": {"ar/diffusion": 3.0}, "field_accuracy": {"diffusion/ar": 0.9778}}
    assert ratios(entries[:1]) == {"latency_p50": {}, "field_accuracy": {}}


@pytest.mark.parametrize("flags", [
    [],
    ["--policy", "fixed", "--cache", "none", "--block", "32"],
    ["--policy", "factor", "--cache", "prefix", "--structured"],
])
def test_eval_diffusion_reports_speed_fields_and_settings(checkpoints, flags):
    result = runner.invoke(app, ["eval", "--engine", "diffusion", "--n", "2", "--batch-size", "2", "--json",
                                 "--model", checkpoints["diffusion"], *flags])
    assert result.exit_code == 0, result.output
    report = last_json(result.output)
    assert all(field in report for field in EVAL_FIELDS)
    settings = report["settings"]
    assert settings["structured"] == ("--structured" in flags)
    if flags:
        assert settings["policy"] == flags[1] and settings["cache"] == flags[3]
    if "--structured" in flags:
        assert report["json_valid_rate"] == 1.0


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--engine", "diffusion", "--tau", "1.5"], "tau"),
    (["--engine", "diffusion", "--block", "0"], "block"),
    (["--engine", "diffusion", "--cache", "everything"], "cache"),
    (["--engine", "diffusion", "--policy", "random"], "policy"),
    (["--engine", "ar", "--policy", "threshold"], "diffusion only"),
])
def test_eval_refuses_bad_diffusion_flags_in_one_line(checkpoints, flags, fragment):
    model = checkpoints["diffusion" if "diffusion" in flags else "ar"]
    result = runner.invoke(app, ["eval", "--n", "1", "--model", model, *flags])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.output, result.output
