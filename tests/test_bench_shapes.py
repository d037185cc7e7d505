"""`--shape NAME`: the real-shape presets, counted from their configs without allocating, and the
step timing beside the planner's prediction on a shrunken shape."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from nowait.bench import shapes
from nowait.bench.shapes import REAL_SHAPES, StepCase, build_model, published_parameters, shape_cases, shape_config
from nowait.cli import app


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_presets_count_their_published_parameters(name):
    counted = shape_config(name).parameter_count()
    assert abs(counted / published_parameters(name) - 1) < 0.02, (name, counted)


def test_meta_device_model_has_the_counted_parameters():
    # the module tree itself, not only the formula: built on the meta device, nothing allocated
    config = shape_config("llama-3.1-8b")
    model = build_model(config, "bf16", "meta")
    assert sum(p.numel() for p in model.parameters()) == config.parameter_count()
    assert next(model.parameters()).dtype == torch.bfloat16


def test_diffusion_families_are_bidirectional():
    assert not shape_config("llada-8b").causal and not shape_config("dream-7b").causal
    assert shape_config("qwen2.5-0.5b").causal and shape_config("qwen2.5-0.5b").qkv_bias
    assert shape_config("llada-8b").num_kv_heads == 32  # no GQA


def test_unknown_shape_and_dtype_are_one_line():
    result = CliRunner().invoke(app, ["bench", "physics", "--shape", "gpt-9"])
    assert result.exit_code == 2 and "unknown shape 'gpt-9'" in result.output
    result = CliRunner().invoke(app, ["bench", "batching", "--shape", "qwen2.5-0.5b", "--dtype", "int3"])
    assert result.exit_code == 2 and "unknown dtype 'int3'" in result.output


def test_cases_are_the_issues_steps():
    names = [c.name for c in shape_cases()]
    assert names == ["ar-decode-b1", "ar-decode-b16", "ar-decode-b64", "diffusion-block32-b1", "diffusion-block32-b8"]
    block = shape_cases(tokens_per_step=4)[-1]
    assert (block.batch, block.new_tokens, block.cached_tokens, block.tokens_per_step) == (8, 32, 170, 4)


def test_shrunken_shape_is_timed_beside_the_planner(monkeypatch):
    tiny = replace(shape_config("qwen2.5-0.5b"), vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=None)
    tiny.__post_init__()
    monkeypatch.setattr(shapes, "shape_config", lambda name: tiny)
    cases = [StepCase("ar-decode-b2", 2, 1, 16, True, 1.0), StepCase("diffusion-block8-b1", 1, 8, 16, False, 2.0)]
    report = shapes.measure_shape("qwen2.5-0.5b", cases, budget_s=0.05, host_budget_s=0.2)
    assert [c["name"] for c in report["cases"]] == ["ar-decode-b2", "diffusion-block8-b1"]
    for case, result in zip(cases, report["cases"], strict=True):
        cost = tiny.forward_cost(case.new_tokens, case.cached_tokens, case.batch, 4)
        assert result["flops"] == cost.flops and result["bytes"] == cost.bytes
        assert result["achieved_flops"] == cost.flops / result["seconds"]
        assert result["tokens_per_s"] == case.batch * case.tokens_per_step / result["seconds"]
        assert result["predicted_over_measured"] == result["predicted_s"] / result["seconds"]
        assert result["predicted_s"] > result["roofline_s"] > 0  # efficiencies and overhead only add time
    assert tiny.causal  # the timing switched attention per case and put it back


def test_the_graphed_steps_time_the_cases_they_run_and_no_others():
    """On a GPU each case the engines replay as a CUDA Graph is timed that way too; here the same
    static-shape steps run eagerly, the case's cache left as declared."""
    tiny = replace(shape_config("qwen2.5-0.5b"), vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=None)
    tiny.__post_init__()
    model = build_model(tiny)
    for case in (StepCase("ar-decode-b3", 3, 1, 20, True, 1.0), StepCase("diffusion-block8-b1", 1, 8, 16, False, 2.0)):
        assert shapes.time_step(model, case, budget_s=0.02, graphed=True) > 0
    assert shapes.time_step(model, StepCase("diffusion-block8-b2", 2, 8, 16, False, 2.0), graphed=True) is None
    assert shapes.time_step(model, StepCase("prefill", 1, 8, 0, True, 1.0), graphed=True) is None
    assert model.config.causal


def test_shape_command_prints_json(monkeypatch):
    tiny = replace(shape_config("llada-8b"), vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=2, head_dim=None)
    tiny.__post_init__()
    monkeypatch.setattr(shapes, "shape_config", lambda name: tiny)
    result = CliRunner().invoke(app, ["bench", "engines", "--shape", "llada-8b", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [c["name"] for c in report["cases"]] == ["ar-decode-b1", "diffusion-block32-b1"]
    assert report["shape"] == "llada-8b" and report["device"] == "cpu"


def test_the_five_families_of_the_issue():
    assert REAL_SHAPES == ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "llada-8b", "dream-7b")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", [["physics"], ["batching"], ["engines", "--n", "1"], ["peers", "--n", "1"],
                                     ["physics", "--shape", "tiny"], ["cache-modes", "--n", "1"]])
def test_device_cuda_is_refused_in_one_line_without_cuda(command):
    pytest.importorskip("transformers")  # peers checks for it first
    result = CliRunner().invoke(app, ["bench", *command, "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "CUDA is not available" in result.output
