"""Real model shapes with random weights: `--shape NAME` on `bench physics`, `batching` and `engines`.

The demo models are 1.8M parameters, where per-operation overhead sets the speed; these presets
give the published shapes (config.json of each model card) so the steps the engines run are
timed at the size they are served at. Random weights give no meaningful confidence, so a
diffusion step commits a fixed number of tokens (`tokens_per_step`) instead of a
confidence-chosen one. Each step is timed beside the planner's prediction for the same shape
and hardware (`planner.roofline.forward_time`) and the device's peaks, so the two can be read
side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from nowait.architectures import llama_shape
from nowait.model import KVCache, ModelConfig, Transformer

T = TypeVar("T")

# Published config.json values (Hugging Face model cards), as HF keys so they go through the loader's reader.
# The last two: the published parameter count and whether the family decodes by diffusion.
SHAPES: dict[str, tuple[dict, float, bool]] = {
    # Qwen/Qwen2.5-0.5B: 0.49B, q/k/v biases, tied embeddings
    "qwen2.5-0.5b": ({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                      "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                      "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}, 0.49e9, False),
    # meta-llama/Llama-3.2-1B: 1.24B, tied embeddings
    "llama-3.2-1b": ({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                      "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}, 1.24e9, False),
    # meta-llama/Llama-3.1-8B: 8.03B
    "llama-3.1-8b": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                      "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, 8.03e9, False),
    # GSAI-ML/LLaDA-8B-Instruct: 8.02B, no GQA (32 kv heads), untied ff_out
    "llada-8b": ({"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 126464,
                  "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, 8.02e9, True),
    # Dream-org/Dream-v0-Instruct-7B: Qwen2.5-7B's shape, 7.62B, q/k/v biases, untied head
    "dream-7b": ({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                  "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}, 7.62e9, True),
    # Not a published model: a few-MB shape that lets `scripts/gpu-check.sh --cpu-smoke` run every step on a CPU.
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}, 0.0, False),
}
REAL_SHAPES = tuple(name for name in SHAPES if name != "tiny")
SHAPE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPT_TOKENS = 170  # a typical extraction prompt of the demo corpus (bench physics uses the same)
ANSWER_TOKENS = 160
BLOCK = 32


class ShapeError(ValueError):
    """An unknown shape or dtype: one clear line."""


def shape_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset, nothing allocated (diffusion families bidirectional)."""
    if name not in SHAPES:
        raise ShapeError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    hf, _, diffusion = SHAPES[name]
    config = llama_shape({**hf, "max_position_embeddings": 4096})
    config.causal = not diffusion
    return config


def published_parameters(name: str) -> float:
    """The model card's count (the smoke shape's own count: it has no card)."""
    return SHAPES[name][1] or float(shape_config(name).parameter_count())


def build_model(config: ModelConfig, dtype: str = "fp32", device: str = "cpu") -> Transformer:
    """A random-weight Transformer of `config`'s shape, created on `device` in `dtype` (an 8B model
    is never materialized in fp32 on the host first)."""
    if dtype not in SHAPE_DTYPES:
        raise ShapeError(f"unknown dtype {dtype!r}; use fp32 or bf16")
    return created_on(device, dtype, lambda: Transformer(config)).eval()


