"""How each checkpoint family maps onto nowait's one Transformer: its config keys and tensor names.

One `Architecture` per `architectures[0]` of a config.json: a reader that turns the config into a
`ModelConfig` (refusing, by name, any feature the Transformer does not implement, so a model is
never run subtly wrong), and the name each nowait parameter has in the file.

- LlamaForCausalLM, Qwen2ForCausalLM: causal; also the demo models, whose config carries a
  `nowait` section (bidirectional, mask token, logit shift) that Llama's keys cannot say.
- LLaDAModelLM (GSAI-ML/LLaDA-8B): OLMo-style config (d_model, n_layers, mlp_hidden_size) and
  tensor names (`model.transformer.blocks.N.attn_out`), bidirectional, mask token 126336.
- DreamModel (Dream-org/Dream-v0-7B): Qwen2's config and names, bidirectional, and its logits
  shifted by one (position i predicts token i + 1, inherited from the AR model it started from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nowait.checkpoint_files import CheckpointError
from nowait.model import ModelConfig


@dataclass(frozen=True)
class Architecture:
    read_config: Callable[[dict], ModelConfig]
    tensor_name: Callable[[str], str]  # nowait parameter name -> name in the file

    def head_name(self) -> str:
        """The file's name for an untied output head (a tied checkpoint may still carry a copy)."""
        return self.tensor_name("lm_head.weight")


def _refuse(feature: str) -> CheckpointError:
    return CheckpointError(f"config.json: {feature} is not supported by nowait's transformer")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or the older `rope_theta` and
    `rope_scaling` keys that most published checkpoints still use."""
    parameters = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if float(parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise _refuse("partial rotary embeddings (partial_rotary_factor)")
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in parameters]
        if missing:
            raise CheckpointError(f"config.json: llama3 RoPE scaling lacks {missing}")
        return theta, {"rope_type": "llama3", **{k: parameters[k] for k in keys}}
    raise _refuse(f"RoPE scaling {kind!r} (supported: default, llama3)")


def _check_activation(name: object) -> None:
    if name != "silu":
        raise _refuse(f"activation {name!r} (SwiGLU with silu only)")


def llama_shape(hf: dict) -> ModelConfig:
    """The dense shape a Llama-family config.json describes, checking nothing: the planner costs
    any such config (Mistral, Mixtral, Qwen2-MoE) with it; loading adds `_llama_config`'s checks."""
    extra = hf.get("nowait") or {}
    parameters = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rope_theta=float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=bool(hf.get("attention_bias", False)) or hf.get("model_type") == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        causal=extra.get("causal", True),
        max_position=hf.get("max_position_embeddings", 2048),
        mask_token_id=extra.get("mask_token_id"),
        logits_shift=extra.get("logits_shift", False),
    )


def _has_sliding_layers(hf: dict) -> bool:
    """Whether any layer attends through a sliding window, as transformers decides it: by
    `layer_types` when given, else Qwen2's rule (with `use_sliding_window`, the layers from
    `max_window_layers` on slide; a value at or past the layer count leaves every layer full)."""
    if hf.get("layer_types"):
        return "sliding_attention" in hf["layer_types"]
    if not hf.get("use_sliding_window"):
        return False
    window_from = hf.get("max_window_layers")
    return window_from is None or window_from < hf.get("num_hidden_layers", 0)


def _llama_config(hf: dict) -> ModelConfig:
    _check_activation(hf.get("hidden_act", "silu"))
    if hf.get("mlp_bias"):
        raise _refuse("MLP biases (mlp_bias)")
    # Llama's attention_bias puts a bias on o_proj too; nowait's own configs (with a `nowait`
    # section) use the key for q/k/v only, and the Transformer has no o_proj bias.
    if hf.get("attention_bias") and hf.get("nowait") is None and hf.get("model_type") != "qwen2":
        raise _refuse("attention_bias on a Llama checkpoint (an o_proj bias)")
    if _has_sliding_layers(hf):
        raise _refuse("sliding-window attention")
    config = llama_shape(hf)
    config.rope_theta, config.rope_scaling = _rope(hf)
    return config


