"""Roofline timing of one forward pass of a model deployed on a node.

One cost formula: FLOPs and bytes per forward come from `nowait.model.ModelConfig.forward_cost`
(the same config the engines run). This module adds what a deployment adds on top:

- `ModelSpec`: a dense model, or a mixture of experts expressed through the same formula (a MoE
  layer does the FLOPs of a dense SwiGLU as wide as its active experts, and reads the weights of
  every expert its tokens touch);
- `Deployment`: the model on a tensor-parallel group of accelerators, with efficiencies;
- `forward_time`: max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)), plus the
  tensor-parallel all-reduces and a fixed per-forward overhead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from nowait.architectures import llama_shape  # the HF config.json reader the loader uses (dense fields)
from nowait.model import ForwardCost, ModelConfig
from nowait.planner.hardware import DTYPE_BYTES, Accelerator, Node

# Public config.json shapes (Hugging Face model cards), written as HF keys so they go through the same reader.
PRESETS: dict[str, dict] = {
    "llama-3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                    "tie_word_embeddings": False},
    "llama-3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "tie_word_embeddings": False},
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "llada-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 126464,
                 "tie_word_embeddings": False},
    "mixtral-8x7b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                     "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2},
}
DEMO_PRESETS = ("nowait-ar", "nowait-draft", "nowait-diffusion")  # the bundled demo models' own config.json


# --- the model -----------------------------------------------------------------------------------------


# Expected distinct experts hit when T tokens each pick k of E experts uniformly: E (1 - (1 - k/E)^T)
# (the occupancy expectation of balls into bins; real routers are less uniform, so this is an upper bound).
def expected_experts_touched(experts: int, experts_per_token: int, tokens: float) -> float:
    if experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - experts_per_token / experts) ** max(tokens, 0.0))


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape for costing. For a MoE, `shape.intermediate_size` is ignored in MoE layers."""

    name: str
    shape: ModelConfig
    routed_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # always-active shared experts, summed

    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0

    def _with_ffn_width(self, experts: float) -> ModelConfig:
        """The dense config whose SwiGLU is as wide as `experts` routed experts plus the shared ones."""
        width = experts * self.expert_intermediate_size + self.shared_intermediate_size
        return replace(self.shape, intermediate_size=width)

    def parameters(self) -> float:
        config = self._with_ffn_width(self.routed_experts) if self.is_moe else self.shape
        return float(config.parameter_count())

    def active_parameters(self) -> float:
        config = self._with_ffn_width(self.experts_per_token) if self.is_moe else self.shape
        return float(config.parameter_count())

    def weight_bytes(self, dtype_bytes: float) -> float:
        """Bytes of all weights held in memory (what must fit on the tensor-parallel group)."""
        return self.parameters() * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        c = self.shape
        return 2 * c.num_kv_heads * c.head_dim * c.num_layers * dtype_bytes

    def forward_cost(self, new_tokens: float, cached_tokens: float, batch: float, dtype_bytes: float) -> ForwardCost:
        if not self.is_moe:
            return self.shape.forward_cost(new_tokens, cached_tokens, batch, dtype_bytes)
        flops = self._with_ffn_width(self.experts_per_token).forward_cost(
            new_tokens, cached_tokens, batch, dtype_bytes).flops
        touched = expected_experts_touched(self.routed_experts, self.experts_per_token, new_tokens * batch)
        bytes_moved = self._with_ffn_width(touched).forward_cost(new_tokens, cached_tokens, batch, dtype_bytes).bytes
        return ForwardCost(flops=flops, bytes=bytes_moved)


class ModelSpecError(ValueError):
    """A model reference the planner cannot cost; the message says which key is missing or wrong."""