def created_on(device: str, dtype: str, make: Callable[[], T]) -> T:
    """`make()` with every tensor it creates allocated on `device` in `dtype` from the start
    (the default dtype is put back after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(SHAPE_DTYPES[dtype])
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True)
class StepCase:
    """One engine step: `batch` rows of `new_tokens` over `cached_tokens` each, committing
    `tokens_per_step` tokens per row (AR: 1; diffusion: the fixed policy's)."""

    name: str
    batch: int
    new_tokens: int
    cached_tokens: int
    causal: bool
    tokens_per_step: float


def shape_cases(ar_batches: tuple[int, ...] = (1, 16, 64), diffusion_batches: tuple[int, ...] = (1, 8),
                tokens_per_step: float = 2.0, prompt: int = PROMPT_TOKENS, block: int = BLOCK) -> list[StepCase]:
    """AR decode halfway through an answer, and a diffusion block over the cached prompt."""
    context = prompt + ANSWER_TOKENS // 2
    return ([StepCase(f"ar-decode-b{b}", b, 1, context, True, 1.0) for b in ar_batches]
            + [StepCase(f"diffusion-block{block}-b{b}", b, block, prompt, False, tokens_per_step)
               for b in diffusion_batches])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_step(model: Transformer, case: StepCase, budget_s: float = 1.0, device: str = "cpu",
              repeats: int = 50, graphed: bool = False) -> float | None:
    """Fastest of the repeated forwards of `case` (after one warm-up), the cache refilled to the
    same length each time. The model's attention is switched to the case's kind for the run.

    `graphed`: through the engines' static-shape steps instead, which a CUDA device replays as
    CUDA Graphs (`nowait.model.graphed_step`, `graphed_block`): AR decode at any batch, a
    diffusion block at batch 1 (the engine graphs one request's steps); None for another case.
    On a CPU the same steps run eagerly (nothing to replay)."""
    from nowait.model.graphed_block import GraphedBlock
    from nowait.model.graphed_step import GraphedDecode

    if graphed and ((case.causal and case.new_tokens != 1) or (not case.causal and case.batch != 1)):
        return None
    config = model.config
    causal, config.causal = config.causal, case.causal
    try:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (case.batch, case.new_tokens), generator=generator).to(device)
        cache = KVCache(config, case.batch, case.cached_tokens + case.new_tokens,
                        dtype=model.output_weight().dtype, device=device)
        # The cached keys' values do not change a step's time, so the cache is declared filled
        # rather than prefilled (a prefill of 64 x 250 tokens of an 8B shape would take minutes on a CPU).
        filled = torch.full_like(cache.lengths, case.cached_tokens)
        cache.lengths = filled.clone()
        if not graphed:
            def forward() -> None:
                model(ids, cache, write_cache=case.causal)
        elif case.causal:
            decode, tokens = GraphedDecode(model, cache), ids[:, 0].tolist()

            def forward() -> None:
                decode(tokens, cache, case.cached_tokens + 1)
        else:
            block, span, reads = GraphedBlock(model), ids[0], torch.arange(case.new_tokens, device=device)[None]

            def forward() -> None:
                block(span, case.cached_tokens, cache, reads)

        def step() -> None:
            forward()
            cache.lengths = filled.clone()

        return best_time(step, device, budget_s, repeats)
    finally:
        config.causal = causal


def device_accelerator(device: str, budget_s: float = 3.0):
    """The device as the planner's `Accelerator`: this host measured, or a GPU measured the same way
    (a best-of matmul for the peak, a large copy for the bandwidth), its catalog entry beside it."""
    from nowait.planner.hardware import Accelerator, measure_host

    if not device.startswith("cuda"):
        return measure_host(budget_s=budget_s, threads=torch.get_num_threads())
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(8192, 8192, dtype=dtype, device=device)
        peaks[name] = 2 * 8192**3 / best_time(lambda a=a: a @ a, device, budget_s / 3) / 1e12
    source = torch.empty(2**28, dtype=torch.float32, device=device)  # 1 GiB
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() * 4 / best_time(lambda: target.copy_(source), device, budget_s / 3) / 1e12
    memory = torch.cuda.get_device_properties(device).total_memory / 1e9
    return Accelerator(name=torch.cuda.get_device_name(device), peak_tflops={k: float(f"{v:.4g}") for k, v in
                                                                               peaks.items()},
                       memory_bandwidth_tb_s=float(f"{bandwidth:.4g}"), memory_gb=round(memory, 1),
                       source="measured by nowait bench --shape (torch matmul and copy)")


def best_time(run, device: str, budget_s: float, repeats: int = 20) -> float:
    """The best of up to `repeats` timed runs after one warm-up, stopping once `budget_s` is spent."""
    run()
    _sync(device)
    best, started = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - started > budget_s:
            break
    return best


