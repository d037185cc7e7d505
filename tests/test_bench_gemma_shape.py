"""`--shape diffusiongemma-26b-a4b`: the preset read by nowait's own DiffusionGemma loader (and by
transformers' config class where it is installed), its parameter counts against the model card's,
and the denoiser step timed on the same code path at a tiny size. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from nowait.bench import gemma_shape
from nowait.bench.gemma_shape import (
    GEMMA_SHAPES,
    build_gemma_model,
    gemma_cases,
    gemma_model_spec,
    gemma_shape_config,
    measure_gemma_shape,
    parameter_counts,
)
from nowait.bench.shapes import ShapeError
from nowait.cli import app
from nowait.gemma_checkpoint import diffusion_gemma_config
from nowait.model.diffusion_gemma import GLOBAL, SLIDING

BIG, TINY = "diffusiongemma-26b-a4b", "diffusiongemma-tiny"


def test_the_preset_counts_the_model_cards_parameters():
    total, active = parameter_counts(gemma_shape_config(BIG))
    assert abs(total / 25.2e9 - 1) < 0.01, total  # Google's card: 25.2B total
    assert abs(active / 3.8e9 - 1) < 0.02, active  # and 3.8B active
    # the planner's MoE costing of the same shape holds nearly the same weights
    assert abs(gemma_model_spec(BIG, gemma_shape_config(BIG)).parameters() / total - 1) < 0.02


def test_the_preset_has_the_published_layer_pattern():
    config = gemma_shape_config(BIG)
    assert config.layer_types == ([SLIDING] * 5 + [GLOBAL]) * 5
    assert [config.head_dims[i] for i in (0, 5)] == [256, 512] and [config.kv_heads[i] for i in (0, 5)] == [8, 2]
    assert (config.num_experts, config.top_k_experts, config.canvas_length, config.sliding_window) == (128, 8, 256,
                                                                                                        1024)


@pytest.mark.parametrize("name", list(GEMMA_SHAPES))
def test_nowaits_reader_agrees_with_transformers_config(name):
    transformers = pytest.importorskip("transformers")
    hf = GEMMA_SHAPES[name][0]
    reference = transformers.DiffusionGemmaTextConfig(**hf["text_config"])
    ours = diffusion_gemma_config(hf)
    assert ours.layer_types == list(reference.layer_types)
    for layer in range(reference.num_hidden_layers):
        per_layer = reference.per_layer_config[layer]
        assert (ours.head_dims[layer], ours.kv_heads[layer]) == (per_layer.head_dim, per_layer.num_key_value_heads)
    assert ours.sliding_window == reference.sliding_window and ours.final_logit_softcapping == 30.0


def test_global_layers_without_per_layer_config_read_as_transformers_reads_them():
    text = {**GEMMA_SHAPES[TINY][0]["text_config"]}
    del text["global_head_dim"]  # transformers' default is 512, not the sliding layers' head_dim
    config = diffusion_gemma_config({"text_config": text})
    assert config.head_dims[5] == 512 and config.kv_heads[5] == 1 and config.head_dims[0] == 16
    text["per_layer_config"] = {"5": {"head_dim": 24}}  # a written per_layer_config wins
    assert diffusion_gemma_config({"text_config": text}).head_dims[5] == 24


def test_a_meta_build_has_the_counted_parameters_in_bf16():
    config = gemma_shape_config(BIG)
    model = build_gemma_model(config, "bf16", "meta")
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(config)[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_weights_that_do_not_fit_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(gemma_shape, "_free_bytes", lambda device: 8e9)
    with pytest.raises(ShapeError, match=r"the weights need 50\.5 GB in bf16; cpu has 8\.0 GB free"):
        build_gemma_model(gemma_shape_config(BIG), "bf16", "cpu")


@torch.no_grad()
def test_the_tiny_build_is_random_and_finite():
    model = build_gemma_model(gemma_shape_config(TINY), "fp32", "cpu")
    experts = model.layers[0].experts.gate_up_proj
    assert torch.isfinite(experts).all() and experts.std() == pytest.approx(0.02, rel=0.2)  # not torch.empty's
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_denoiser_step_is_measured_beside_the_planner():
    config = gemma_shape_config(TINY)
    cases = gemma_cases(config, (1, 2))
    report = measure_gemma_shape(TINY, cases, "fp32", "cpu", budget_s=0.01, host_budget_s=0.05)
    assert [c["name"] for c in report["cases"]] == ["denoise-canvas16-b1", "denoise-canvas16-b2"]
    spec = gemma_model_spec(TINY, config)
    for case, result in zip(cases, report["cases"], strict=True):
        assert (result["batch"], result["new_tokens"], result["cached_tokens"]) == (case.batch, 16, 170)
        assert result["flops"] == spec.forward_cost(16, 170, case.batch, 4).flops
        assert result["achieved_flops"] == result["flops"] / result["seconds"]
        assert result["predicted_over_measured"] == result["predicted_s"] / result["seconds"]
        assert result["predicted_s"] > result["roofline_s"] > 0
    assert report["parameters"] == parameter_counts(config)[0] and report["family"] == "diffusiongemma"


def test_bench_engines_shape_runs_the_tiny_denoiser_at_batch_1():
    result = CliRunner().invoke(app, ["bench", "engines", "--shape", TINY, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [c["name"] for c in report["cases"]] == ["denoise-canvas16-b1"]  # no AR step in DiffusionGemma


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_is_refused_in_one_line_without_cuda():
    result = CliRunner().invoke(app, ["bench", "batching", "--shape", BIG, "--dtype", "bf16", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "CUDA is not available" in result.output
