"""DiffusionGemma-26B-A4B's shape with random weights: nowait's denoiser step timed at batch 1 and 8.

`--shape diffusiongemma-26b-a4b` on `bench physics`, `batching` and `engines` (and
scripts/gpu-check.sh) builds `nowait.model.DiffusionGemma` at google/diffusiongemma-26B-A4B-it's
size, in bf16 on the GPU (about 50 GB: one H200 holds it), and times the step its engine repeats:
the denoiser over a canvas of `canvas_length` tokens, self-conditioned on the previous step's
logits, over a cached prompt. The weights are created on the device (`torch.device(device)`, then
`normal_` where the module leaves them empty): a CPU init of 25B parameters would take minutes
and move 50 GB over PCIe.

Its FLOPs, bytes and predicted time come from the planner's mixture-of-experts costing
(`planner.roofline.ModelSpec`, one cost formula): routed experts as a dense GeGLU as wide as the
top-k, the dense GeGLU beside them as an always-active shared expert. What that leaves out is
small and stated in the report: the global layers' own head size and key heads, the router, and
the self-conditioning block.
"""

from __future__ import annotations

import os

import torch

from nowait.bench.shapes import (
    SHAPE_DTYPES,
    ShapeError,
    StepCase,
    best_time,
    case_result,
    created_on,
    device_accelerator,
    predicted,
)
from nowait.gemma_checkpoint import diffusion_gemma_config
from nowait.model.diffusion_gemma import GLOBAL, SLIDING, DiffusionGemma, DiffusionGemmaConfig, PromptCache