def model_spec_from_hf(hf: dict, name: str = "model") -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict (Llama, Qwen2, Mistral, Mixtral, Qwen2-MoE, ...)."""
    hf = dict(hf)
    hf.setdefault("intermediate_size", hf.get("moe_intermediate_size", 0))
    try:
        shape = llama_shape(hf)
    except KeyError as missing:
        raise ModelSpecError(f"config of {name!r} has no {missing.args[0]!r}") from None
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0)
    if not experts:
        return ModelSpec(name=name, shape=shape)
    per_token = int(hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 0)
    if not 0 < per_token <= experts:
        raise ModelSpecError(f"config of {name!r}: a MoE needs 0 < num_experts_per_tok <= {experts}")
    expert_width = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    shared = int(hf.get("shared_expert_intermediate_size") or 0) or int(hf.get("n_shared_experts") or 0) * expert_width
    return ModelSpec(name=name, shape=shape, routed_experts=experts, experts_per_token=per_token,
                     expert_intermediate_size=expert_width, shared_intermediate_size=shared)


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ModelSpecError(f"{path}: cannot read a config.json ({error})") from None


def preset_model(name: str) -> ModelSpec:
    if name in PRESETS:
        return model_spec_from_hf(PRESETS[name], name)
    if name in DEMO_PRESETS:
        from nowait import paths

        return model_spec_from_hf(read_hf_config(paths.model_dir(name.removeprefix("nowait-"))), name)
    raise ModelSpecError(f"unknown model preset {name!r}; known: {', '.join([*PRESETS, *DEMO_PRESETS])} "
                         "(or give hf_config: PATH or config: {...})")


# --- the deployment ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks a real serving stack reaches, and what it adds per forward."""

    compute: float = 0.6  # large-GEMM model FLOP utilization of serving stacks
    memory: float = 0.7  # achieved HBM bandwidth of decode GEMVs
    collective_latency_s: float = 15e-6  # one small all-reduce across the tensor-parallel group
    forward_overhead_s: float = 2e-3  # launches, sampling, scheduler: paid once per forward
    memory_reserved_fraction: float = 0.1  # activations, fragmentation, runtime context
    tensor_parallel_communication: bool = True
    # An accelerator's measured matmul efficiency by width (`Accelerator.gemm_efficiency`), where it
    # has one, replaces `compute`: measured beats assumed, and narrow matmuls fall far below it.
    measured_compute: bool = True


# The pure roofline: datasheet peaks, nothing else (the ceiling the report quotes beside the estimate).
IDEAL = Efficiency(compute=1.0, memory=1.0, collective_latency_s=0.0, forward_overhead_s=0.0,
                   tensor_parallel_communication=False, measured_compute=False)


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    accelerator: Accelerator
    node: Node
    dtype: str = "bf16"
    tensor_parallel: int = 1
    efficiency: Efficiency = Efficiency()

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype]

    @property
    def replicas_per_node(self) -> int:
        return self.node.accelerators // self.tensor_parallel

    @property
    def group_peak_flops(self) -> float:
        return self.accelerator.peak_flops(self.dtype) * self.tensor_parallel

    @property
    def group_bandwidth(self) -> float:
        return self.accelerator.stream_bandwidth * self.tensor_parallel

    def compute_efficiency(self, rows: float) -> float:
        """The fraction of the peak a forward whose matmuls have `rows` rows reaches."""
        measured = self.accelerator.compute_efficiency(self.dtype, rows) if self.efficiency.measured_compute else None
        return self.efficiency.compute if measured is None else measured

    def usable_memory_bytes(self) -> float:
        return self.accelerator.memory_bytes * self.tensor_parallel * (1 - self.efficiency.memory_reserved_fraction)

    def kv_token_budget(self) -> float:
        """Tokens of KV cache that fit beside the weights on one replica (0 or less: the weights do not fit)."""
        free = self.usable_memory_bytes() - self.model.weight_bytes(self.dtype_bytes)
        return free / self.model.kv_bytes_per_token(self.dtype_bytes)

    def ideal(self) -> Deployment:
        return replace(self, efficiency=IDEAL)


