"""Dream's hub tokenizer files (vocab.json, merges.txt, tokenizer_config.json, no tokenizer.json)
load with the ids transformers' Qwen2Tokenizer gives from the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from nowait.checkpoint_files import CheckpointError
from nowait.checkpoints import load_pretrained
from nowait.hub_tokenizer import QWEN2_PRETOKENIZE_REGEX, read_tokenizer

from .hf_checkpoints import CHATML_TEMPLATE, TRAINING_TEXT, dream_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
TEXTS = ["the cat sat on the mat.", "Name the cat.\n\nIt's 42!", "  spaces   and\ttabs\r\n",
         "naïve café: €12,50 — 漢字", "<|im_start|>user\nhello world<|im_end|>\n<|mask|><|mask|>",
         "I'LL say you'd've", "cafe\u0301 (decomposed: NFC composes it)", "x" * 40]


def write_slow_tokenizer_files(directory: Path) -> dict[str, int]:
    """vocab.json + merges.txt of a byte-level BPE trained under Qwen2's split regex, and a
    tokenizer_config.json listing the special tokens after the vocabulary, as Dream's repos do."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=290, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([*TRAINING_TEXT, "It's you'd I'll café"], trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.model.save(str(directory))  # writes vocab.json and merges.txt
    first = tokenizer.get_vocab_size()
    ids = {token: first + i for i, token in enumerate(SPECIALS)}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHATML_TEMPLATE, "errors": "replace",
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "bos_token": None,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in ids.items()},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def test_vocab_and_merges_give_the_slow_qwen2_tokenizers_ids(tmp_path):
    from transformers import Qwen2Tokenizer

    ids = write_slow_tokenizer_files(tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    ours = read_tokenizer(tmp_path)
    reference = Qwen2Tokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == reference.decode(expected)
    for token, token_id in ids.items():
        assert ours.token_to_id(token) == token_id == reference.convert_tokens_to_ids(token)
    # The special tokens are single ids inside text, never split into byte pieces.
    assert ours.encode("<|mask|>", add_special_tokens=False).ids == [ids["<|mask|>"]]


def test_a_dream_directory_without_tokenizer_json_loads(tmp_path):
    directory = tmp_path / "dream"
    dream_checkpoint(directory, seed=3)
    (directory / "tokenizer.json").unlink()
    ids = write_slow_tokenizer_files(directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(mask_token_id=ids["<|mask|>"], eos_token_id=ids["<|endoftext|>"])
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|endoftext|>"]}))
    loaded = load_pretrained(directory)
    assert loaded.model.config.mask_token_id == ids["<|mask|>"]
    assert loaded.conventions.end_ids == (ids["<|endoftext|>"],)
    assert loaded.codec.encode("hello<|im_end|>")[-1] == ids["<|im_end|>"]


def test_added_tokens_at_ids_the_vocabulary_cannot_give_are_refused(tmp_path):
    write_slow_tokenizer_files(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    decoder = config["added_tokens_decoder"]
    last = max(decoder, key=int)
    decoder[str(int(last) + 5)] = decoder.pop(last)  # a gap: the id would silently differ
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"added token '<\|mask\|>' has id"):
        read_tokenizer(tmp_path)


def test_neither_tokenizer_json_nor_vocab_and_merges_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing tokenizer\.json \(or Qwen2's vocab\.json and merges\.txt\)"):
        read_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(CheckpointError, match="Qwen2's tokenizer only"):
        read_tokenizer(tmp_path)
