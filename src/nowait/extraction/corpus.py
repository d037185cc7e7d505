"""Synthetic business documents with ground-truth JSON: KYC forms, letters of credit, loan files.

Every document is a function of (split, index) alone, so any document can be regenerated
anywhere, splits are reproducible, and a fresh `--seed` sample is a different stream of the
same distribution. `variety` in [0, 1] is the chance of each non-canonical choice (label
synonym, value format, distractor, honorific, noise, shuffled order); variety 0 gives clean
documents whose values are already normalized, which training uses as a copying warm-up.

The kinds (schemas, lines, distractors) are `kinds`, the value renderers `values`; this module
lays a document out and draws the splits. Tiers: `clean` (these documents), `hard` (layouts,
noise and wordings of `nowait.extraction.hard`) and `mixed` (both, interleaved).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import count

from nowait.extraction.hard import HELD_OUT_LAYOUTS as HELD_OUT_LAYOUTS
from nowait.extraction.hard import HELD_OUT_SHARE, render_hard
from nowait.extraction.instructions import KIND_TITLES as KIND_TITLES
from nowait.extraction.instructions import draw_instruction
from nowait.extraction.kinds import KIND_SPECS
from nowait.extraction.noise import damage_label
from nowait.extraction.values import Style

KINDS = ("kyc", "letter_of_credit", "loan_application")
SPLITS = ("train", "validation", "test")
TIERS = ("clean", "hard", "mixed")


@dataclass(frozen=True)
class Document:
    """One synthetic document and the JSON an extractor must produce for it."""

    kind: str
    text: str
    fields: dict[str, object]
    doc_id: str = ""
    tier: str = "clean"
    layout: str = "lines"  # the clean tier's labelled lines; hard: `nowait.extraction.hard` layouts
    instruction: str = ""  # the request's wording; "" is the kind's default (`instruction_for`)

    def answer_json(self) -> str:
        return canonical_json(self.fields)


def canonical_json(fields: dict[str, object]) -> str:
    """The one serialization every model is trained to emit: one line, schema key order."""
    return json.dumps(fields, ensure_ascii=False)


def schema_for(kind: str) -> dict:
    """The JSON Schema of a document kind (every key present; optional ones nullable)."""
    return KIND_SPECS[kind].schema


# --- layout ---

_OCR_SWAPS = (("o", "0"), ("O", "0"), ("l", "1"), ("I", "l"), ("m", "rn"), ("e", "c"))


def _label_text(label: str, style: Style, noise_rate: float) -> str:
    if style.varied() and style.rng.random() < 0.25:
        label = style.rng.choice([label.upper(), label.lower()])
    if style.varied() and style.rng.random() < noise_rate:
        label = damage_label(label, style.rng, _OCR_SWAPS)  # labels only: the truth stays
    return label


def render_document(kind: str, rng: random.Random, variety: float = 1.0, noise_rate: float = 0.1) -> Document:
    """Draw one document of `kind`. noise_rate is the share of varied labels with OCR damage."""
    spec = KIND_SPECS[kind]
    style = Style(rng, variety)
    fields: dict[str, object] = {key: None for key in spec.schema["properties"]}
    lines: list[tuple[str, str]] = []
    for line in spec.lines:
        if line.optional and rng.random() < 0.35:
            continue
        text, values, *extra = line.render(style)
        fields.update(values)
        lines.append((style.pick(list(line.labels)), text))
        lines.extend(extra[0] if extra else [])  # e.g. a currency stated on its own line
    if style.varied():
        for distractor in rng.sample(spec.distractors, k=rng.randint(1, 3)):
            text, *_ = distractor.render(style)
            lines.insert(rng.randint(0, len(lines)), (style.pick(list(distractor.labels)), text))
    if style.varied():
        rng.shuffle(lines)
    separator = style.pick([": ", " : ", " - ", ":  "])
    body = [f"{_label_text(label, style, noise_rate)}{separator}{text}" for label, text in lines]
    header = [style.pick(list(spec.titles))]
    footer = [rng.choice(spec.footers)] if style.varied() and rng.random() < 0.3 else []
    return Document(kind=kind, text="\n".join(header + body + footer), fields=fields)


# --- splits ---


def _document_at(stream: str, index: int, variety: float = 1.0) -> Document:
    rng = random.Random(f"nowait:{stream}:{index}")
    kind = KINDS[index % len(KINDS)]
    document = render_document(kind, rng, variety=variety)
    return Document(kind=document.kind, text=document.text, fields=document.fields, doc_id=f"{stream}-{index}")


def _hard_document_at(stream: str, index: int, swap_labels: bool = False) -> Document:
    """A hard-tier document; held-out layouts and labels only outside `train` and `validation`,
    the training-only label wordings (`hard_kinds.TRAINING_LABELS`) only in `train`."""
    rng = random.Random(f"nowait:hard:{stream}:{index}")
    kind = KINDS[index % len(KINDS)]
    held_out = rng.random() < HELD_OUT_SHARE and stream not in ("train", "validation")
    text, fields, layout = render_hard(kind, rng, held_out, widen_labels=stream == "train", swap_labels=swap_labels)
    return Document(kind=kind, text=text, fields=fields, doc_id=f"hard-{stream}-{index}", tier="hard",
                    layout=layout, instruction=draw_instruction(kind, rng, len(text)))


def _tier_document_at(stream: str, index: int, tier: str) -> Document:
    if tier == "clean":
        return _document_at(stream, index)
    if tier == "hard":
        return _hard_document_at(stream, index)
    # mixed: even indexes the clean stream's documents, odd ones the hard stream's, both in order.
    return (_document_at if index % 2 == 0 else _hard_document_at)(stream, index // 2)


def _stream_name(split: str | None, seed: int | None) -> str:
    if seed is not None:
        return f"fresh{seed}"
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return split


def held_out_texts(n_each: int = 2000, tiers: tuple[str, ...] = ("clean",)) -> frozenset[str]:
    """Texts of the first validation and test documents of `tiers`, which training must never see."""
    return frozenset(
        _tier_document_at(split, i, tier).text for tier in tiers for split in ("validation", "test")
        for i in range(n_each)
    )


def documents(split: str | None = "test", n: int = 100, seed: int | None = None,
              tier: str = "clean") -> list[Document]:
    """The first n documents of a split, or of a fresh sample `seed` (kinds in rotation), of a tier.

    `clean` is today's corpus; `hard` its own stream (doc ids `hard-<stream>-<i>`), whose test
    split and fresh seeds hold `HELD_OUT_SHARE` held-out layouts; `mixed` interleaves them
    (even indexes clean, odd hard). Validation and test are fixed lists; training draws from its
    own stream and skips any text that appears in them (see `training_stream`).
    """
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    stream = _stream_name(split, seed)
    return [_tier_document_at(stream, i, tier) for i in range(n)]


def hard_documents_relabelled(split: str | None = "test", n: int = 100, seed: int | None = None) -> list[Document]:
    """Hard documents in the layouts of `documents(split, n, seed, tier="hard")` with the other
    label set: held-out layouts with the training labels, training layouts with the held-out ones
    (the values drawn after the labels differ). Only for telling whether a model misses an unseen
    layout or an unseen wording (scripts/hard_layouts.py --labels swapped)."""
    stream = _stream_name(split, seed)
    return [_hard_document_at(stream, i, swap_labels=True) for i in range(n)]


def _training_document_at(index: int, variety: float, hard_fraction: float) -> Document:
    """Data index -> document. With a hard fraction h, a hard document with chance h * variety
    (none during a clean warm-up), and a clean one otherwise, which in h/2 of cases is asked
    for in a wording of the pool; h = 0 is the clean stream exactly."""
    if hard_fraction <= 0:
        return _document_at("train", index, variety=variety)
    roll = random.Random(f"nowait:tier:train:{index}")
    if roll.random() < hard_fraction * variety:
        return _hard_document_at("train", index)
    document = _document_at("train", index, variety=variety)
    if roll.random() < hard_fraction / 2:
        document = replace(document, instruction=draw_instruction(document.kind, roll, len(document.text)))
    return document


def training_exclude(hard_fraction: float = 0.0) -> frozenset[str]:
    """The held-out texts a training stream with `hard_fraction` must skip."""
    return held_out_texts(tiers=("clean", "hard") if hard_fraction > 0 else ("clean",))


def training_range(start: int, stop: int, variety: Callable[[int], float] | float = 1.0,
                   exclude: frozenset[str] | None = None, hard_fraction: float = 0.0) -> list[Document]:
    """The training documents with data indices in [start, stop), held-out texts left out.

    A pure function of the range, so parallel batch builders can each take a range."""
    if not 0.0 <= hard_fraction <= 1.0:
        raise ValueError(f"hard_fraction must be in [0, 1], got {hard_fraction}")
    exclude = training_exclude(hard_fraction) if exclude is None else exclude
    found = (_training_document_at(index, variety(index) if callable(variety) else variety, hard_fraction)
             for index in range(start, stop))
    return [document for document in found if document.text not in exclude]


def training_stream(start: int = 0, variety: Callable[[int], float] | float = 1.0,
                    exclude: frozenset[str] | None = None, hard_fraction: float = 0.0) -> Iterator[Document]:
    """Endless training documents from index `start` on; `variety(i)` allows a curriculum."""
    exclude = training_exclude(hard_fraction) if exclude is None else exclude
    for chunk in count(start, 64):
        yield from training_range(chunk, chunk + 64, variety, exclude, hard_fraction)
