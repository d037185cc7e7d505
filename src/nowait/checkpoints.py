"""Hugging Face checkpoint directories in and out: config.json, safetensors weights, tokenizer.

Loading reads any architecture of `nowait.architectures` (Llama, Qwen2, LLaDA, Dream, and the
demo models, which are written as Llama checkpoints plus a `nowait` config section for what
Llama's config cannot say: bidirectional attention, the mask token, Dream's logit shift), from
one model.safetensors or an index and its shards, in the dtype and on the device asked for.
The model is built on the meta device and each tensor is read, converted and assigned in
turn, so an 8B checkpoint never sits in memory twice. The tokenizer files give the model's
conventions (`nowait.conventions`): end ids, mask id, chat template.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from nowait.architectures import ARCHITECTURES, Architecture, architecture_for, read_model_config
from nowait.checkpoint_files import CheckpointError, iter_tensors, read_json, tensor_names, weight_files
from nowait.conventions import ModelConventions, read_conventions
from nowait.gemma_checkpoint import ARCHITECTURE as GEMMA_ARCHITECTURE
from nowait.gemma_checkpoint import diffusion_gemma_config, load_diffusion_gemma
from nowait.hub_tokenizer import read_tokenizer
from nowait.model import ModelConfig, Transformer
from nowait.model.transformer import fuse_projections
from nowait.paths import write_replacing
from nowait.tokenizer import END, MASK, TextCodec

__all__ = ["ARCHITECTURES", "CheckpointError", "LoadedModel", "load_pretrained", "save_pretrained"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
ENGINE_KINDS = ("ar", "diffusion")


def _llama_tensor_name(name: str) -> str:
    return ARCHITECTURES["LlamaForCausalLM"].tensor_name(name)


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
        **({"rope_scaling": config.rope_scaling} if config.rope_scaling else {}),
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "nowait": {
            "engine": "ar" if config.causal else "diffusion",
            "causal": config.causal,
            "mask_token_id": config.mask_token_id,
            "logits_shift": config.logits_shift,
        },
    }


def tokenizer_config() -> dict:
    """The demo models' tokenizer_config.json: the special tokens, the chat template, and what
    makes transformers' `AutoTokenizer` give nowait's ids. Without a `tokenizer_class` it picks
    the class from config.json's `model_type: llama` (LlamaTokenizerFast), which adds `<s>` and
    `<unk>` beyond the vocabulary and prepends a BOS to every encode; the plain fast tokenizer
    with no BOS, no EOS and no clean-up of spaces encodes and decodes as `TextCodec` does."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "unk_token": None,
        "eos_token": END, "pad_token": END, "mask_token": MASK,
        "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }


def save_pretrained(model: Transformer, codec: TextCodec, directory: str | Path,
                    generation: dict | None = None, notes: dict | None = None) -> Path:
    """Write a self-contained checkpoint directory (weights, config, tokenizer, generation)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # .clone(): the state dict's q/k/v and gate/up are views of the fused tensors, and safetensors
    # refuses tensors that share memory.
    state = {_llama_tensor_name(k): v.detach().cpu().clone() for k, v in model.state_dict().items()}
    # Replaced whole: `nowait train` exports over the bundled model, and a kill mid-write would
    # leave it truncated.
    write_replacing(directory / "model.safetensors", lambda partial: save_file(state, str(partial),
                                                                               metadata={"format": "pt"}))
    hf = config_to_hf(model.config)
    if notes:
        hf["nowait"]["training"] = notes
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    codec.tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
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
    conventions: ModelConventions

    @property
    def engine_kind(self) -> str:
        return "ar" if self.model.config.causal else "diffusion"


def torch_dtype(dtype: str | torch.dtype, hf_config: dict | None = None) -> torch.dtype:
    """`auto`: the checkpoint's own (config.json `torch_dtype`, or `dtype` in newer files), float32
    when it names none."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stated = (hf_config or {}).get("torch_dtype") or (hf_config or {}).get("dtype") or "float32"
        if stated not in DTYPES:
            raise ValueError(f"config.json names the dtype {stated!r}; pass float32, bfloat16 or float16")
        return DTYPES[stated]
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose float32, bfloat16, float16 or auto")
    return DTYPES[dtype]


