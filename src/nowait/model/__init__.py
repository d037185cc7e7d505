"""One transformer of the Llama/Qwen2 family, causal (AR) or bidirectional (masked diffusion).

RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention, optional qkv bias, tied or
untied embeddings: the parts Llama, Qwen2, LLaDA and Dream share. One `KVCache` serves
incremental AR decode, a batch of sequences of different lengths, and a bidirectional forward
over new tokens that reuses a prefix's keys/values (exact against `block_causal_mask`).

    config       ModelConfig (the shape) and its cost model, ForwardCost
    kv_cache     KVCache
    attention    the attention patterns, their masks and kernels (ragged decode, isolated prefix)
    transformer  the layers and Transformer
    diffusion_gemma, gemma_layers  DiffusionGemma, a block-diffusion LM of its own shape (Gemma 4 layers)
"""

from nowait.model.attention import block_causal_mask
from nowait.model.config import ForwardCost, ModelConfig
from nowait.model.kv_cache import KVCache
from nowait.model.transformer import Transformer

__all__ = ["ForwardCost", "KVCache", "ModelConfig", "Transformer", "block_causal_mask"]