def _llama_tensor_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _dream_config(hf: dict) -> ModelConfig:
    """Qwen2's keys; Dream's attention always has q/k/v biases and no causal mask."""
    config = _llama_config({**hf, "model_type": "qwen2", "nowait": None})
    config.causal = False
    config.logits_shift = True
    config.mask_token_id = hf.get("mask_token_id")
    return config


def _llada_config(hf: dict) -> ModelConfig:
    """LLaDA's OLMo-style config. Only the "llama" block (separate q/k/v, SwiGLU as ff_proj and
    up_proj, RMSNorm, RoPE) is what LLaDA-8B uses and what the Transformer implements."""
    expected = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu"}
    for key, value in expected.items():
        if hf.get(key, value) != value:
            raise _refuse(f"{key} {hf[key]!r} (LLaDA with {value!r} only)")
    refused = {"alibi": "ALiBi", "attention_layer_norm": "q/k layer norms", "include_bias": "biases (include_bias)",
               "scale_logits": "scale_logits", "input_emb_norm": "input_emb_norm",
               "multi_query_attention": "multi_query_attention", "clip_qkv": "clip_qkv",
               "bias_for_layer_norm": "layer-norm biases"}
    for key, feature in refused.items():
        if hf.get(key):
            raise _refuse(feature)
    if not hf.get("rope", True):
        raise _refuse("absolute position embeddings (rope: false)")
    if hf.get("layer_norm_with_affine") is False:
        raise _refuse("layer norms without weights")
    if (hf.get("block_group_size") or 1) != 1:
        raise _refuse("block_group_size other than 1")
    d_model, heads = hf["d_model"], hf["n_heads"]
    return ModelConfig(
        # The embedding matrix may be padded past the tokenizer's vocabulary (embedding_size).
        vocab_size=hf.get("embedding_size") or hf["vocab_size"],
        hidden_size=d_model,
        intermediate_size=hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * d_model,
        num_layers=hf["n_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("n_kv_heads") or heads,
        head_dim=d_model // heads,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        qkv_bias=bool(hf.get("include_qkv_bias", False)),
        tie_embeddings=bool(hf.get("weight_tying", False)),
        causal=False,
        max_position=hf.get("max_sequence_length", 4096),
        mask_token_id=hf.get("mask_token_id"),
    )


_LLADA_TOP = {"embed_tokens.weight": "model.transformer.wte.weight",
              "norm.weight": "model.transformer.ln_f.weight",
              "lm_head.weight": "model.transformer.ff_out.weight"}
_LLADA_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
                "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out", "post_attention_layernorm": "ff_norm",
                "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out"}


def _llada_tensor_name(name: str) -> str:
    """`layers.3.mlp.gate_proj.weight` -> `model.transformer.blocks.3.ff_proj.weight` (OLMo's
    names: ff_proj is the gated half that goes through silu, ff_out the down projection)."""
    if name in _LLADA_TOP:
        return _LLADA_TOP[name]
    _, index, rest = name.split(".", 2)
    module, parameter = rest.rsplit(".", 1)
    return f"model.transformer.blocks.{index}.{_LLADA_BLOCK[module]}.{parameter}"


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(_llama_config, _llama_tensor_name),
    "Qwen2ForCausalLM": Architecture(_llama_config, _llama_tensor_name),
    "LLaDAModelLM": Architecture(_llada_config, _llada_tensor_name),
    "DreamModel": Architecture(_dream_config, _llama_tensor_name),
}


def architecture_for(hf: dict) -> Architecture:
    names = hf.get("architectures") or ["?"]
    architecture = ARCHITECTURES.get(names[0])
    if architecture is None:
        raise CheckpointError(f"unsupported architecture {names[0]!r} (supported: {', '.join(ARCHITECTURES)})")
    return architecture


def read_model_config(architecture: Architecture, hf: dict) -> ModelConfig:
    """The ModelConfig of a config.json; a missing key or an unsupported feature is a CheckpointError."""
    try:
        return architecture.read_config(hf)
    except CheckpointError:
        raise
    except KeyError as error:
        raise CheckpointError(f"config.json: missing key {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"config.json: {error}") from None
