"""Hugging Face tools read the bundled tokenizers as nowait does: `AutoTokenizer` gives the same ids.

transformers picks a tokenizer class from tokenizer_config.json, else from config.json's
`model_type` (llama -> LlamaTokenizerFast, which adds `<s>`/`<unk>` and prepends a BOS); these
tests load each bundled model directory, and a fresh `save_pretrained` one, the way any such
tool would, and compare ids, decoded text, vocabulary and chat prompt with nowait's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nowait.checkpoints import save_pretrained, tokenizer_config
from nowait.extraction.corpus import documents
from nowait.paths import DEMO_MODELS, model_dir
from nowait.tokenizer import TextCodec, extraction_prompt, render_chat
from tests.conftest import build_model

transformers = pytest.importorskip("transformers")


def corpus_texts() -> list[str]:
    texts = []
    for doc in documents("test", 12):
        texts += [doc.text, doc.answer_json(), extraction_prompt(doc.kind, doc.text)]
    return texts


def assert_same_tokenizer(directory: Path) -> None:
    codec = TextCodec.from_file(directory / "tokenizer.json")
    hub = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert len(hub) == codec.vocab_size  # no token beyond the embedding's rows
    for text in corpus_texts():
        ids = codec.encode(text)
        assert hub.encode(text) == ids  # default add_special_tokens=True: no BOS, no EOS added
        assert hub(text)["input_ids"] == ids
        assert hub.decode(ids, skip_special_tokens=True) == codec.decode(ids)
    messages = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Okafor, 1985"}]
    assert hub.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == render_chat(messages)
    assert hub.eos_token_id == codec.end_id and hub.pad_token_id == codec.end_id
    assert hub.mask_token_id == codec.mask_id and hub.bos_token_id is None


@pytest.mark.parametrize("name", DEMO_MODELS)
def test_bundled_tokenizer_loads_with_nowaits_ids(name: str) -> None:
    directory = model_dir(name)
    stated = json.loads((directory / "tokenizer_config.json").read_text())
    # Named, not inferred: without these, transformers 4.x builds LlamaTokenizerFast from model_type.
    assert stated["tokenizer_class"] == "PreTrainedTokenizerFast" and stated["add_bos_token"] is False
    assert stated == tokenizer_config()  # the bundled files and save_pretrained say the same
    assert_same_tokenizer(directory)


def test_save_pretrained_writes_a_tokenizer_autotokenizer_reads(tmp_path: Path, codec: TextCodec) -> None:
    directory = save_pretrained(build_model(0, vocab_size=codec.vocab_size), codec, tmp_path / "ar")
    assert json.loads((directory / "tokenizer_config.json").read_text()) == tokenizer_config()
    assert_same_tokenizer(directory)
