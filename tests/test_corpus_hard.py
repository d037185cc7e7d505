"""The hard and mixed tiers: determinism, the clean tier unchanged, held-out layouts kept out of
training, recoverable truth, the prompt's length, and instructions in many wordings."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import jsonschema
import pytest

from nowait import paths
from nowait.extraction import pools
from nowait.extraction.corpus import (
    HELD_OUT_LAYOUTS,
    KINDS,
    TIERS,
    documents,
    hard_documents_relabelled,
    held_out_texts,
    schema_for,
    training_range,
)
from nowait.extraction.hard import HELD_OUT_SHARE, TRAIN_LAYOUTS
from nowait.extraction.hard_kinds import CURRENCY_FIELD, HARD_FIELDS, HELD_OUT_LABELS, TRAINING_LABELS
from nowait.extraction.hard_values import CURRENCY_WORDS, number_words
from nowait.extraction.instructions import instruction_pool
from nowait.extraction.noise import damage_digits, restore_digits
from nowait.gateway.prompts import chat_prompt
from nowait.tokenizer import TextCodec, document_prompt, extraction_prompt, instruction_for


def digest(docs) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps([d.kind, d.text, d.fields, d.doc_id], ensure_ascii=False).encode())
    return h.hexdigest()


# Computed from `documents()` and `training_range()` before the tiers existed: the bundled
# models, the tests and the committed numbers rest on exactly these documents.
CLEAN_DIGESTS = {
    ("test", None): "abaccef3a4474f41da94b3ccf19b009ae13d3b53c62ede438ea053d810cb2edc",
    ("validation", None): "f0719c0c595d86ed01b11a56bcb494bdff793206aa59b130fd4466f739282140",
    ("train", None): "b720f9bf6f0be425dbab8679bfe72462cf7532df3af8f69bd05d9933cc25fb94",
    (None, 7): "54e8e349756afeb327a34646cc0029fc037df3cd168bc1511fa496f17d45fad6",
}
CLEAN_RANGE_DIGEST = "c88b9471eb5dfa53bfd32d2427068e0973c06dfb46bc73b968032964d669042d"
# Phrases only the held-out layouts write.
HELD_OUT_MARKERS = ("This is to certify that", "At the request of", "(the applicant) requests credit",
                    "Forwarded message", "| Field | Was | Now | Date |")


@pytest.fixture(scope="module")
def hard_docs():
    return (documents("test", 300, tier="hard") + documents("validation", 150, tier="hard")
            + documents(None, 150, seed=3, tier="hard"))


@pytest.fixture(scope="module")
def training_mix():
    return training_range(0, 5000, hard_fraction=0.5, exclude=frozenset())


# --- the clean tier is today's corpus ---


@pytest.mark.parametrize(("split", "seed"), list(CLEAN_DIGESTS))
def test_clean_tier_is_byte_identical_to_the_corpus_before_tiers(split, seed):
    docs = documents(split, 300, seed=seed)
    assert digest(docs) == CLEAN_DIGESTS[(split, seed)]
    assert documents(split, 300, seed=seed, tier="clean") == docs
    assert {(d.tier, d.layout, d.instruction) for d in docs} == {("clean", "lines", "")}


def test_training_without_hard_documents_is_the_clean_stream_exactly():
    docs = training_range(0, 300, variety=lambda i: min(1.0, i / 200), exclude=frozenset(), hard_fraction=0.0)
    assert digest(docs) == CLEAN_RANGE_DIGEST


# --- determinism and the tiers' shape ---


def test_hard_tier_is_deterministic_per_seed_and_differs_across_seeds():
    first = documents("test", 40, tier="hard")
    assert first == documents("test", 40, tier="hard")
    assert [d.doc_id for d in first] == [f"hard-test-{i}" for i in range(40)]
    assert [d.kind for d in first[:6]] == list(KINDS) * 2
    one, two = documents(None, 40, seed=1, tier="hard"), documents(None, 40, seed=2, tier="hard")
    assert one == documents(None, 40, seed=1, tier="hard")
    assert not {d.text for d in one} & {d.text for d in two}
    assert not {d.text for d in first} & {d.text for d in documents("validation", 40, tier="hard")}


# The hard tier's evaluation documents as first measured (README, docs/corpus.md): a change of the
# training stream must leave them as they are.
HARD_DIGESTS = {
    ("test", None): "33aec5211b17b2770933cba599fee9f3f9a28bd0a07e73d0143d1ec17888d834",
    ("validation", None): "13d17f29b8fcfd55fc4449e55ee58692efd4eafedd4547d1124808c718d36216",
    (None, 2318): "163ecad4f1331c32f1495c857fb8d0b398585514caccc48eac964724d5dd8530",
}


@pytest.mark.parametrize(("split", "seed"), list(HARD_DIGESTS))
def test_the_hard_evaluation_documents_are_unchanged(split, seed):
    h = hashlib.sha256()
    for d in documents(split, 400, seed=seed, tier="hard"):
        h.update(json.dumps([d.kind, d.text, d.fields, d.doc_id, d.layout, d.instruction], ensure_ascii=False).encode())
    assert h.hexdigest() == HARD_DIGESTS[(split, seed)]


def test_training_only_labels_reach_training_documents_and_no_held_out_label_is_among_them(training_mix):
    keys = {f.key for fields in HARD_FIELDS.values() for f in fields} | {CURRENCY_FIELD.key}
    assert set(TRAINING_LABELS) == keys
    widened = [label for labels in TRAINING_LABELS.values() for label in labels]
    assert not [label for label in widened if any(h.lower() in label.lower() for h in HELD_OUT_LABELS)]
    training_text = "\n".join(d.text for d in training_mix if d.tier == "hard")
    evaluation_text = "\n".join(d.text for d in documents("test", 300, tier="hard")
                                + documents("validation", 300, tier="hard"))
    distinctive = ("D.O.B.", "Tenor", "Denomination", "Ordering customer", "Salary p.a.", "Last validity date")
    assert all(label in training_text for label in distinctive)
    assert not [label for label in distinctive if label in evaluation_text]


def test_mixed_tier_interleaves_clean_and_hard():
    mixed, clean, hard = (documents("test", 20, tier=t) for t in ("mixed", "clean", "hard"))
    assert mixed[0::2] == clean[:10] and mixed[1::2] == hard[:10]
    assert len({d.doc_id for d in mixed}) == 20
    with pytest.raises(ValueError, match="unknown tier"):
        documents("test", 2, tier="scanned")
    assert TIERS == ("clean", "hard", "mixed")


def test_every_hard_answer_is_schema_valid_and_every_layout_is_drawn(hard_docs):
    for d in hard_docs:
        assert d.tier == "hard" and d.layout in TRAIN_LAYOUTS + HELD_OUT_LAYOUTS
        jsonschema.validate(d.fields, schema_for(d.kind))
        assert d.text == d.text.strip() and d.instruction
    assert {d.layout for d in hard_docs} == set(TRAIN_LAYOUTS + HELD_OUT_LAYOUTS)


def test_held_out_layouts_only_in_the_test_split_and_fresh_seeds():
    test, fresh = documents("test", 300, tier="hard"), documents(None, 300, seed=9, tier="hard")
    for docs in (test, fresh):
        share = sum(d.layout in HELD_OUT_LAYOUTS for d in docs) / len(docs)
        assert abs(share - HELD_OUT_SHARE) < 0.1
    assert not any(d.layout in HELD_OUT_LAYOUTS for d in documents("validation", 300, tier="hard"))


def test_training_never_reads_a_held_out_layout_label_or_evaluation_text(training_mix):
    assert 0.4 < Counter(d.tier for d in training_mix)["hard"] / len(training_mix) < 0.6
    assert not {d.layout for d in training_mix} & set(HELD_OUT_LAYOUTS)
    assert {d.layout for d in training_mix if d.tier == "hard"} == set(TRAIN_LAYOUTS)
    texts = "\n".join(d.text for d in training_mix).lower()
    assert [label for label in HELD_OUT_LABELS if label.lower() in texts] == []
    assert [marker for marker in HELD_OUT_MARKERS if marker.lower() in texts] == []
    assert not {d.text for d in training_mix} & held_out_texts(2000, tiers=("clean", "hard"))


def test_held_out_documents_use_the_held_out_labels():
    held = [d for d in documents("test", 120, tier="hard") if d.layout in HELD_OUT_LAYOUTS]
    assert held
    for d in held:
        if d.layout != "letter_third_person":  # a letter states its fields in sentences
            assert any(label in d.text for label in HELD_OUT_LABELS)
        trained = {label for f in HARD_FIELDS[d.kind] for label in f.labels}  # (another kind's may be a distractor)
        assert not any(f"{label}:" in d.text or f"| {label} |" in d.text for label in trained)


def test_the_hard_fraction_follows_the_curriculum():
    assert all(d.tier == "clean" for d in training_range(0, 200, variety=0.0, exclude=frozenset(), hard_fraction=1))
    assert all(d.tier == "hard" for d in training_range(0, 200, exclude=frozenset(), hard_fraction=1.0))
    with pytest.raises(ValueError, match="hard_fraction"):
        training_range(0, 2, hard_fraction=1.5)


# --- the truth stays recoverable ---


def date_spellings(iso: str) -> set[str]:
    year, month, day = (int(p) for p in iso.split("-"))
    name = pools.MONTHS[month - 1]
    ordinal = f"{day}{'th' if 11 <= day <= 13 else {1: 'st', 2: 'nd', 3: 'rd'}.get(day % 10, 'th')}"
    return {iso, f"{day:02d}.{month:02d}.{year}", f"{day:02d}/{month:02d}/{year}", f"{day} {name} {year}",
            f"{name} {day}, {year}", f"{day:02d}-{name[:3]}-{year}", f"{day} {name[:3].upper()} {year}",
            f"{year}/{month:02d}/{day:02d}", f"{ordinal} {name} {year}", f"{name} {ordinal}, {year}",
            f"{day}/{month}/{year}", f"{day:02d}-{month:02d}-{year}", f"{year}.{month:02d}.{day:02d}",
            f"{day} {name[:3]}. {year}", f"{day:02d} {name.upper()} {year}", f"{year}{month:02d}{day:02d}"}


def recoverable(key: str, value: object, text: str) -> bool:
    """Whether `value` can be read off `text` (look-alike letters in digit runs read back)."""
    bare = re.sub(r"[\s,.'()+-]", "", text)
    if key in ("date_of_birth", "issue_date", "expiry_date", "application_date"):
        return any(s in text for s in date_spellings(str(value)))
    if key == "phone":
        return str(value)[1:] in bare
    if key in ("amount", "loan_amount", "annual_income"):
        whole = int(value)
        return str(whole) in bare or number_words(whole) in text
    if key == "term_months":
        years = int(value) // 12
        return str(value) in text or (int(value) % 12 == 0 and re.search(rf"\b\(?{years}\)? (yrs?|years?)\b", text)
                                      is not None) or (years == 1 and "one (1) year" in text)
    if key == "currency":
        symbol = dict(pools.CURRENCIES)[str(value)]
        return str(value) in text or CURRENCY_WORDS[str(value)] in text or bool(symbol and symbol in text)
    if key == "nationality":
        return any(str(value) == code and (code in text or name in text or name.upper() in text or demonym in text)
                   for code, name, demonym in pools.COUNTRIES)
    if key in ("account_type", "purpose", "employment_status", "incoterm"):
        return True  # enum spellings: the renderer's table maps each to its value
    return str(value) in text


def test_every_hard_truth_value_is_recoverable_from_the_text(hard_docs):
    for d in hard_docs:
        text = restore_digits(d.text)
        missing = [k for k, v in d.fields.items()
                   if v is not None and not (recoverable(k, v, text) or recoverable(k, v, d.text))]
        assert missing == [], (d.doc_id, missing, d.text)


def test_an_amendment_states_the_corrected_value_after_the_form(hard_docs):
    amended = [d for d in hard_docs if d.layout.startswith("amendment")]
    assert amended
    for d in amended:
        text = restore_digits(d.text)
        marker = max(text.rfind(m) for m in ("AMENDMENT", "Correction (", "Amended on", "Change log", "CORRECTIONS"))
        assert marker > 0, d.text
        tail = text[marker:]
        assert any(v is not None and k not in ("account_type", "purpose", "employment_status", "incoterm")
                   and recoverable(k, v, tail) for k, v in d.fields.items()), d.text


def test_digit_damage_touches_only_inner_digits_and_reads_back():
    import random

    rng = random.Random(0)
    for text in ("1985-03-15", "USD 1,250,000.00", "+44 20 7946 0018", "12 March 1951"):
        damaged = damage_digits(text, rng, count=2)
        assert damaged[0] == text[0] and damaged[-1] == text[-1]
        assert restore_digits(damaged) == text


# --- the prompt fits the models ---


def test_hard_prompts_fit_the_context_with_the_answer_window(hard_docs):
    codec = TextCodec.from_file(paths.tokenizer_path())
    context = json.loads((paths.model_dir("ar") / "config.json").read_text())["max_position_embeddings"]
    document_tokens = [len(codec.encode(d.text)) for d in hard_docs]
    prompt_tokens = [len(codec.encode(document_prompt(d))) for d in hard_docs]
    assert max(document_tokens) <= 600
    assert max(prompt_tokens) + 160 <= context  # 160: the answer window (nowait.evaluation.ANSWER_WINDOW)


# --- instructions in many wordings ---


def test_instruction_pool_holds_the_users_wording_terse_verbose_and_with_schema():
    pool = instruction_pool("kyc")
    assert pool[0] == instruction_for("kyc") and "Extract the KYC fields as JSON." in pool
    for kind in KINDS:
        wordings = instruction_pool(kind)
        schema = json.dumps(schema_for(kind))
        assert any(schema in w for w in wordings) and any(schema not in w for w in wordings)
        assert min(map(len, wordings)) < 25 < 200 < max(len(w) for w in wordings if schema not in w)
        assert instruction_pool(kind, with_schema=False) == [w for w in wordings if schema not in w]


def test_hard_documents_and_the_mix_draw_many_wordings(hard_docs, training_mix):
    assert len({d.instruction for d in hard_docs if d.kind == "kyc"}) >= 8
    assert any("$schema" in d.instruction for d in hard_docs)
    clean_asked_otherwise = [d for d in training_mix if d.tier == "clean" and d.instruction]
    assert 0.1 < len(clean_asked_otherwise) / len(training_mix) < 0.2  # h/2 of the clean half


def test_a_chat_request_renders_the_prompt_training_uses(hard_docs):
    for d in hard_docs[:30] + documents("test", 3):
        instruction = d.instruction or instruction_for(d.kind)
        trained = document_prompt(d)
        assert trained == extraction_prompt(d.kind, d.text, d.instruction or None)
        assert chat_prompt([{"role": "system", "content": instruction}, {"role": "user", "content": d.text}]) == trained
        assert chat_prompt([{"role": "user", "content": f"{instruction}\n{d.text}"}]) == trained


def test_training_batches_carry_each_documents_wording():
    from nowait.training import ar_batch

    codec = TextCodec.from_file(paths.tokenizer_path())
    docs = [d for d in documents("test", 12, tier="hard") if d.instruction != instruction_for(d.kind)][:3]
    inputs, _, answer, _ = ar_batch(docs, codec, document_weight=0.5)
    for row, d in enumerate(docs):
        prompt_length = int(answer[row].nonzero()[0]) + 1
        assert codec.decode(inputs[row, :prompt_length].tolist()).startswith(d.instruction)


# --- a training run on the mix ---


def test_a_training_run_on_the_mix_records_its_tier_and_validates_on_it(tmp_path):
    from nowait.training import TrainSettings, train

    settings = TrainSettings(kind="ar", steps=2, batch_size=2, eval_every=2, eval_documents=2, threads=1,
                             clean_steps=0, curriculum_steps=0, hard_fraction=0.5, eval_tier="mixed",
                             model=dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                        num_kv_heads=2))
    train(settings, tmp_path / "run", tmp_path / "out", paths.tokenizer_path())
    saved = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert (saved["hard_fraction"], saved["eval_tier"]) == (0.5, "mixed")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())["nowait"]["training"]
    assert exported["settings"]["hard_fraction"] == 0.5 and exported["validation"]["n"] == 2


def test_train_refuses_a_hard_fraction_outside_zero_to_one(tmp_path):
    from typer.testing import CliRunner

    from nowait.cli import app

    result = CliRunner().invoke(app, ["train", "ar", "--tier", "mixed", "--hard-fraction", "1.5",
                                      "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "--hard-fraction" in result.output
    assert not (tmp_path / "run").exists()


def test_relabelled_documents_keep_the_layouts_and_take_the_other_label_set():
    drawn, swapped = documents("test", 60, tier="hard"), hard_documents_relabelled("test", 60)
    assert [(d.layout, d.doc_id, d.kind) for d in drawn] == [(d.layout, d.doc_id, d.kind) for d in swapped]
    assert swapped == hard_documents_relabelled("test", 60)
    for before, after in zip(drawn, swapped, strict=True):
        if before.layout.startswith("letter"):
            continue  # a letter states its fields in sentences
        trained = {label for f in HARD_FIELDS[before.kind] for label in f.labels}
        held = before.layout in HELD_OUT_LAYOUTS
        source, other = (after, before) if held else (before, after)
        assert any(f"{label}" in source.text for label in trained)
        assert any(label in other.text for label in HELD_OUT_LABELS)
