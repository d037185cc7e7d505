"""Roofline timing and the engines' step models against hand-computed cases."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from nowait.model import ModelConfig
from nowait.planner.engines import (
    AutoregressiveServing,
    DiffusionServing,
    SpeculativeServing,
    expected_tokens_per_target_pass,
    forwards_per_block,
    replica_tokens_per_s,
    single_stream_tokens_per_s,
    speculative_speedup,
)
from nowait.planner.hardware import ACCELERATORS, NODES
from nowait.planner.roofline import (
    IDEAL,
    Deployment,
    Efficiency,
    ModelSpec,
    ScaledTimer,
    all_reduce_seconds,
    check_fits,
    expected_experts_touched,
    forward_time,
    model_spec_from_hf,
    preset_model,
    ridge_intensity,
    roofline_seconds,
)

H100, NODE = ACCELERATORS["H100-SXM"], NODES["8xH100-SXM"]
# Llama-3-70B by hand: 80 layers x (attention 8192*128*(2*64 + 2*8) + SwiGLU 3*8192*28672 + 2 norms of 8192)
# + final norm; the embedding and the untied output head are 128256 x 8192 each.
LLAMA70_LAYERS = 80 * (8192 * 128 * 144 + 3 * 8192 * 28672 + 2 * 8192) + 8192
LLAMA70_WEIGHT_BYTES_PER_FORWARD = (LLAMA70_LAYERS + 128256 * 8192) * 2  # the input embedding is only looked up


def llama70(efficiency: Efficiency = IDEAL) -> Deployment:
    return Deployment(model=preset_model("llama-3-70b"), accelerator=H100, node=NODE, dtype="bf16",
                      tensor_parallel=8, efficiency=efficiency)


def test_llama_70b_parameter_count_and_roofline_ceiling_near_190_tokens_per_s():
    model = preset_model("llama-3-70b")
    assert model.parameters() == LLAMA70_LAYERS + 2 * 128256 * 8192 == 70_553_706_496
    decode = forward_time(llama70(), new_tokens=1, cached_tokens=0, batch=1)
    assert decode.bytes == pytest.approx(LLAMA70_WEIGHT_BYTES_PER_FORWARD, rel=1e-4)
    assert decode.bound == "memory"
    ceiling = 1 / decode.seconds
    assert ceiling == pytest.approx(8 * 3.35e12 / LLAMA70_WEIGHT_BYTES_PER_FORWARD, rel=1e-3)  # 192.8 tok/s
    assert 180 < ceiling < 200


def test_realistic_single_stream_adds_efficiency_all_reduces_and_overhead():
    efficiency = Efficiency(compute=0.6, memory=0.7, collective_latency_s=15e-6, forward_overhead_s=2e-3)
    t = forward_time(llama70(efficiency), 1, 0, 1)
    memory = LLAMA70_WEIGHT_BYTES_PER_FORWARD / (8 * 3.35e12 * 0.7)  # 7.41 ms
    all_reduce = 15e-6 + 2 * 7 / 8 * 8192 * 2 / 450e9  # one ring all-reduce of a 16 kB activation
    communication = 80 * 2 * all_reduce  # two per layer (Megatron-LM)
    assert t.memory_s == pytest.approx(memory, rel=1e-3)
    assert t.communication_s == pytest.approx(communication, rel=1e-9)
    assert t.seconds == pytest.approx(memory + communication + 2e-3, rel=1e-3)
    assert 10 < 1 / t.seconds < 100  # "tens of tokens per second"


def test_roofline_formulas():
    assert roofline_seconds(2e12, 1e9, 1e15, 1e12) == pytest.approx(2e-3)  # compute-bound: 2 ms > 1 ms
    assert roofline_seconds(1e12, 4e9, 1e15, 1e12) == pytest.approx(4e-3)  # memory-bound
    assert ridge_intensity(989e12, 3.35e12) == pytest.approx(295.2, rel=1e-3)
    assert all_reduce_seconds(1e6, 1, 1e9, 1e-5) == 0
    assert all_reduce_seconds(1e6, 4, 1e9, 1e-5) == pytest.approx(1e-5 + 1.5e-3)


def test_prefill_is_compute_bound_and_decode_intensity_is_about_one_per_sequence():
    prefill = forward_time(llama70(), 4096, 0, 1)
    assert prefill.bound == "compute"
    assert forward_time(llama70(), 1, 0, 1).intensity == pytest.approx(1.0, rel=0.05)
    assert forward_time(llama70(), 1, 0, 64).intensity == pytest.approx(64, rel=0.05)


def test_moe_costs_active_flops_and_reads_the_experts_it_touches():
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(8, 2, 0) == 0
    assert expected_experts_touched(8, 2, 1000) == pytest.approx(8.0)
    mixtral = preset_model("mixtral-8x7b")
    assert mixtral.parameters() / 1e9 == pytest.approx(46.7, abs=0.1)  # published 46.7B total
    assert mixtral.active_parameters() / 1e9 == pytest.approx(12.9, abs=0.1)  # and 12.9B active
    dense_equivalent = ModelSpec("active", ModelConfig(**{**mixtral.shape.to_dict(), "intermediate_size": 2 * 14336}))
    one = mixtral.forward_cost(1, 0, 1, 2)
    assert one.flops == dense_equivalent.forward_cost(1, 0, 1, 2).flops
    assert one.bytes == pytest.approx(dense_equivalent.forward_cost(1, 0, 1, 2).bytes)  # 1 token touches 2 experts
    many = mixtral.forward_cost(1, 0, 512, 2)
    assert many.bytes > 3 * one.bytes  # a large batch reads (nearly) every expert


def test_hf_config_with_shared_experts():
    hf = {"hidden_size": 64, "intermediate_size": 256, "moe_intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "num_experts": 6,
          "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48}
    spec = model_spec_from_hf(hf, "tiny-moe")
    assert (spec.routed_experts, spec.experts_per_token, spec.expert_intermediate_size,
            spec.shared_intermediate_size) == (6, 2, 32, 48)
    assert spec._with_ffn_width(2).intermediate_size == 2 * 32 + 48


def test_a_model_that_does_not_fit_says_so():
    one_gpu = Deployment(model=preset_model("llama-3-70b"), accelerator=H100, node=NODE, tensor_parallel=1)
    assert "needs 141 GB" in check_fits(one_gpu)
    assert check_fits(llama70()) is None
    assert llama70().kv_token_budget() > 1e6  # 576 GB usable - 141 GB of weights, 328 kB per token


@dataclass
class RecordingTimer:
    """Every forward costs 1 s; the calls are recorded."""

    calls: list = field(default_factory=list)

    def __call__(self, new_tokens, cached_tokens, batch):
        self.calls.append((new_tokens, cached_tokens, batch))
        return 1.0


def test_speculative_expected_tokens_and_speedup_leviathan():
    assert expected_tokens_per_target_pass(0.75, 4) == pytest.approx((1 - 0.75**5) / 0.25)  # 3.0508
    assert expected_tokens_per_target_pass(1.0, 4) == 5
    assert expected_tokens_per_target_pass(0.0, 4) == 1
    assert speculative_speedup(0.75, 4, 0.05) == pytest.approx(3.05078125 / 1.2)
    target = RecordingTimer()
    spec = SpeculativeServing(target=target, draft=ScaledTimer(target, 0.05), gamma=4, acceptance_rate=0.75)
    assert spec.step_seconds(1, 100, 50) == pytest.approx(4 * 0.05 + 1)
    assert target.calls[-1] == (5, 100, 1)  # the target verifies gamma + 1 positions in one pass
    ar = AutoregressiveServing(target=RecordingTimer())
    speedup = spec.tokens_per_step / spec.step_seconds(1, 0, 0) / (ar.tokens_per_step / ar.step_seconds(1, 0, 0))
    assert speedup == pytest.approx(speculative_speedup(0.75, 4, 0.05))


def test_diffusion_block_step_per_cache_mode():
    assert forwards_per_block(32, 4) == 8
    assert forwards_per_block(32, 64) == 1
    context, remaining = 1000, 96  # the current block and two more masked blocks after it

    def step(cache):
        timer = RecordingTimer()
        seconds = DiffusionServing(model=timer, block_width=32, tokens_per_forward=4, cache=cache).step_seconds(
            2, context, remaining)
        return seconds, set(timer.calls)

    assert step("block") == (9, {(32, 1000, 2)})  # 8 forwards over the block + 1 writing it to the cache
    assert step("dual") == (8, {(1000 + 96, 0, 2), (32, 1000 + 64, 2)})  # a full refresh, then the block only
    assert step("prefix") == (8, {(1000 + 96, 0, 2), (96, 1000, 2)})  # refresh, then block + masked suffix
    assert step("none") == (8, {(1000 + 96, 0, 2)})  # everything, every time


def test_diffusion_pays_block_width_over_tokens_per_forward_in_flops():
    # Why AR wins at large batch: each committed token costs W / k tokens of compute.
    model = preset_model("llama-3-8b")
    per_useful_token = model.forward_cost(32, 0, 1, 2).flops / 4
    assert per_useful_token / model.forward_cost(1, 0, 1, 2).flops == pytest.approx(8, rel=0.02)


def test_throughput_helpers_on_a_constant_timer():
    ar = AutoregressiveServing(target=RecordingTimer())
    # 100 output tokens: 100 steps of 1 s alone; in a full batch of 10, each request's share is 1 + 100/10 s.
    assert single_stream_tokens_per_s(ar, 50, 100) == pytest.approx(1.0)
    assert replica_tokens_per_s(ar, 10, 50, 100) == pytest.approx(100 / 11)
    assert math.isclose(DiffusionServing(model=RecordingTimer(), cache="block").tokens_per_step, 32)


def test_dual_blocks_refreshes_two_blocks_over_the_cache():
    """The engine's default refresh: two blocks of new tokens reading prompt, earlier answer and
    suffix from the cache, where Fast-dLLM's dual cache recomputes the whole context."""
    timer = RecordingTimer()
    serving = DiffusionServing(model=timer, cache="dual-blocks", block_width=32, tokens_per_forward=8)
    assert serving.step_seconds(1, 500, 100) == 4  # 32 / 8 forwards, each 1 s on this timer
    assert timer.calls == [(64, 568, 1), (32, 568, 1)]  # the refresh, then a step (x 3): 500 + 68 cached
    dual = RecordingTimer()
    DiffusionServing(model=dual, cache="dual", block_width=32, tokens_per_forward=8).step_seconds(1, 500, 100)
    assert dual.calls[0] == (600, 0, 1)  # the whole context, nothing cached


