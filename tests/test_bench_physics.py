"""`nowait bench physics`: the cases, their cost-model figures and the roofline plot."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nowait.bench.physics import PhysicsCase, measure, plot_roofline, standard_cases
from nowait.checkpoints import save_pretrained
from nowait.cli import app
from nowait.model import ModelConfig

from .conftest import build_model

# Wide enough that weights, not activations, dominate the bytes of a decode step (as in real models).
TINY = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2)


def small_cases() -> list[PhysicsCase]:
    return standard_cases(prompt=24, window=16, block=8)


def test_cases_are_the_four_the_issue_names():
    assert [c.name for c in standard_cases()] == ["ar-decode-b1", "ar-decode-b64", "diffusion-b1",
                                                 "diffusion-b1-cache"]


def test_intensity_orders_as_the_physics_says():
    report = measure(TINY, peak_flops=1e11, bandwidth=1e10, cases=small_cases(), budget_s=0.05)
    by_name = {c["name"]: c for c in report["cases"]}
    # batching reuses the weights; a diffusion pass works on many positions at once
    assert by_name["ar-decode-b64"]["intensity"] > 10 * by_name["ar-decode-b1"]["intensity"]
    assert by_name["diffusion-b1"]["intensity"] > by_name["diffusion-b1-cache"]["intensity"]
    assert by_name["diffusion-b1-cache"]["intensity"] > by_name["ar-decode-b1"]["intensity"]
    for case in report["cases"]:
        assert case["achieved_flops"] == case["flops"] / case["seconds"]
        assert case["utilization"] == case["achieved_flops"] / 1e11
        assert case["roofline_flops"] <= 1e11


def test_plot_is_written(tmp_path):
    report = measure(TINY, peak_flops=1e11, bandwidth=1e10, cases=small_cases()[:2], budget_s=0.02)
    path = plot_roofline(report, tmp_path / "roofline.png")
    assert path.stat().st_size > 1000


def test_command_prints_the_issue_keys(tmp_path, codec):
    checkpoint = save_pretrained(build_model(vocab_size=codec.vocab_size), codec, tmp_path / "ar")
    result = CliRunner().invoke(app, ["bench", "physics", "--model", str(checkpoint), "--budget", "0.05",
                                      "--host-budget", "0.3", "--json", "--report", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["peak_flops"] > 0 and report["bandwidth"] > 0
    assert {c["name"] for c in report["cases"]} == {"ar-decode-b1", "ar-decode-b64", "diffusion-b1",
                                                    "diffusion-b1-cache"}
    for case in report["cases"]:
        assert {"name", "achieved_flops", "intensity", "utilization"} <= set(case)
    assert (tmp_path / "out" / "roofline.png").exists()