def predicted(config: ModelConfig, accelerator, dtype: str, case: StepCase, spec=None) -> dict:
    """The planner's step time for this shape on this accelerator (its default efficiencies and
    per-forward overhead), and the pure roofline's, in seconds. `spec`: a `planner.roofline.ModelSpec`
    to cost instead of the dense `config` (a mixture of experts)."""
    from nowait.planner.hardware import host_node
    from nowait.planner.roofline import Deployment, ModelSpec, forward_time

    deployment = Deployment(model=spec or ModelSpec(name="shape", shape=config), accelerator=accelerator,
                            node=host_node(accelerator), dtype=dtype)
    planner = forward_time(deployment, case.new_tokens, case.cached_tokens, case.batch)
    ideal = forward_time(deployment.ideal(), case.new_tokens, case.cached_tokens, case.batch)
    return {"planner_s": planner.seconds, "roofline_s": ideal.seconds, "bound": planner.bound}


def measure_shape(name: str, cases: list[StepCase], dtype: str = "fp32", device: str = "cpu",
                  budget_s: float = 1.0, host_budget_s: float = 3.0) -> dict:
    """Every case timed on a random-weight model of `name`'s shape, beside the planner's prediction."""
    config = shape_config(name)
    accelerator = device_accelerator(device, host_budget_s)
    peak, bandwidth = accelerator.peak_flops(dtype), accelerator.memory_bandwidth
    model = build_model(config, dtype, device)
    dtype_bytes = 4 if dtype == "fp32" else 2
    results = []
    for case in cases:
        seconds = time_step(model, case, budget_s, device)
        cost = config.forward_cost(case.new_tokens, case.cached_tokens, case.batch, dtype_bytes)
        result = case_result(case, seconds, cost, predicted(config, accelerator, dtype, case), peak, bandwidth)
        # On a GPU, the engines' step as they run it there (CUDA Graphs), beside the eager forward.
        graphed = time_step(model, case, budget_s, device, graphed=True) if device.startswith("cuda") else None
        if graphed is not None:
            result.update({"cuda_graph_seconds": graphed, "cuda_graph_speedup": seconds / graphed})
        results.append(result)
    del model
    return {"shape": name, "dtype": dtype, "device": device, "parameters": config.parameter_count(),
            "published_parameters": published_parameters(name), "peak_flops": peak, "bandwidth": bandwidth,
            "accelerator": accelerator.model_dump(), "threads": torch.get_num_threads(), "cases": results}


def case_result(case, seconds: float, cost, plan: dict, peak: float, bandwidth: float) -> dict:
    """One timed case of a shape: what it computed and moved, achieved against the accelerator's
    peak, beside the planner's prediction (`plan`, from `predicted`)."""
    return {
        "name": case.name, "batch": case.batch, "new_tokens": case.new_tokens,
        "cached_tokens": case.cached_tokens, "tokens_per_step": case.tokens_per_step,
        "seconds": seconds, "flops": cost.flops, "bytes": cost.bytes,
        "achieved_flops": cost.flops / seconds, "achieved_bytes_per_s": cost.bytes / seconds,
        "flops_utilization": cost.flops / seconds / peak, "bandwidth_utilization": cost.bytes / seconds / bandwidth,
        "tokens_per_s": case.batch * case.tokens_per_step / seconds,
        "predicted_s": plan["planner_s"], "roofline_s": plan["roofline_s"], "bound": plan["bound"],
        "predicted_over_measured": plan["planner_s"] / seconds,
    }


def print_shape_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['shape']} ({report['parameters'] / 1e9:.2f}B, {report['dtype']}, "
                        f"{report['device']}): peak {report['peak_flops'] / 1e9:.0f} GFLOP/s, "
                        f"{report['bandwidth'] / 1e9:.0f} GB/s")
    for column in ("step", "measured ms", "planner ms", "planner/measured", "roofline ms", "GFLOP/s", "GB/s",
                   "tok/s"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for c in report["cases"]:
        table.add_row(c["name"], f"{c['seconds'] * 1000:.2f}", f"{c['predicted_s'] * 1000:.2f}",
                      f"{c['predicted_over_measured']:.2f}", f"{c['roofline_s'] * 1000:.2f}",
                      f"{c['achieved_flops'] / 1e9:.1f}", f"{c['achieved_bytes_per_s'] / 1e9:.1f}",
                      f"{c['tokens_per_s']:.1f}")
    Console().print(table)