# Roofline (Williams, Waterman, Patterson 2009): a kernel takes at least the longer of its compute and memory times.
def roofline_seconds(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    return max(flops / peak_flops, bytes_moved / bandwidth)


# The intensity (FLOP/byte) above which the roofline turns from memory-bound to compute-bound (Williams et al. 2009).
def ridge_intensity(peak_flops: float, bandwidth: float) -> float:
    return peak_flops / bandwidth


# Ring all-reduce (Patarasuk & Yuan 2009): each rank sends and receives 2 (p - 1) / p of the message.
def all_reduce_seconds(message_bytes: float, participants: int, link_bandwidth: float, latency_s: float) -> float:
    if participants <= 1:
        return 0.0
    return latency_s + 2 * (participants - 1) / participants * message_bytes / link_bandwidth


@dataclass(frozen=True)
class ForwardTime:
    seconds: float
    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def forward_time(deployment: Deployment, new_tokens: float, cached_tokens: float, batch: float) -> ForwardTime:
    """Seconds of one forward of `batch` sequences, each `new_tokens` over `cached_tokens` of cache."""
    d, e = deployment, deployment.efficiency
    cost = d.model.forward_cost(new_tokens, cached_tokens, batch, d.dtype_bytes)
    compute_s = cost.flops / (d.group_peak_flops * d.compute_efficiency(new_tokens * batch))
    memory_s = cost.bytes / (d.group_bandwidth * e.memory)
    communication_s = 0.0
    if d.tensor_parallel > 1 and e.tensor_parallel_communication:
        # Megatron-LM tensor parallelism (Shoeybi et al. 2019): two all-reduces of the activations per layer.
        activation_bytes = 4 if d.dtype == "fp32" else 2
        message = new_tokens * batch * d.model.shape.hidden_size * activation_bytes
        link = d.node.interconnect_gb_s * 1e9
        per_layer = 2 * all_reduce_seconds(message, d.tensor_parallel, link, e.collective_latency_s)
        communication_s = per_layer * d.model.shape.num_layers
    return ForwardTime(seconds=max(compute_s, memory_s) + communication_s + e.forward_overhead_s,
                       compute_s=compute_s, memory_s=memory_s, communication_s=communication_s,
                       overhead_s=e.forward_overhead_s, flops=cost.flops, bytes=cost.bytes)


class ForwardTimer(Protocol):
    """Seconds of one forward: from the roofline, or fitted to a measured profile."""

    def __call__(self, new_tokens: float, cached_tokens: float, batch: float) -> float: ...


@dataclass(frozen=True)
class RooflineTimer:
    deployment: Deployment

    def __call__(self, new_tokens: float, cached_tokens: float, batch: float) -> float:
        return forward_time(self.deployment, new_tokens, cached_tokens, batch).seconds


@dataclass(frozen=True)
class ScaledTimer:
    """A forward that costs a fixed fraction of another's (a draft model given only its cost ratio c)."""

    reference: ForwardTimer
    ratio: float

    def __call__(self, new_tokens: float, cached_tokens: float, batch: float) -> float:
        return self.ratio * self.reference(new_tokens, cached_tokens, batch)


def check_fits(deployment: Deployment) -> str | None:
    """Why the model cannot be served on this group, or None when it fits with room for a KV cache."""
    need = deployment.model.weight_bytes(deployment.dtype_bytes)
    have = deployment.usable_memory_bytes()
    if need >= have:
        return (f"{deployment.model.name} needs {need / 1e9:.0f} GB of weights in {deployment.dtype}; "
                f"{deployment.tensor_parallel} x {deployment.accelerator.name} hold {have / 1e9:.0f} GB usable")
    return None


def tokens_per_second(seconds_per_step: float, tokens_per_step: float) -> float:
    return tokens_per_step / seconds_per_step if seconds_per_step > 0 else math.inf