def test_log2_interpolation_is_linear_per_doubling_and_flat_outside():
    from nowait.planner.hardware import interpolate_log2

    points = {1: 0.1, 4: 0.3, 16: 0.9}
    assert interpolate_log2(points, 1) == 0.1 and interpolate_log2(points, 0.5) == 0.1
    assert interpolate_log2(points, 2) == pytest.approx(0.2)  # halfway from 1 to 4 in log2
    assert interpolate_log2(points, 8) == pytest.approx(0.6)
    assert interpolate_log2(points, 16) == 0.9 and interpolate_log2(points, 4096) == 0.9


def test_a_measured_matmul_curve_and_read_bandwidth_set_the_planners_step_and_not_the_ideal():
    """A host with a measured efficiency by width: a 32-row forward is timed at 32 rows'
    efficiency, not the assumed 60%; its memory time at the read bandwidth; the pure roofline
    keeps the peaks."""
    from nowait.planner.hardware import Accelerator, host_node

    base = dict(name="host", peak_tflops={"fp32": 0.1}, memory_bandwidth_tb_s=0.02, memory_gb=16)
    plain = Accelerator(**base)
    measured = Accelerator(**base, read_bandwidth_tb_s=0.025, gemm_efficiency={"fp32": {1: 0.1, 32: 0.3, 512: 0.9}})
    shape = preset_model("llama-3.2-1b")
    deployments = [Deployment(model=shape, accelerator=a, node=host_node(a), dtype="fp32") for a in (plain, measured)]
    block = [forward_time(d, 32, 170, 1) for d in deployments]  # a diffusion block: compute-bound here
    assert block[0].compute_s == pytest.approx(block[0].flops / (0.1e12 * 0.6))
    assert block[1].compute_s == pytest.approx(block[1].flops / (0.1e12 * 0.3))
    decode = [forward_time(d, 1, 250, 1) for d in deployments]  # weight-bound
    assert decode[0].memory_s == pytest.approx(decode[0].bytes / (0.02e12 * 0.7))
    assert decode[1].memory_s == pytest.approx(decode[1].bytes / (0.025e12 * 0.7))
    ideal = forward_time(deployments[1].ideal(), 32, 170, 1)
    assert ideal.compute_s == pytest.approx(ideal.flops / 0.1e12)
    assert measured.compute_efficiency("bf16", 32) is None and plain.compute_efficiency("fp32", 32) is None
    # A scenario may carry the curve as JSON does (row counts as strings)
    again = Accelerator.model_validate_json(measured.model_dump_json())
    assert again.gemm_efficiency == {"fp32": {1: 0.1, 32: 0.3, 512: 0.9}}


def test_measure_host_measures_the_read_bandwidth_and_the_curve():
    from nowait.planner.hardware import GEMM_ROWS, measure_host

    host = measure_host(budget_s=0.3, threads=1)
    assert host.read_bandwidth_tb_s > 0
    curve = host.gemm_efficiency["fp32"]
    assert sorted(curve) == list(GEMM_ROWS) and all(0 < v <= 1 for v in curve.values())
