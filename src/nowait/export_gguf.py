"""`nowait export-gguf`: a causal Llama checkpoint as one GGUF file (f32) that llama.cpp runs.

The weights are the loaded model's, under llama.cpp's tensor names, with two layout changes:
- q and k rows are permuted per head. nowait (like Hugging Face) rotates the two halves of a
  head, pairing dimension i with i + D/2; llama.cpp's Llama rotary pairs adjacent dimensions
  (2j, 2j + 1). Moving row i + D/2 next to row i makes llama.cpp rotate the same pairs, so
  q.k is unchanged (`interleave_rotary`; `split_rotary` undoes it).
- a tied head is not written: llama.cpp reuses token_embd when `output.weight` is absent.

The tokenizer goes in as GGUF metadata. nowait's pre-tokenizer (`nowait.tokenizer`) is a regex
with a lookbehind and upper-case classes that llama.cpp's built-in pre-tokenizers cannot express,
so the file names llama.cpp's coarsest one instead: "sarvam-moe" splits only at newline runs,
writes spaces as U+2581 and reads tokens as UTF-8 text, not byte-level symbols. Coarser is safe
wherever no merge of the vocabulary spans one of nowait's boundaries (the bundled vocabulary has
no token joining a newline to anything, and BPE cannot merge across a boundary it never saw), so
llama.cpp gives nowait's ids on most text; `nowait bench peers --peer llama.cpp` counts where not.
Tokens are therefore written as their UTF-8 text (space as U+2581), single bytes that are not
text as `<0xXX>` (llama.cpp's byte fallback), partial UTF-8 sequences, which llama.cpp can never
form from text, as unused `<0xXX><0xYY>` names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nowait.checkpoints import LoadedModel
from nowait.engines.structured.token_automaton import byte_level_decoding

PRE_TOKENIZER = "sarvam-moe"
SPACE = "\u2581"
MISSING = "export-gguf needs the gguf package, the optional extra: pip install 'nowait[peers]' (gguf==0.19.0)"
# GGUF token types (gguf.TokenType), repeated so the tokenizer mapping needs no gguf import.
NORMAL, CONTROL, UNUSED, BYTE = 1, 3, 5, 6

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


class ExportError(ValueError):
    """A checkpoint this exporter cannot write as a llama.cpp Llama (one clear line)."""


def interleave_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k projection rows from the half-split rotary layout to llama.cpp's adjacent pairs:
    within each head, new row 2j + h is old row h * D/2 + j."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def split_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `interleave_rotary`: llama.cpp's q/k rows back in nowait's layout."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name for a tensor of nowait's state dict."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ExportError(f"tensor {name!r} has no llama.cpp Llama counterpart")


def gguf_tensors(loaded: LoadedModel) -> dict[str, np.ndarray]:
    """Every weight as llama.cpp reads it (f32, q/k rows interleaved), by GGUF name."""
    config = loaded.model.config
    out: dict[str, np.ndarray] = {}
    for name, tensor in loaded.model.state_dict().items():
        weight = tensor.detach().to(device="cpu", dtype=torch.float32)
        if name.endswith("q_proj.weight"):
            weight = interleave_rotary(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = interleave_rotary(weight, config.num_kv_heads)
        out[gguf_tensor_name(name)] = weight.contiguous().numpy()
    return out


@dataclass(frozen=True)
class GgufVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]


def _as_text(symbols: str, decoder: dict[str, int]) -> str | None:
    """A byte-level token as llama.cpp's UTF-8 form (space as U+2581); None for partial UTF-8."""
    try:
        return bytes(decoder[c] for c in symbols).decode("utf-8").replace(" ", SPACE)
    except (UnicodeDecodeError, KeyError):
        return None


def _hex(symbols: str, decoder: dict[str, int]) -> str:
    return "".join(f"<0x{decoder[c]:02X}>" for c in symbols)


def gguf_vocab(tokenizer_json: dict, vocab_size: int) -> GgufVocab:
    """Tokens, token types and merges of a byte-level BPE tokenizer.json for llama.cpp, id for id;
    embedding rows beyond the tokenizer get unused placeholder names."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(tokenizer_json.get("pre_tokenizer")):
        raise ExportError("export-gguf writes byte-level BPE tokenizers only")
    decoder = byte_level_decoding()
    by_id: dict[int, tuple[str, int]] = {}
    for symbols, token_id in model["vocab"].items():
        text = _as_text(symbols, decoder)
        if text is not None:
            by_id[token_id] = (text, NORMAL)
        else:
            by_id[token_id] = (_hex(symbols, decoder), BYTE if len(symbols) == 1 else UNUSED)
    for added in tokenizer_json.get("added_tokens") or []:
        by_id[added["id"]] = (added["content"], CONTROL if added.get("special") else NORMAL)
    if max(by_id) >= vocab_size:
        raise ExportError(f"the tokenizer has id {max(by_id)}, beyond the model's {vocab_size} embedding rows")
    entries = [by_id.get(i, (f"[unused{i}]", UNUSED)) for i in range(vocab_size)]
    texts = [text for text, _ in entries]
    if len(set(texts)) != len(texts):
        raise ExportError("two tokens have the same UTF-8 text; llama.cpp could not tell them apart")
    merges = []
    for pair in model.get("merges") or []:
        left, right = pair if isinstance(pair, list) else pair.split(" ", 1)
        parts = (_as_text(left, decoder), _as_text(right, decoder))
        # A merge of partial UTF-8 sequences: llama.cpp starts from whole characters and never
        # meets it. Dropping it keeps the others' order, which is all their ranks are.
        if None not in parts:
            merges.append(f"{parts[0]} {parts[1]}")
    return GgufVocab(texts, [kind for _, kind in entries], merges)


def import_gguf():
    """The gguf package, or ExportError naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise ExportError(MISSING) from None
    return gguf


def export_gguf(loaded: LoadedModel, out: str | Path) -> dict:
    """Write `loaded` (a causal Llama-shaped model with a byte-level BPE tokenizer) to `out`;
    returns what was written."""
    gguf = import_gguf()
    config = loaded.model.config
    if not config.causal:
        raise ExportError(f"{loaded.path}: a diffusion checkpoint; llama.cpp's Llama attends causally")
    if config.qkv_bias or config.rope_scaling or config.logits_shift:
        raise ExportError(f"{loaded.path}: export-gguf writes plain Llama checkpoints (no qkv bias, rope scaling)")
    vocab = gguf_vocab(json.loads(loaded.codec.tokenizer.to_str()), config.vocab_size)
    tensors = gguf_tensors(loaded)
    end_id = loaded.codec.end_id
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(loaded.path.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for BPE with merges
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if end_id is not None:
        # No BOS exists: the end token stands in (as GPT-2's does), and none is ever added.
        writer.add_bos_token_id(end_id)
        writer.add_eos_token_id(end_id)
        writer.add_pad_token_id(end_id)
    if loaded.codec.mask_id is not None:
        writer.add_mask_token_id(loaded.codec.mask_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if loaded.conventions.chat_template:
        writer.add_chat_template(loaded.conventions.chat_template)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": str(out), "tensors": len(tensors), "tokens": len(vocab.tokens), "merges": len(vocab.merges),
            "pre_tokenizer": PRE_TOKENIZER, "bytes": out.stat().st_size}
