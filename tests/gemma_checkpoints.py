"""Tiny random DiffusionGemma checkpoints from transformers' own classes (no download).

`DiffusionGemmaForBlockDiffusion` built from a tiny config (sliding and global layers with their
own head sizes and key heads, routed experts, a small vision tower that nowait leaves unread),
its weights perturbed so every path moves the logits, written with `save_pretrained`, with a
tokenizer in Gemma's style beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 96
CANVAS = 8
SLIDING_WINDOW = 4
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
                  "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_config(**text_overrides):
    from transformers import DiffusionGemmaConfig

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                num_experts=4, top_k_experts=2, moe_intermediate_size=24, sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention", "full_attention", "full_attention"], max_position_embeddings=256,
                pad_token_id=0, eos_token_id=1, bos_token_id=2, **text_overrides)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS)
    # The loop over experts, as the reference spells it (not a fused kernel): the one to match.
    config._experts_implementation = "eager"
    return config


def reference_model(seed: int = 0, **text_overrides):
    """transformers' DiffusionGemmaForBlockDiffusion with perturbed weights: linears std
    0.5/sqrt(fan_in), norms and scales near 1, each layer's stored scalars away from 1."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_config(**text_overrides)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(("norm.weight", ".scale", "per_expert_scale")):
                parameter.copy_(1 + 0.2 * noise)
            elif parameter.dim() == 1:
                parameter.copy_(0.3 * noise)
            else:
                parameter.copy_(0.5 * noise / math.sqrt(parameter.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1 + 0.3 * torch.randn(1, generator=generator))
    return model


def write_gemma_tokenizer(directory: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])
    tokenizer.train_from_iterator(["the cat sat on the mat", "hello world"] * 4, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "chat_template": GEMMA_TEMPLATE}))


def diffusion_gemma_checkpoint(directory: Path, seed: int = 0, **text_overrides):
    """Write the reference model with save_pretrained and a tokenizer; return the model."""
    model = reference_model(seed, **text_overrides)
    model.save_pretrained(str(directory))
    write_gemma_tokenizer(directory)
    return model