_PATTERN = [SLIDING] * 5 + [GLOBAL]  # five sliding layers, then a global one (Gemma 4's 5:1)
_ROPE = {  # transformers 5.23, DiffusionGemmaTextConfig.__post_init__'s default_rope_params
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

# config.json as DiffusionGemmaForBlockDiffusion checkpoints write it, read by nowait's own loader.
# Source of each number: google/diffusiongemma-26B-A4B-it's config.json (text_config: the Gemma 4
# 26B-A4B backbone's, the same as google/gemma-4-26B-A4B's), as quoted in public ports' notes and
# test fixtures; not read from the hub here (no network at run time). Where the card's config
# omits a key, transformers 5.23's DiffusionGemma(Text)Config default is the value (marked "tf").
GEMMA_SHAPES: dict[str, tuple[dict, float]] = {
    "diffusiongemma-26b-a4b": ({
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "canvas_length": 256,  # the card's config; also the tf default
        "tie_word_embeddings": True,
        "text_config": {
            "vocab_size": 262_144, "hidden_size": 2816, "num_hidden_layers": 30,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,  # sliding layers
            "global_head_dim": 512, "num_global_key_value_heads": 2,  # global layers (K = V, no v_proj)
            "intermediate_size": 2112,  # the dense GeGLU of every layer (and self-conditioning's)
            "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
            "sliding_window": 1024, "max_position_embeddings": 262_144,
            "layer_types": _PATTERN * 5, "rope_parameters": _ROPE,
            "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,  # tf defaults
            "hidden_activation": "gelu_pytorch_tanh",  # tf default
        },
    }, 25.2e9),  # Google's model card: 25.2B total, 3.8B active
    # Not a published model: the same code path at a few MB, for tests and `gpu-check.sh --cpu-smoke`.
    "diffusiongemma-tiny": ({
        "architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": 16,
        "text_config": {
            "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "intermediate_size": 96, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32,
            "sliding_window": 8, "layer_types": _PATTERN, "rope_parameters": _ROPE,
        },
    }, 0.0),
}
PROMPT_TOKENS = 170  # bench physics' and the dense shapes' cached prompt


def gemma_shape_config(name: str) -> DiffusionGemmaConfig:
    if name not in GEMMA_SHAPES:
        raise ShapeError(f"unknown DiffusionGemma shape {name!r}; known: {', '.join(GEMMA_SHAPES)}")
    return diffusion_gemma_config(GEMMA_SHAPES[name][0])


def parameter_counts(config: DiffusionGemmaConfig) -> tuple[int, float]:
    """(all parameters, those one token uses: every weight but the experts its router skips),
    counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, total - experts + experts * config.top_k_experts / config.num_experts


def _free_bytes(device: str) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


@torch.no_grad()
def build_gemma_model(config: DiffusionGemmaConfig, dtype: str = "bf16", device: str = "cpu") -> DiffusionGemma:
    """A random-weight DiffusionGemma created on `device` in `dtype`. The experts' matrices (left
    empty by the module) and the embedding get N(0, 0.02): uninitialized memory can hold NaNs."""
    if dtype not in SHAPE_DTYPES:
        raise ShapeError(f"unknown dtype {dtype!r}; use fp32 or bf16")
    total, _ = parameter_counts(config)
    needed = total * SHAPE_DTYPES[dtype].itemsize
    if device != "meta" and needed > 0.9 * _free_bytes(device):
        raise ShapeError(f"the weights need {needed / 1e9:.1f} GB in {dtype}; {device} has "
                         f"{_free_bytes(device) / 1e9:.1f} GB free")
    model = created_on(device, dtype, lambda: DiffusionGemma(config))
    if device != "meta":
        model.embed_tokens.weight.normal_(0.0, 0.02)
        for layer in model.layers:
            layer.experts.gate_up_proj.normal_(0.0, 0.02)
            layer.experts.down_proj.normal_(0.0, 0.02)
    return model.eval()


def gemma_cases(config: DiffusionGemmaConfig, batches: tuple[int, ...] = (1, 8), tokens_per_step: float = 2.0,
                prompt: int = PROMPT_TOKENS) -> list[StepCase]:
    """One denoiser step over the whole canvas (the block the engine decodes) above a cached prompt."""
    canvas = config.canvas_length
    return [StepCase(f"denoise-canvas{canvas}-b{b}", b, canvas, prompt, False, tokens_per_step) for b in batches]


@torch.no_grad()
def time_denoise(model: DiffusionGemma, case: StepCase, budget_s: float = 1.0, device: str = "cpu",
                 repeats: int = 20) -> float:
    """Best time of `model.denoise` for `case` (after a warm-up), self-conditioned on random logits
    as every step after a block's first is. The prompt's keys and values are random (their values
    do not change the time), held as the encoder holds them: a sliding layer its last
    `sliding_window - 1` positions, a global layer all of them."""
    c = model.config
    dtype = model.embed_tokens.weight.dtype
    generator = torch.Generator(device=device).manual_seed(0)
    canvas = torch.randint(0, c.vocab_size, (case.batch, case.new_tokens), generator=generator, device=device)
    cache = PromptCache(c.num_layers)
    for layer, kind in enumerate(c.layer_types):
        held = case.cached_tokens if kind == GLOBAL else min(case.cached_tokens, c.sliding_window - 1)
        shape = (case.batch, c.kv_heads[layer], held, c.head_dims[layer])
        cache.append(layer, torch.randn(shape, generator=generator, device=device, dtype=dtype),
                     torch.randn(shape, generator=generator, device=device, dtype=dtype))
    cache.length = case.cached_tokens
    previous = torch.randn(case.batch, case.new_tokens, c.vocab_size, generator=generator, device=device)
    return best_time(lambda: model.denoise(canvas, cache, previous), device, budget_s, repeats)


def gemma_model_spec(name: str, config: DiffusionGemmaConfig):
    """The planner's costing of this shape (module docstring): the sliding layers' attention for
    every layer, the dense GeGLU as a shared expert."""
    from nowait.model import ModelConfig
    from nowait.planner.roofline import ModelSpec

    dense = ModelConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_layers=config.num_layers,
                        num_heads=config.num_heads, num_kv_heads=config.kv_heads[0], head_dim=config.head_dims[0],
                        tie_embeddings=True, causal=False, max_position=config.max_position)
    return ModelSpec(name=name, shape=dense, routed_experts=config.num_experts,
                     experts_per_token=config.top_k_experts, expert_intermediate_size=config.moe_intermediate_size,
                     shared_intermediate_size=config.intermediate_size)


def measure_gemma_shape(name: str, cases: list[StepCase], dtype: str = "bf16", device: str = "cpu",
                        budget_s: float = 1.0, host_budget_s: float = 3.0) -> dict:
    """Every case timed on a random-weight model of `name`'s shape, beside the planner's prediction;
    the same fields as `shapes.measure_shape`, so the same table prints it."""
    config = gemma_shape_config(name)
    accelerator = device_accelerator(device, host_budget_s)
    peak, bandwidth = accelerator.peak_flops(dtype), accelerator.memory_bandwidth
    model = build_gemma_model(config, dtype, device)
    spec = gemma_model_spec(name, config)
    dtype_bytes = SHAPE_DTYPES[dtype].itemsize
    results = []
    for case in cases:
        seconds = time_denoise(model, case, budget_s, device)
        cost = spec.forward_cost(case.new_tokens, case.cached_tokens, case.batch, dtype_bytes)
        plan = predicted(spec.shape, accelerator, dtype, case, spec=spec)
        results.append(case_result(case, seconds, cost, plan, peak, bandwidth))
    del model
    total, active = parameter_counts(config)
    return {"shape": name, "family": "diffusiongemma", "dtype": dtype, "device": device, "parameters": total,
            "active_parameters": active, "published_parameters": GEMMA_SHAPES[name][1] or float(total),
            "planner_parameters": spec.parameters(), "peak_flops": peak, "bandwidth": bandwidth,
            "accelerator": accelerator.model_dump(), "threads": torch.get_num_threads(),
            "step": "denoiser over the whole canvas, self-conditioned, over a cached prompt (random keys)",
            "cost_model": "planner MoE costing: global layers' head size and key heads, the router and "
                          "self-conditioning left out",
            "cases": results}
