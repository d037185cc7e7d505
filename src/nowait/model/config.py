"""The model's shape (`ModelConfig`, as a checkpoint's config.json states it) and its cost model.

`ModelConfig.forward_cost` gives the FLOPs and bytes of a forward from the shape alone: the one
cost formula the planner and the benchmarks read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int | None = None  # hidden_size // num_heads unless a checkpoint says otherwise
    rope_theta: float = 10000.0
    # None: plain RoPE. {"rope_type": "llama3", ...}: Llama 3.1's frequency scaling (see
    # `inverse_frequencies`); the only scaling nowait implements, checkpoints.py refuses others.
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = True
    causal: bool = True
    max_position: int = 1024
    # Diffusion conventions, read from the checkpoint rather than assumed by the engines:
    mask_token_id: int | None = None
    logits_shift: bool = False  # Dream-style: logits at position i predict token i + 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    # --- cost model: the planner and benchmarks read these ---

    def parameter_count(self, include_embeddings: bool = True) -> int:
        d, hd = self.hidden_size, self.head_dim
        attention = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attention += hd * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * d * self.intermediate_size
        per_layer = attention + mlp + 2 * d
        total = per_layer * self.num_layers + d
        if include_embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total

    def forward_cost(self, new_tokens: int, cached_tokens: int = 0, batch: int = 1,
                     dtype_bytes: int = 2, output_tokens: int | None = None) -> ForwardCost:
        """FLOPs and bytes moved for a forward of `new_tokens` over `cached_tokens` per sequence.

        Matmuls: 2 FLOPs per weight per token. Attention: QK^T and AV, 4 * heads * head_dim
        FLOPs per (query, key) pair. Bytes: every weight read once per forward (the reason AR
        decode at batch 1 is memory-bound), the cache read, the new keys/values written, and
        the activations entering and leaving each layer. `output_tokens`: the positions per
        sequence that are read, projected onto the vocabulary (default: every new token; a
        prefill asks for its last one only, `Transformer.forward`'s `output_positions`). The
        last layer computes every position's q/k/v (each key and value is stored) but its
        queries, attention, output projection and MLP for the read positions only
        (`nowait.model.attention.select_queries`), so those are counted for them alone.
        """
        d, hd, layers = self.hidden_size, self.head_dim, self.num_layers
        tokens = new_tokens * batch
        outputs = tokens if output_tokens is None else output_tokens * batch
        # The last layer's rows of position-wise work: the model leaves out only what is unread.
        read = tokens if output_tokens is None else min(output_tokens, new_tokens) * batch
        rows = tokens * (layers - 1) + read if layers else 0  # position-wise rows over all layers
        qkv_weights = (d + self.qkv_bias) * hd * (self.num_heads + 2 * self.num_kv_heads)
        position_wise_weights = self.num_heads * hd * d + 3 * d * self.intermediate_size  # o_proj, MLP
        head_weights = self.vocab_size * d
        keys_per_query = cached_tokens + new_tokens
        attention_flops = 4 * self.num_heads * hd * rows * keys_per_query
        flops = (2 * qkv_weights * tokens * layers + 2 * position_wise_weights * rows + 2 * head_weights * outputs
                 + attention_flops)
        kv_per_token = 2 * self.num_kv_heads * hd * layers
        weight_bytes = (self.parameter_count(include_embeddings=False) + head_weights) * dtype_bytes
        cache_bytes = (cached_tokens * batch + tokens) * kv_per_token * dtype_bytes
        # activations into every layer and out of each: all rows, but the last layer's read rows only
        activation_bytes = (tokens * layers + rows) * d * dtype_bytes + outputs * self.vocab_size * dtype_bytes
        return ForwardCost(flops=float(flops), bytes=float(weight_bytes + cache_bytes + activation_bytes))


@dataclass(frozen=True)
class ForwardCost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved."""
        return self.flops / self.bytes
