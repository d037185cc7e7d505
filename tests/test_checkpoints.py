"""Hugging Face checkpoint directories: round trip, config, and clear errors for bad directories."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from nowait.checkpoints import CheckpointError, load_pretrained, save_pretrained

VARIANTS = {
    "causal_tied": {},
    "causal_untied_bias": {"tie_embeddings": False, "qkv_bias": True},
    "diffusion_shift": {"causal": False, "logits_shift": True, "mask_token_id": 7},
    "diffusion_untied": {"causal": False, "tie_embeddings": False, "mask_token_id": 3},
}


def sample_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def saved(tmp_path, make_model, codec):
    """A causal tied checkpoint directory and the model it came from."""
    model = make_model(seed=1)
    return save_pretrained(model, codec, tmp_path / "ckpt"), model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_gives_identical_logits(tmp_path, make_model, codec, variant):
    model = make_model(seed=2, **VARIANTS[variant])
    directory = save_pretrained(model, codec, tmp_path / variant, notes={"step": 3})
    loaded = load_pretrained(directory)
    config = loaded.model.config
    for name in ("causal", "logits_shift", "tie_embeddings", "qkv_bias", "num_kv_heads", "head_dim",
                 "vocab_size", "rms_norm_eps", "rope_theta"):
        assert getattr(config, name) == getattr(model.config, name), name
    expected_mask = model.config.mask_token_id if model.config.mask_token_id is not None else codec.mask_id
    assert config.mask_token_id == expected_mask
    assert loaded.engine_kind == ("ar" if model.config.causal else "diffusion")
    assert (loaded.model.lm_head is None) == model.config.tie_embeddings
    assert not loaded.model.training
    with torch.no_grad():
        assert torch.equal(loaded.model(sample_ids()), model(sample_ids()))
    assert loaded.codec.encode("Name: Ada Okafor") == codec.encode("Name: Ada Okafor")
    assert loaded.generation["eos_token_id"] == codec.end_id
    assert loaded.hf_config["nowait"]["training"] == {"step": 3}


def test_config_json_is_a_llama_config(saved):
    directory, model = saved
    hf = json.loads((directory / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert hf["model_type"] == "llama"
    assert hf["num_hidden_layers"] == model.config.num_layers
    assert hf["num_key_value_heads"] == model.config.num_kv_heads
    assert hf["tie_word_embeddings"] is True
    names = set(load_file(str(directory / "model.safetensors")))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (directory / name).is_file()


def test_untied_checkpoint_names_lm_head(tmp_path, make_model, codec):
    directory = save_pretrained(make_model(tie_embeddings=False), codec, tmp_path / "untied")
    assert "lm_head.weight" in set(load_file(str(directory / "model.safetensors")))


def test_truncated_weights_raise_checkpoint_error(saved):
    directory, _ = saved
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted or truncated"):
        load_pretrained(directory)


def test_missing_tensor_is_named(saved):
    directory, _ = saved
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        load_pretrained(directory)


def test_unexpected_tensor_is_named(saved):
    directory, _ = saved
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(4)  # a layer this architecture lacks
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match=r"unexpected \['model\.layers\.0\.self_attn\.q_norm\.weight'\]"):
        load_pretrained(directory)


def test_unsupported_architecture(saved):
    directory, _ = saved
    config_path = directory / "config.json"
    hf = json.loads(config_path.read_text())
    hf["architectures"] = ["MambaForCausalLM"]
    config_path.write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="unsupported architecture 'MambaForCausalLM'"):
        load_pretrained(directory)


def test_missing_files_and_directory(saved, tmp_path):
    directory, _ = saved
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_pretrained(tmp_path / "absent")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing tokenizer\.json"):
        load_pretrained(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_pretrained(directory)


def test_load_in_bfloat16(saved):
    directory, model = saved
    loaded = load_pretrained(directory, dtype="bfloat16")
    dtypes = {p.dtype for p in loaded.model.parameters()}
    assert dtypes == {torch.bfloat16}
    with torch.no_grad():
        logits = loaded.model(sample_ids())
        reference = model(sample_ids())
    assert logits.dtype == torch.bfloat16
    assert_close(logits.float(), reference, atol=0.25, rtol=0.05)


def test_an_export_cut_short_leaves_the_previous_weights_whole(tmp_path, codec, monkeypatch):
    from tests.conftest import build_model

    save_pretrained(build_model(1, vocab_size=codec.vocab_size), codec, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def cut_short(state, filename, metadata=None):
        with open(filename, "wb") as half:
            half.write(before[: len(before) // 2])
        raise OSError("no space left on device")

    monkeypatch.setattr("nowait.checkpoints.save_file", cut_short)
    with pytest.raises(OSError, match="no space"):
        save_pretrained(build_model(2, vocab_size=codec.vocab_size), codec, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before  # not the half written beside it
    assert load_pretrained(tmp_path).model is not None
