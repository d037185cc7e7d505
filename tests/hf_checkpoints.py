"""Tiny random checkpoints in the real Hugging Face layouts, built inside the tests (no download).

Llama and Qwen2 come from transformers' own classes (`save_pretrained`, safetensors, sharded on
request). LLaDA and Dream have no class in transformers, so their files are written here from a
transformers Llama / Qwen2 model's weights renamed into their layouts, with their config keys;
that reference model, run without its causal mask, is what nowait's bidirectional logits are
checked against. The renaming tables below are written from the published checkpoints
(GSAI-ML/LLaDA-8B-Instruct, Dream-org/Dream-v0-Instruct-7B), independently of nowait's mapping.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 320  # the model's rows; the tokenizer uses fewer (real models pad their embeddings too)
TOKENIZER_VOCAB = 300
TRAINING_TEXT = ["the cat sat on the mat.", "Name the cat.", "You are a helpful assistant.", "hello world",
                 "Be brief. The answer is 42!", "system user assistant"] * 4

# Chat templates in the style of the real ones (tokens renamed to each family's).
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                   "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
                   "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
                   "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FAMILIES = {
    # special tokens (ids 0..n-1 in this order), tokenizer_config entries, chat template
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, LLAMA3_TEMPLATE),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, CHATML_TEMPLATE),
    "llada": (["<|startoftext|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
               "<|mdm_mask|>"],
              {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>"},
              LLAMA3_TEMPLATE),
    "dream": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"],
              {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>"},
              CHATML_TEMPLATE),
}


def token_id(family: str, token: str) -> int:
    return FAMILIES[family][0].index(token)


def write_tokenizer(directory: Path, family: str) -> None:
    """tokenizer.json (byte-level BPE, as Llama 3 and Qwen2 use, the family's special tokens
    first) and a tokenizer_config.json holding the chat template, as published checkpoints ship."""
    specials, entries, template = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    if family in ("llama", "llada"):  # Llama 3's tokenizer adds BOS itself to raw text
        bos = entries["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              **{k: v for k, v in entries.items() if v is not None}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that every path moves the logits (transformers' 0.02 init would let a
    wrong mask or rotary hide under a 1e-4 tolerance): linears std 1/sqrt(fan_in), norms near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * noise)
            elif parameter.dim() == 1:
                parameter.copy_(0.3 * noise)
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))
    return model.eval()


def hf_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=[1, 4])
    torch.manual_seed(seed)
    return perturb(LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})), seed)


def hf_qwen2(seed: int = 0, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, eos_token_id=[2, 0])
    torch.manual_seed(seed)
    return perturb(Qwen2ForCausalLM(Qwen2Config(**{**settings, **overrides})), seed)


def save_hf(model, directory: Path, family: str, max_shard_size: str | None = None) -> Path:
    """transformers' own save_pretrained (safetensors; sharded with an index when asked)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory, family)
    return directory


def write_weights(directory: Path, state: dict[str, torch.Tensor], shards: int = 1) -> None:
    """model.safetensors, or `shards` files and model.safetensors.index.json (the hub layout)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in state.items()}
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(state)
    weight_map = {}
    for k in range(shards):
        file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[k::shards]}
        save_file(part, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def llada_name(hf_name: str) -> str:
    """A transformers Llama parameter name in LLaDA-8B's (OLMo-style) layout."""
    top = {"model.embed_tokens.weight": "model.transformer.wte.weight",
           "model.norm.weight": "model.transformer.ln_f.weight",
           "lm_head.weight": "model.transformer.ff_out.weight"}
    if hf_name in top:
        return top[hf_name]
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
             "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out", "post_attention_layernorm": "ff_norm",
             "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out"}
    _, _, index, rest = hf_name.split(".", 3)
    module, parameter = rest.rsplit(".", 1)
    return f"model.transformer.blocks.{index}.{block[module]}.{parameter}"


def llada_checkpoint(directory: Path, seed: int = 0, shards: int = 1):
    """A tiny LLaDA checkpoint (no GQA, untied ff_out, as LLaDA-8B) and its Llama reference."""
    reference = hf_llama(seed, num_key_value_heads=4, eos_token_id=1)
    c = reference.config
    mask_id = token_id("llada", "<|mdm_mask|>")
    config = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "attention_dropout": 0.0,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
        "block_group_size": 1, "block_type": "llama", "d_model": c.hidden_size, "embedding_dropout": 0.0,
        "embedding_size": c.vocab_size, "eos_token_id": token_id("llada", "<|endoftext|>"),
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": mask_id, "max_sequence_length": 128,
        "mlp_hidden_size": c.intermediate_size, "mlp_ratio": 4, "multi_query_attention": None,
        "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "n_layers": c.num_hidden_layers,
        "pad_token_id": token_id("llada", "<|endoftext|>"), "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": c.rms_norm_eps, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
        "scale_logits": False, "use_cache": False, "vocab_size": c.vocab_size, "weight_tying": False,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    write_weights(directory, {llada_name(k): v for k, v in reference.state_dict().items()}, shards)
    write_tokenizer(directory, "llada")
    return reference


def dream_checkpoint(directory: Path, seed: int = 0, shards: int = 1):
    """A tiny Dream checkpoint (Qwen2 names, q/k/v biases, untied head) and its Qwen2 reference."""
    reference = hf_qwen2(seed, tie_word_embeddings=False, eos_token_id=0)
    c = reference.config
    config = {
        "architectures": ["DreamModel"], "model_type": "Dream",
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "mask_token_id": token_id("dream", "<|mask|>"), "max_position_embeddings": 128, "max_window_layers": 28,
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads, "pad_token_id": 0, "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": c.vocab_size,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    write_weights(directory, dict(reference.state_dict()), shards)
    write_tokenizer(directory, "dream")
    return reference


@torch.no_grad()
def bidirectional_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    """transformers' forward with an all-zero additive 4D mask: every position sees every other."""
    length = ids.shape[1]
    mask = torch.zeros(ids.shape[0], 1, length, length)
    return reference(ids, attention_mask=mask).logits


@torch.no_grad()
def causal_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    return reference(ids).logits


def sample_ids(length: int = 12, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
