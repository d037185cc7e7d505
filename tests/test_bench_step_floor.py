"""Per-step time beside the compute floor (issue 28): the FLOPs a forward does, counted from the
modules' own shapes here (not through `ModelConfig.forward_cost`), and the keys `bench engines`
and `bench batching` report. No timing is asserted: only that the figures agree with each other."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from nowait.bench.batching import measure_batching
from nowait.bench.step_floor import ForwardRecorder, step_floor
from nowait.checkpoints import save_pretrained
from nowait.cli import app
from nowait.extraction.corpus import documents
from nowait.model import KVCache
from nowait.tokenizer import extraction_prompt

from .conftest import build_model

FLOOR_KEYS = ("step_ms", "compute_floor_ms", "overhead_share", "step_flops")


def independent_flops(model, new_tokens: int, cached: int, outputs: int) -> float:
    """One row's FLOPs, from the module tree: 2 per weight of every linear layer per position it
    runs on, the head's 2 per weight per projected position, attention's QK^T and AV over every
    visible key. Every layer runs on every new token, but the last one (Block.forward's `picked`)
    only projects every token's q/k/v: its attention, output projection and MLP run on the
    `outputs` positions read."""
    c = model.config
    last = len(model.layers) - 1

    def weights(layer, qkv: bool) -> int:
        return sum(m.weight.numel() for name, m in layer.named_modules()
                   if isinstance(m, nn.Linear) and (name == "self_attn.qkv_proj") == qkv)

    rows = [new_tokens if i < last else min(outputs, new_tokens) for i in range(len(model.layers))]
    linear = sum(weights(layer, True) * new_tokens + weights(layer, False) * r
                 for layer, r in zip(model.layers, rows, strict=True))
    head = model.output_weight().numel()
    attention = sum(4 * c.num_heads * c.head_dim * r * (cached + new_tokens) for r in rows)
    return 2 * linear + 2 * head * outputs + attention


def check_floor(entry: dict, peak: float) -> None:
    assert all(key in entry for key in FLOOR_KEYS), entry
    assert 0 < entry["compute_floor_ms"] <= entry["step_ms"]
    assert 0 <= entry["overhead_share"] <= 1
    assert entry["overhead_share"] == pytest.approx(1 - entry["compute_floor_ms"] / entry["step_ms"], rel=1e-4)
    assert entry["compute_floor_ms"] == pytest.approx(entry["step_flops"] / peak * 1000, rel=1e-5)


@torch.no_grad()
def test_recorder_counts_real_tokens_cached_keys_and_projected_positions():
    model = build_model().eval()
    cache = KVCache(model.config, 2, 16)
    with ForwardRecorder(model) as recorder:
        # a padded prefill (the second row has 3 real tokens of 5), logits at each row's last one
        valid = torch.tensor([5, 3])
        model(torch.randint(0, 64, (2, 5)), cache, valid_lengths=valid, output_positions=(valid - 1)[:, None])
        model(torch.randint(0, 64, (2, 1)), cache)  # one decode step over 5 and 3 cached keys
        model(torch.randint(0, 64, (1, 7)))  # no cache, every position projected
    assert recorder.calls == 3
    assert recorder.flops(0, 1) == independent_flops(model, 5, 0, 1) + independent_flops(model, 3, 0, 1)
    assert recorder.flops(1, 2) == independent_flops(model, 1, 5, 1) + independent_flops(model, 1, 3, 1)
    assert recorder.flops(2) == independent_flops(model, 7, 0, 7)
    assert recorder.flops() == sum(recorder.flops(i, i + 1) for i in range(3))
    model(torch.randint(0, 64, (1, 2)))
    assert recorder.calls == 3  # closed: the hook is gone


def test_step_floor_arithmetic():
    figures = step_floor(0.002, 4e6, 1e10)  # 4 MFLOP at 10 GFLOP/s: 0.4 ms of a 2 ms step
    assert figures == {"step_ms": 2.0, "compute_floor_ms": 0.4, "overhead_share": 0.8, "step_flops": 4e6}
    assert step_floor(0.001, 1e8, 1e10)["overhead_share"] == 0.0  # a floor above the step: no overhead, not < 0
    assert step_floor(None, None, 1e10) == dict.fromkeys(FLOOR_KEYS)
    assert step_floor(0.002, None, 1e10)["step_ms"] == 2.0  # a step with no known floor keeps its time


def test_bench_engines_reports_each_entrys_step_beside_its_floor(codec, tmp_path):
    ar = save_pretrained(build_model(vocab_size=codec.vocab_size, max_position=1024), codec, tmp_path / "ar")
    diffusion = save_pretrained(build_model(vocab_size=codec.vocab_size, causal=False, logits_shift=True,
                                            mask_token_id=codec.mask_id, max_position=1024), codec,
                                tmp_path / "diffusion")
    result = CliRunner().invoke(app, ["bench", "engines", "--n", "1", "--json", "--only", "ar,diffusion-reference",
                                      "--ar-model", str(ar), "--diffusion-model", str(diffusion),
                                      "--host-budget", "0.05"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    peak = report["peak_flops"]
    by_name = {e["name"]: e for e in report["engines"]}
    for entry in by_name.values():
        check_floor(entry, peak)
        assert entry["step_ms"] == pytest.approx(entry["latency_ms_mean"] / entry["forwards_per_doc"], rel=1e-4)
    # The AR entry's forwards, counted by hand: one prefill over the prompt (logits at its last
    # position), then one decode step per further token over the growing cache.
    doc = documents("test", 1)[0]
    prompt = len(codec.encode(extraction_prompt(doc.kind, doc.text)))
    forwards = round(by_name["ar"]["forwards_per_doc"])
    model = build_model(vocab_size=codec.vocab_size, max_position=1024)
    total = independent_flops(model, prompt, 0, 1) + sum(independent_flops(model, 1, prompt + i, 1)
                                                         for i in range(forwards - 1))
    assert by_name["ar"]["step_flops"] == pytest.approx(total / forwards, rel=1e-9)


def test_bench_engines_table_shows_the_floor(codec, tmp_path):
    ar = save_pretrained(build_model(vocab_size=codec.vocab_size, max_position=1024), codec, tmp_path / "ar")
    result = CliRunner().invoke(app, ["bench", "engines", "--n", "1", "--only", "ar", "--ar-model", str(ar),
                                      "--host-budget", "0.05"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "floor ms" in result.output and "overhead" in result.output


def test_bench_batching_reports_steps_beside_their_floor(codec):
    model = build_model(vocab_size=codec.vocab_size, max_position=1024).eval()
    peak = 1e12
    results = measure_batching(model, codec, documents("test", 2), concurrency=(1, 2), max_tokens=4, rounds=1,
                               peak_flops=peak)
    for r in results:
        check_floor(r, peak)
        check_floor({key.removeprefix("sequential_"): value for key, value in r.items()
                     if key.startswith("sequential_")}, peak)
        # batched_s is rounded to the millisecond
        assert r["step_ms"] == pytest.approx(r["batched_s"] * 1000 / r["forwards"], abs=0.5 / r["forwards"] + 1e-6)
        assert r["peak_flops"] == peak
    one = results[0]  # concurrency 1: the batch and the one-at-a-time run are the same decode
    assert one["forwards"] == one["sequential_forwards"] and one["step_flops"] == one["sequential_step_flops"]