def check_device(device: str) -> None:
    """Refuse a device this machine does not have before reading gigabytes of weights."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu or cuda (cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")


def load_weights(directory: Path, architecture: Architecture, config: ModelConfig, dtype: torch.dtype,
                 device: str) -> Transformer:
    """The Transformer of `config` with every parameter read from the directory's safetensors.

    Every tensor in the files must map to a parameter and every parameter must be in the files
    (a tied checkpoint may also carry the head's duplicate, which is skipped), so a mapping
    mistake is an error naming the tensors, never a silently random layer.
    """
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    expected = {architecture.tensor_name(name): name for name in shapes}
    files = weight_files(directory)
    where = tensor_names(files)
    skipped = {architecture.head_name()} if config.tie_embeddings else set()
    missing = sorted(set(expected) - set(where))
    # Older Llama conversions store each layer's RoPE inverse frequencies, a buffer computed from
    # the config anyway (transformers ignores them too).
    unexpected = sorted(n for n in set(where) - set(expected) - skipped if not n.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise CheckpointError(f"{directory}: tensors missing {missing[:5]} unexpected {unexpected[:5]} "
                              f"({len(missing)} missing and {len(unexpected)} unexpected in all)")

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        want = shapes[expected[name]]
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{where[name]}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {want}")
        return tensor.to(device=device, dtype=dtype)

    state = {expected[name]: tensor for name, tensor in iter_tensors(files, expected, convert)}
    fuse_projections(state, config)  # the model computes q/k/v and gate/up fused (nowait.model.transformer)
    model.load_state_dict(state, assign=True)
    head = architecture.head_name()
    if config.tie_embeddings and head in where:
        # A tied checkpoint may carry the head's copy; one that differs means the file is not
        # tied after all, and using the embedding would compute other logits than its authors'.
        for _, tensor in iter_tensors(files, {head}, lambda _name, t: t.to(device=device, dtype=dtype)):
            if not torch.equal(tensor, model.embed_tokens.weight):
                raise CheckpointError(f"{where[head]}: config.json ties the output head to the embeddings "
                                      f"(tie_word_embeddings) but {head!r} differs from them: set "
                                      "tie_word_embeddings to false if the head is its own")
    return model


def load_pretrained(directory: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
                    engine: str | None = None) -> LoadedModel:
    """Load a checkpoint directory; unknown architectures and missing/unexpected tensors are errors.

    `engine` ("ar" or "diffusion") overrides the attention the checkpoint declares (causal for
    AR); a diffusion engine needs a mask token, from config.json or tokenizer_config.json.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if engine is not None and engine not in ENGINE_KINDS:
        raise ValueError(f"unknown engine {engine!r}; choose ar or diffusion")
    if dtype != "auto":
        dtype = torch_dtype(dtype)  # a bad name is refused before anything is read
    check_device(device)
    hf = read_json(directory / "config.json")
    dtype = torch_dtype(dtype, hf)
    if (hf.get("architectures") or [None])[0] == GEMMA_ARCHITECTURE:
        return _load_diffusion_gemma(directory, hf, dtype, device, engine)
    try:
        architecture = architecture_for(hf)
        config = read_model_config(architecture, hf)
    except CheckpointError as error:
        raise CheckpointError(f"{directory}: {error}") from None
    if engine is not None:
        config.causal = engine == "ar"
    codec = TextCodec(read_tokenizer(directory))
    generation = read_json(directory / "generation_config.json", required=False)
    conventions = read_conventions(directory, hf, generation, codec, config)
    config.mask_token_id = conventions.mask_id
    if not config.causal and config.mask_token_id is None:
        raise CheckpointError(f"{directory}: a diffusion engine needs a mask token; neither config.json "
                              "(mask_token_id) nor tokenizer_config.json (mask_token) names one")
    model = load_weights(directory, architecture, config, dtype, device)
    return LoadedModel(model=model.eval(), codec=codec, hf_config=hf, generation=generation, path=directory,
                       conventions=conventions)


def _load_diffusion_gemma(directory: Path, hf: dict, dtype: torch.dtype, device: str,
                          engine: str | None) -> LoadedModel:
    """A DiffusionGemmaForBlockDiffusion directory: its text model (`nowait.gemma_checkpoint`)."""
    if engine == "ar":
        raise CheckpointError(f"{directory}: DiffusionGemma is a block-diffusion model; it has no AR engine")
    try:
        config = diffusion_gemma_config(hf)
    except CheckpointError as error:
        raise CheckpointError(f"{directory}: {error}") from None
    except KeyError as error:
        raise CheckpointError(f"{directory}: config.json: missing key {error.args[0]!r}") from None
    codec = TextCodec(read_tokenizer(directory))
    generation = read_json(directory / "generation_config.json", required=False)
    text = hf.get("text_config") or {}
    # The end ids sit in text_config (config.json's top level has none).
    conventions = read_conventions(directory, {**hf, "eos_token_id": hf.get("eos_token_id", text.get("eos_token_id"))},
                                   generation, codec, config)
    model = load_diffusion_gemma(directory, config, dtype, device)
    return LoadedModel(model=model, codec=codec, hf_config=hf, generation=generation, path=directory,
                       conventions=conventions)


def copy_checkpoint(source: str | Path, destination: str | Path) -> None:
    """Copy the files of a checkpoint directory (no training state) to `destination`."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "vocab.json", "merges.txt"):
        if (Path(source) / name).exists():
            shutil.copy2(Path(source) / name, destination / name)
