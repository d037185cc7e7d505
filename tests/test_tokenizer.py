"""The BPE tokenizer, its pre-tokenizer, special tokens and the chat template."""

from __future__ import annotations

import json

import pytest

from nowait.extraction.corpus import documents
from nowait.tokenizer import (
    ASSISTANT,
    END,
    MASK,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
    TextCodec,
    extraction_prompt,
    instruction_for,
    render_chat,
)


def find_subsequence(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start: start + len(needle)] == needle:
            return start
    return -1


def pre_token_boundaries(codec: TextCodec, text: str) -> set[int]:
    spans = [span for _, span in codec.tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    return {start for start, _ in spans} | {end for _, end in spans}


def test_round_trip_documents_and_answers(codec):
    for doc in documents("test", 30):
        for text in (doc.text, doc.answer_json(), extraction_prompt(doc.kind, doc.text)[len(USER):-len(ASSISTANT)]):
            assert codec.decode(codec.encode(text)) == text


@pytest.mark.parametrize("text", [
    "Amount: €1.250.000,00\nFee: £12.50\n",
    '{"amount": 1250000.0, "currency": "EUR", "note": "€ and £"}',
    "Name:  Zoë Ångström-Müller\r\n\tDOB - 12 MAR 1985\n\n",
    "東京 ₹ 🙂 naïve",
])
def test_round_trip_any_utf8(codec, text):
    ids = codec.encode(text)
    assert all(0 <= i < codec.vocab_size for i in ids)
    assert codec.decode(ids) == text


VALUES = ["Ada Okafor", "1985-03-12", "YP92660569", "Emeka Farouk", "ada.okafor@example.com", "442079460958",
          "+442079460958", "Summit Steel Exports S.A."]


@pytest.mark.parametrize("value", VALUES)
def test_value_has_same_ids_in_document_and_json(codec, value):
    ids = codec.encode(value)
    in_document = codec.encode(f"Name: {value}\n")
    in_json = codec.encode(json.dumps({"k": value, "j": 1}))
    assert find_subsequence(in_document, ids) >= 0, [codec.tokenizer.id_to_token(i) for i in in_document]
    assert find_subsequence(in_json, ids) >= 0, [codec.tokenizer.id_to_token(i) for i in in_json]


@pytest.mark.parametrize("value", [
    *VALUES,
    "+442079460958",  # a phone's leading "+" once merged with the separator before it
    "Meridian Trading Inc.",  # a suffix's trailing "." once merged with the newline after it
])
def test_value_boundaries_are_pre_token_boundaries(codec, value):
    """Vocabulary-independent form of the copying property: no BPE merge can cross the value's
    edges in the document line or in the JSON answer, whatever vocabulary is trained."""
    for template in ("Name: {}\n", "Phone : {}\n", "Name - {}\n", '{{"k": "{}", "j": 1}}'):
        text = template.format(value)
        start = text.index(value)
        boundaries = pre_token_boundaries(codec, text)
        assert start in boundaries and start + len(value) in boundaries, (template, value)


def test_digits_are_single_tokens(codec):
    ids = codec.encode("0123456789")
    assert [codec.decode([i]) for i in ids] == list("0123456789")
    line = codec.encode("Loan amount: EUR 1250000\n")
    pieces = [codec.decode([i]) for i in line]
    assert pieces[-8:-1] == list("1250000")
    assert all(len(piece) == 1 for piece in pieces if any(ch.isdigit() for ch in piece))


def test_special_tokens_are_single_ids(codec):
    ids = [codec.tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(SPECIAL_TOKENS)
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert codec.encode(token) == [token_id]
    assert codec.end_id == codec.tokenizer.token_to_id(END)
    assert codec.mask_id == codec.tokenizer.token_to_id(MASK)
    assert codec.end_id != codec.mask_id
    inside = codec.encode(f"ab{MASK}{MASK}cd{END}")
    assert inside.count(codec.mask_id) == 2 and inside[-1] == codec.end_id
    assert codec.decode(inside) == "abcd"  # specials are skipped when decoding


def test_codec_file_round_trip(codec, tmp_path):
    path = tmp_path / "tokenizer.json"
    codec.tokenizer.save(str(path))
    loaded = TextCodec.from_file(path)
    text = documents("test", 1)[0].text
    assert loaded.encode(text) == codec.encode(text)
    assert (loaded.end_id, loaded.mask_id, loaded.vocab_size) == (codec.end_id, codec.mask_id, codec.vocab_size)


def test_render_chat():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n"},
                {"role": "assistant", "content": "{}"}]
    assert render_chat(messages) == f"{SYSTEM}Be brief.{USER}Hi\n{ASSISTANT}{{}}{ASSISTANT}"
    assert render_chat(messages[:2], add_generation_prompt=False) == f"{SYSTEM}Be brief.{USER}Hi\n"


def test_extraction_prompt(codec):
    prompt = extraction_prompt("letter_of_credit", "LC number: DC123")
    assert prompt == "<|user|>Extract the letter of credit below as JSON.\nLC number: DC123\n<|assistant|>"
    assert instruction_for("kyc") == "Extract the KYC onboarding form below as JSON."
    ids = codec.encode(prompt)
    assert ids[0] == codec.tokenizer.token_to_id(USER) and ids[-1] == codec.tokenizer.token_to_id(ASSISTANT)
