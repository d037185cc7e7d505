"""`nowait export-gguf`: a tiny checkpoint written as GGUF and read back with gguf's own reader
(every tensor, the shape metadata, the tokenizer), the rotary permutation against both rotary
conventions, and the refusals."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from typer.testing import CliRunner

from nowait.checkpoints import load_pretrained, save_pretrained
from nowait.cli import app
from nowait.export_gguf import (
    BYTE,
    CONTROL,
    MISSING,
    NORMAL,
    PRE_TOKENIZER,
    SPACE,
    ExportError,
    export_gguf,
    gguf_vocab,
    import_gguf,
    interleave_rotary,
    split_rotary,
)
from nowait.tokenizer import SPECIAL_TOKENS
from tests.conftest import build_model

gguf = pytest.importorskip("gguf")


def rotate_halves(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Llama/Hugging Face rotary on one head: dimension i turns with i + D/2."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos().repeat(2), angles.sin().repeat(2)
    return x * cos + torch.cat([-x[half:], x[:half]]) * sin


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Llama rotary on one head: dimensions 2j and 2j + 1 turn together."""
    even, odd = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2] = even * angles.cos() - odd * angles.sin()
    out[1::2] = even * angles.sin() + odd * angles.cos()
    return out


def test_interleaved_rows_under_pairwise_rotary_give_the_rows_under_half_rotary():
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden, dtype=torch.float64)
    x = torch.randn(hidden, dtype=torch.float64)
    angles = 7.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # position 7
    ours = (weight @ x).reshape(heads, head_dim)
    theirs = (interleave_rotary(weight, heads) @ x).reshape(heads, head_dim)
    for head in range(heads):
        expected = interleave_rotary(rotate_halves(ours[head], angles)[:, None], 1)[:, 0]
        torch.testing.assert_close(rotate_pairs(theirs[head], angles), expected)
    assert torch.equal(split_rotary(interleave_rotary(weight, heads), heads), weight)
    assert not torch.equal(interleave_rotary(weight, heads), weight)


@pytest.fixture
def exported(tmp_path, codec):
    model = build_model(vocab_size=codec.vocab_size)
    save_pretrained(model, codec, tmp_path / "tiny")
    result = CliRunner().invoke(app, ["export-gguf", str(tmp_path / "tiny"), str(tmp_path / "tiny.gguf")])
    assert result.exit_code == 0, result.output
    written = json.loads(result.output[result.output.index("{"):])
    assert written["path"] == str(tmp_path / "tiny.gguf") and written["pre_tokenizer"] == PRE_TOKENIZER
    return load_pretrained(tmp_path / "tiny"), gguf.GGUFReader(str(tmp_path / "tiny.gguf"))


def field(reader, key: str):
    return reader.fields[key].contents()


def test_every_tensor_reads_back_as_the_models_weight(exported):
    loaded, reader = exported
    config = loaded.model.config
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    state = loaded.model.state_dict()
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    assert len(tensors) == len(state) == 2 + 9 * config.num_layers
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    assert torch.equal(tensors["token_embd.weight"], state["embed_tokens.weight"])
    assert torch.equal(tensors["output_norm.weight"], state["norm.weight"])
    for layer in range(config.num_layers):
        ours, theirs = f"layers.{layer}.", f"blk.{layer}."
        assert torch.equal(split_rotary(tensors[theirs + "attn_q.weight"], config.num_heads),
                           state[ours + "self_attn.q_proj.weight"])
        assert torch.equal(split_rotary(tensors[theirs + "attn_k.weight"], config.num_kv_heads),
                           state[ours + "self_attn.k_proj.weight"])
        for gguf_name, name in [("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                                ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                                ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                                ("ffn_norm", "post_attention_layernorm")]:
            assert torch.equal(tensors[f"{theirs}{gguf_name}.weight"], state[f"{ours}{name}.weight"]), gguf_name


def test_the_metadata_states_the_models_shape(exported):
    loaded, reader = exported
    config = loaded.model.config
    assert field(reader, "general.architecture") == "llama"
    expected = {"context_length": config.max_position, "embedding_length": config.hidden_size,
                "block_count": config.num_layers, "feed_forward_length": config.intermediate_size,
                "attention.head_count": config.num_heads, "attention.head_count_kv": config.num_kv_heads,
                "rope.dimension_count": config.head_dim, "vocab_size": config.vocab_size}
    assert {key: field(reader, f"llama.{key}") for key in expected} == expected
    assert field(reader, "llama.rope.freq_base") == pytest.approx(config.rope_theta)
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(config.rms_norm_eps, rel=1e-6)


def test_the_tokenizer_is_written_id_for_id(exported):
    loaded, reader = exported
    codec = loaded.codec
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == PRE_TOKENIZER
    assert len(tokens) == len(types) == codec.vocab_size
    assert field(reader, "tokenizer.ggml.eos_token_id") == codec.end_id
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == CONTROL:
            assert text == codec.tokenizer.id_to_token(token_id)
        elif kind == NORMAL:  # the token's own text, spaces written as U+2581
            assert text.replace(SPACE, " ") == codec.tokenizer.decode([token_id]), token_id
        else:  # one byte of a longer UTF-8 character, as llama.cpp's byte fallback names it
            assert kind == BYTE and re.fullmatch(r"<0x[89A-F][0-9A-F]>", text), (token_id, text)
            assert codec.tokenizer.decode([token_id]) == "\ufffd"
    assert [i for i, kind in enumerate(types) if kind == CONTROL] == \
           sorted(codec.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)
    merges = field(reader, "tokenizer.ggml.merges")
    assert len(merges) == len(json.loads(codec.tokenizer.to_str())["model"]["merges"])
    assert all("".join(m.split(" ")) in set(tokens) for m in merges)  # each merge makes a token


def test_a_byte_that_is_not_text_becomes_llama_cpps_byte_token(codec):
    data = json.loads(codec.tokenizer.to_str())
    vocab = gguf_vocab(data, codec.vocab_size + 2)
    euro_first_byte = data["model"]["vocab"]["â"]  # 0xE2 in GPT-2's byte alphabet
    assert (vocab.tokens[euro_first_byte], vocab.types[euro_first_byte]) == ("<0xE2>", BYTE)
    assert vocab.tokens[-2:] == [f"[unused{codec.vocab_size}]", f"[unused{codec.vocab_size + 1}]"]


def test_a_diffusion_checkpoint_and_a_missing_gguf_are_refused(tmp_path, codec, monkeypatch):
    save_pretrained(build_model(vocab_size=codec.vocab_size, causal=False, mask_token_id=1), codec, tmp_path / "d")
    with pytest.raises(ExportError, match="diffusion"):
        export_gguf(load_pretrained(tmp_path / "d"), tmp_path / "d.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ExportError, match=r"nowait\[peers\]"):
        import_gguf()
    result = CliRunner().invoke(app, ["export-gguf", str(tmp_path / "d"), str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and MISSING in result.output
