"""`nowait plan --check`: the planner's batch-1 latency against a load test's, on hand-made numbers.

The profile below times every forward at 10 ms whatever its shape (one measurement per engine
shape class), so each prediction is a count of forwards by hand:
  AR, 10-token prompt, 9-token answer: 1 prefill + 9 decode steps = 100 ms (TTFT 20 ms, ITL 10 ms);
  diffusion, 64-token answer, block 32 at 4 tokens per forward, dual cache: 1 prefill + 2 blocks
  x 8 forwards = 170 ms.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from nowait.planner.calibration import (
    compare,
    measured_runs,
    predicted_timeline,
    relative_error,
)
from nowait.planner.engines import AutoregressiveServing
from nowait.planner.fleets import build_fleets
from nowait.planner.hardware import Accelerator
from nowait.planner.profile import Profile, fit_profile
from nowait.planner.scenario import load_scenario
from tests.planner_support import planner_app

SCENARIO = {
    "name": "calibration", "hardware": {"node": "8xH100-SXM"}, "model": "llama-3.2-1b", "dtype": "bf16",
    "engines": {"diffusion": {"block_width": 32, "tokens_per_forward": 2, "cache": "dual"}},
    "workloads": [{"name": "extract", "arrival_rate_per_s": 1, "input_tokens": 10, "output_tokens": 9,
                   "p99_latency_s": 2, "token_value_usd_per_mtok": 1}],
}
PROFILE = {
    "format": "nowait-profile/1", "model": "demo", "hardware": "test box",
    "measurements": [
        {"engine": "ar", "batch": 1, "new_tokens": 10, "context": 0, "seconds": 0.01},
        {"engine": "ar", "batch": 1, "new_tokens": 1, "context": 15, "seconds": 0.01},
        {"engine": "diffusion", "batch": 1, "new_tokens": 64, "context": 100, "seconds": 0.01},
    ],
    "engine_parameters": {"diffusion": {"tokens_per_forward": 4}},  # wins over the scenario's 2
}


def run(target: str, kind: str | None, e2e_ms: float, prompt: float, answer: float, ttft_ms: float | None = None,
        itl_ms: float | None = None, profile: str = "synchronous", medians: bool = True, successful: int = 5) -> dict:
    """One run as `bench load --json` writes it (only the keys the check reads, and a few more)."""
    row = {"target": target, "kind": kind, "profile": profile, "label": profile, "successful": successful,
           "e2e_ms": {"p50": e2e_ms, "mean": e2e_ms}, "ttft_ms": {"p50": ttft_ms} if ttft_ms else None,
           "itl_ms": {"p50": itl_ms} if itl_ms else None,
           "mean_prompt_tokens": prompt + 1, "mean_output_tokens": answer + 1}
    if medians:
        row |= {"median_prompt_tokens": prompt, "median_output_tokens": answer}
    return row


@pytest.fixture
def app() -> typer.Typer:
    return planner_app()


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    paths = {"scenario": tmp_path / "s.yaml", "profile": tmp_path / "bench.json", "load": tmp_path / "load.json"}
    paths["scenario"].write_text(yaml.safe_dump(SCENARIO))
    paths["profile"].write_text(json.dumps(PROFILE))
    return paths


def check(app, files, runs: list[dict], *extra: str):
    files["load"].write_text(json.dumps({"benchmark": "nowait bench load", "runs": runs}))
    return CliRunner().invoke(app, ["plan", str(files["scenario"]), "--profile", str(files["profile"]),
                                    "--check", str(files["load"]), *extra])


def test_relative_error_is_signed_and_flagged_past_the_tolerance():
    assert relative_error(0.1, 0.15) == pytest.approx(-1 / 3)  # the planner is a third too fast
    assert relative_error(0.12, 0.1) == pytest.approx(0.2)
    assert compare("e2e", 0.1, 0.15).flagged
    assert not compare("e2e", 0.1, 0.11).flagged
    assert compare("e2e", 0.1, 0.11, tolerance=0.05).flagged


def test_predicted_timeline_by_hand():
    ar = AutoregressiveServing(target=lambda new_tokens, cached_tokens, batch: 0.01)
    timeline = predicted_timeline(ar, 10, 9)
    # The planner's AR: a prefill, then one step per output token; the first token after the first step.
    assert (timeline.e2e_s, timeline.ttft_s, timeline.itl_s) == pytest.approx((0.1, 0.02, 0.01))
    assert predicted_timeline(ar, 10, 1).itl_s is None


def test_a_run_whose_prompts_hit_the_prefix_cache_is_predicted_with_the_same_hits():
    """A load test whose server restored 150 of 200 prompt tokens: the check predicts a prefill
    of the other 50 over 150 cached, as the server ran it."""
    from nowait.planner.calibration import MeasuredRun, check_engine

    def per_token(new_tokens, cached_tokens, batch):
        return 0.001 * new_tokens  # a forward costs its computed tokens
    ar = AutoregressiveServing(target=per_token)
    hit = MeasuredRun("ar", "ar", 5, 200, 2, "median", e2e_s=0.052, ttft_s=0.051, cached_prompt_tokens=150)
    [e2e, ttft] = check_engine(ar, hit, "profile").comparisons
    assert ttft.predicted_s == pytest.approx(0.050 + 0.001) and not ttft.flagged
    assert e2e.predicted_s == pytest.approx(0.052)
    cold = MeasuredRun("ar", "ar", 5, 200, 2, "median", e2e_s=0.202, ttft_s=0.201)
    assert check_engine(ar, cold, "profile").comparisons[1].predicted_s == pytest.approx(0.201)


def test_measured_runs_reads_synchronous_runs_and_says_why_the_others_are_left_out():
    load = {"runs": [
        run("ar", "ar", 100, 10, 9, ttft_ms=20, itl_ms=10),
        run("ar", "ar", 300, 10, 9, profile="concurrent"),  # batched: not a batch-1 latency, skipped silently
        run("spec", "spec", 80, 10, 9),
        run("nowait", "router", 150, 10, 9),
        run("diffusion", "diffusion", 170, 100, 64, medians=False),
        run("broken", "ar", 0, 0, 0, successful=0),
        run("vllm-model", None, 90, 10, 9),  # a server that does not say its kind: AR, as --profile-out takes it
    ]}
    runs, notes = measured_runs(load)
    assert [(r.target, r.engine) for r in runs] == [("ar", "ar"), ("diffusion", "diffusion"), ("vllm-model", "ar")]
    ar, diffusion, _ = runs
    assert (ar.prompt_tokens, ar.output_tokens, ar.lengths) == (10, 9, "median")
    assert (ar.e2e_s, ar.ttft_s, ar.itl_s) == pytest.approx((0.1, 0.02, 0.01))
    assert (diffusion.prompt_tokens, diffusion.output_tokens, diffusion.lengths) == (101, 65, "mean")
    assert len(notes) == 4
    assert notes[0].startswith("spec (spec): not checked") and notes[1].startswith("nowait (router): not checked")
    assert "mean lengths" in notes[2] and "no successful request" in notes[3]


def test_a_profile_predicting_100_ms_against_a_measured_150_ms_is_flagged(app, files):
    result = check(app, files, [run("ar", "ar", 150, 10, 9, ttft_ms=20, itl_ms=10)], "--json")
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout)
    [ar] = out["engines"]
    assert ar["e2e"]["predicted_s"] == pytest.approx(0.1) and ar["e2e"]["measured_s"] == pytest.approx(0.15)
    assert ar["e2e"]["relative_error"] == pytest.approx(-1 / 3, abs=1e-4) and ar["e2e"]["flagged"]
    assert not ar["within_tolerance"] and not out["passed"]
    assert not ar["ttft"]["flagged"] and not ar["itl"]["flagged"]  # the gaps and the prefill were right


def test_predictions_use_each_run_s_own_lengths_and_pass_within_the_tolerance(app, files):
    runs = [run("ar", "ar", 105, 10, 9, ttft_ms=21, itl_ms=10), run("diffusion", "diffusion", 160, 100, 64),
            run("diffusion-long", "diffusion", 250, 100, 96)]
    result = check(app, files, runs, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    predicted = {e["target"]: e["e2e"]["predicted_s"] for e in out["engines"]}
    # Diffusion: 1 prefill + 2 (or 3) blocks of 32 at 4 tokens per forward = 17 (or 25) forwards of 10 ms.
    assert predicted == pytest.approx({"ar": 0.1, "diffusion": 0.17, "diffusion-long": 0.25})
    assert out["passed"] and all(e["basis"] == "profile" for e in out["engines"])
    assert "ttft" not in out["engines"][1]  # diffusion streams whole blocks: only e2e compares
    table = check(app, files, runs)
    assert table.exit_code == 0 and "within 20%" in table.stdout and "OFF" not in table.stdout


def test_an_engine_missing_from_the_profile_is_predicted_by_the_roofline_and_says_so(app, files):
    files["profile"].write_text(json.dumps({**PROFILE, "measurements": PROFILE["measurements"][:2]}))
    result = check(app, files, [run("diffusion", "diffusion", 170, 100, 64)], "--json")
    out = json.loads(result.stdout)
    assert out["engines"][0]["basis"] == "roofline" and any("not in the profile" in n for n in out["notes"])


def test_check_errors_are_one_line(app, files):
    result = check(app, files, [run("ar", "ar", 300, 10, 9, profile="concurrent")])
    assert result.exit_code == 2 and "no synchronous run" in result.output
    files["load"].write_text("not json")
    result = CliRunner().invoke(app, ["plan", str(files["scenario"]), "--check", str(files["load"])])
    assert result.exit_code == 2 and "cannot read a load test" in result.output
    result = CliRunner().invoke(app, ["plan", str(files["scenario"]), "--check", str(files["load"]),
                                      "--report", str(files["load"].parent)])
    assert result.exit_code == 2 and "no --report" in result.output


def test_the_shipped_demo_host_scenario_loads_and_its_engines_take_the_profile():
    host = Accelerator(name="host", peak_tflops={"fp32": 0.2, "bf16": 0.3}, memory_bandwidth_tb_s=0.01, memory_gb=8)
    scenario = load_scenario(Path(__file__).parent.parent / "examples" / "demo-host.yaml", host=host)
    assert (scenario.node.name, scenario.model.spec.name, scenario.dtype) == ("host", "nowait-ar", "fp32")
    [workload] = scenario.workloads
    assert 150 <= workload.input_tokens.mean <= 220 and 80 <= workload.output_tokens.mean <= 110
    profile = Profile.model_validate(PROFILE)
    fleets = build_fleets(scenario, fit_profile(profile), profile)
    assert predicted_timeline(fleets["ar"].make(1), 10, 9).e2e_s == pytest.approx(0.1)
    # One 104-token block (the template's width) at 4 tokens per forward: 26 forwards of the
    # profile's 10 ms, after a 10 ms prefill.
    assert predicted_timeline(fleets["diffusion"].make(1), 100, 64).e2e_s == pytest.approx(0.27)
