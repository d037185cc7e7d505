"""DiffusionGemmaForBlockDiffusion checkpoints (google/diffusiongemma-*): config and weights.

The text model only: the vision tower's and the image embedder's tensors are left unread, and a
prompt holding image tokens is refused by the engine. The config's `text_config` is read as
transformers' DiffusionGemmaTextConfig reads it (`per_layer_config` gives the global layers' head
size and key heads; `rope_parameters` is per layer type), refusing what nowait does not compute:
an encoder with bidirectional attention over text (`use_bidirectional_attention: "all"`),
attention biases, another activation, untied encoder and denoiser weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nowait.checkpoint_files import CheckpointError, iter_tensors, tensor_names, weight_files
from nowait.model.diffusion_gemma import GLOBAL, SLIDING, DiffusionGemma, DiffusionGemmaConfig

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
# Tensors of the vision tower and its projection into the text model: not read (text only).
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def _refuse(feature: str) -> CheckpointError:
    return CheckpointError(f"config.json: {feature} is not supported by nowait's DiffusionGemma")


def _layer_overrides(text: dict, layer: int) -> dict:
    """A global layer's own head size and key heads. Without `per_layer_config` (a config.json
    written as Gemma 4's are), transformers' DiffusionGemmaTextConfig.__post_init__ builds it from
    `global_head_dim` (default 512) and `num_global_key_value_heads` (when given)."""
    if "per_layer_config" not in text:
        overrides = {"head_dim": text.get("global_head_dim", 512)}
        if text.get("num_global_key_value_heads") is not None:
            overrides["num_key_value_heads"] = text["num_global_key_value_heads"]
        return overrides
    per_layer = text.get("per_layer_config") or {}
    return per_layer.get(str(layer)) or per_layer.get(layer) or {}


def diffusion_gemma_config(hf: dict) -> DiffusionGemmaConfig:
    """The DiffusionGemmaConfig of a DiffusionGemmaForBlockDiffusion config.json."""
    text = hf.get("text_config") or {}
    if text.get("use_bidirectional_attention") == "all":
        raise _refuse("an encoder with bidirectional attention over text (use_bidirectional_attention 'all')")
    if text.get("attention_bias"):
        raise _refuse("attention biases (attention_bias)")
    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise _refuse(f"activation {text['hidden_activation']!r} (gelu_pytorch_tanh only)")
    if hf.get("tie_word_embeddings") is False or text.get("tie_word_embeddings") is False:
        raise _refuse("untied encoder and denoiser weights (tie_word_embeddings false)")
    if not text.get("num_experts") or not text.get("top_k_experts"):
        raise _refuse("layers without routed experts (num_experts)")
    layer_types = list(text["layer_types"])
    if any(kind not in (SLIDING, GLOBAL) for kind in layer_types):
        raise _refuse(f"layer types {sorted(set(layer_types) - {SLIDING, GLOBAL})}")
    head_dims, kv_heads = [], []
    for index, kind in enumerate(layer_types):
        overrides = _layer_overrides(text, index) if kind == GLOBAL else {}
        head_dims.append(int(overrides.get("head_dim", text["head_dim"])))
        kv_heads.append(int(overrides.get("num_key_value_heads", text["num_key_value_heads"])))
    rope = text.get("rope_parameters") or {}
    for kind in set(layer_types):
        if rope.get(kind, {}).get("rope_type", "default") not in ("default", "proportional"):
            raise _refuse(f"RoPE {rope[kind]['rope_type']!r} on {kind} layers")
        if rope.get(kind, {}).get("factor", 1.0) != 1.0:
            raise _refuse(f"RoPE scaling factor on {kind} layers")
    return DiffusionGemmaConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        num_heads=text["num_attention_heads"], layer_types=layer_types, head_dims=head_dims, kv_heads=kv_heads,
        rope={kind: rope[kind] for kind in set(layer_types)}, sliding_window=int(text["sliding_window"]),
        num_experts=int(text["num_experts"]), top_k_experts=int(text["top_k_experts"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]), canvas_length=int(hf.get("canvas_length") or 256),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
        max_position=int(text.get("max_position_embeddings", 131072)),
        extra={"image_token_id": hf.get("image_token_id"), "pad_token_id": text.get("pad_token_id"),
               "eos_token_id": text.get("eos_token_id"), "bos_token_id": text.get("bos_token_id")},
    )


def gemma_tensor_name(name: str) -> str:
    """nowait parameter name -> checkpoint name: the denoiser's (`model.decoder.`), whose weights
    the encoder ties to; each encoder layer's scalar is stored on its own."""
    if name.endswith(".encoder_layer_scalar"):
        return "model.encoder.language_model." + name.replace(".encoder_layer_scalar", ".layer_scalar")
    return "model.decoder." + name


def load_diffusion_gemma(directory: Path, config: DiffusionGemmaConfig, dtype: torch.dtype,
                         device: str) -> DiffusionGemma:
    """The model with every parameter read from the directory; missing or unexpected text
    tensors are a CheckpointError naming them (the vision tower's are skipped)."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    expected = {gemma_tensor_name(name): name for name in shapes}
    files = weight_files(directory)
    where = tensor_names(files)
    skipped = {"lm_head.weight"}  # the tied head's copy, when a conversion writes one
    missing = sorted(set(expected) - set(where))
    unexpected = sorted(n for n in set(where) - set(expected) - skipped if not n.startswith(VISION_PREFIXES))
    if missing or unexpected:
        raise CheckpointError(f"{directory}: tensors missing {missing[:5]} unexpected {unexpected[:5]} "
                              f"({len(missing)} missing and {len(unexpected)} unexpected in all)")

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != shapes[expected[name]]:
            raise CheckpointError(f"{where[name]}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {shapes[expected[name]]}")
        return tensor.to(device=device, dtype=dtype)

    state = {expected[name]: tensor for name, tensor in iter_tensors(files, expected, convert)}
    model.load_state_dict(state, assign=True, strict=False)
    # The rotary frequencies are computed, not stored: rebuild them off the meta device.
    for index in range(config.num_layers):
        setattr(model, f"inverse_frequency_{index}", config.inverse_frequencies(index).to(device))
    return model.eval()
