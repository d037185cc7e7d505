"""Hugging Face checkpoint directories in and out: config.json, model.safetensors, tokenizer.json.

The demo models are written as Llama checkpoints (config keys and tensor names of
LlamaForCausalLM) plus a `nowait` section for what Llama's config cannot say: bidirectional
attention, the mask token, Dream's logit shift. Each architecture is one entry of
`ARCHITECTURES` (config reader + tensor-name mapping), so other families add an entry.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nowait.model import ModelConfig, Transformer
from nowait.tokenizer import END, MASK, TextCodec

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says which file and why."""


@dataclass(frozen=True)
class Architecture:
    read_config: Callable[[dict], ModelConfig]
    tensor_name: Callable[[str], str]  # nowait parameter name -> name in the file


def _llama_config(hf: dict) -> ModelConfig:
    extra = hf.get("nowait", {})
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rope_theta=hf.get("rope_theta", 10000.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=bool(hf.get("attention_bias", False)) or hf.get("model_type") == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        causal=extra.get("causal", True),
        max_position=hf.get("max_position_embeddings", 2048),
        mask_token_id=extra.get("mask_token_id"),
        logits_shift=extra.get("logits_shift", False),
    )


def _llama_tensor_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(_llama_config, _llama_tensor_name),
    "Qwen2ForCausalLM": Architecture(_llama_config, _llama_tensor_name),
}


def config_to_hf(config: ModelConfig) -> dict:
    """A LlamaForCausalLM config.json for a nowait model (with its diffusion conventions)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": config.qkv_bias,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "nowait": {
            "engine": "ar" if config.causal else "diffusion",
            "causal": config.causal,
            "mask_token_id": config.mask_token_id,
            "logits_shift": config.logits_shift,
        },
    }


def save_pretrained(model: Transformer, codec: TextCodec, directory: str | Path,
                    generation: dict | None = None, notes: dict | None = None) -> Path:
    """Write a self-contained checkpoint directory (weights, config, tokenizer, generation)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {_llama_tensor_name(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(model.config)
    if notes:
        hf["nowait"]["training"] = notes
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    codec.tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": END, "pad_token": END, "mask_token": MASK,
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }, indent=2) + "\n")
    generation_config = {"eos_token_id": codec.end_id, "pad_token_id": codec.end_id, **(generation or {})}
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return directory


@dataclass
class LoadedModel:
    model: Transformer
    codec: TextCodec
    hf_config: dict
    generation: dict
    path: Path

    @property
    def engine_kind(self) -> str:
        return "ar" if self.model.config.causal else "diffusion"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: missing {path.name}") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: missing {path.name}") from None
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: corrupted or truncated safetensors file ({error})") from None


def load_pretrained(directory: str | Path, dtype: str | torch.dtype = "float32",
                    device: str = "cpu") -> LoadedModel:
    """Load a checkpoint directory; unknown architectures and missing/unexpected tensors are errors."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    hf = _read_json(directory / "config.json")
    names = hf.get("architectures") or ["?"]
    architecture = ARCHITECTURES.get(names[0])
    if architecture is None:
        raise CheckpointError(f"{directory}: unsupported architecture {names[0]!r} "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    config = architecture.read_config(hf)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = Transformer(config)
    tensors = _read_tensors(directory / "model.safetensors")
    expected = {architecture.tensor_name(k): k for k in model.state_dict()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{directory}: tensors missing {missing[:5]} unexpected {unexpected[:5]}")
    state = {expected[name]: tensor.to(device=device, dtype=torch_dtype) for name, tensor in tensors.items()}
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:
        model.lm_head = None
    codec = TextCodec.from_file(directory / "tokenizer.json") if (directory / "tokenizer.json").exists() else None
    if codec is None:
        raise CheckpointError(f"{directory}: missing tokenizer.json")
    if config.mask_token_id is None and codec.tokenizer.token_to_id(MASK) is not None:
        config.mask_token_id = codec.mask_id
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else {}
    return LoadedModel(model=model.eval(), codec=codec, hf_config=hf, generation=generation, path=directory)


def copy_checkpoint(source: str | Path, destination: str | Path) -> None:
    """Copy the files of a checkpoint directory (no training state) to `destination`."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        if (Path(source) / name).exists():
            shutil.copy2(Path(source) / name, destination / name)
