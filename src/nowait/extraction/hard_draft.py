"""A hard document's content before its layout: the truth, how each value and label is
written (with scan noise), the distractors, and an amendment's correction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from nowait.extraction import pools
from nowait.extraction.hard_kinds import (
    AMENDABLE,
    CURRENCY_FIELD,
    CURRENCY_OF,
    HARD_DISTRACTORS,
    HARD_FIELDS,
    TRAINING_LABELS,
    HardField,
)
from nowait.extraction.hard_values import hard_amount
from nowait.extraction.kinds import KIND_SPECS
from nowait.extraction.noise import damage_digits, damage_label

LABEL_NOISE = 0.15  # share of labels with an OCR confusion
DIGIT_NOISE = 0.25  # share of dates, amounts and phones with a look-alike letter inside


@dataclass
class Draft:
    """A hard document's content before layout: truth, values as written, labels, distractors."""

    kind: str
    held_out: bool
    fields: dict[str, object]
    written: dict[str, str] = field(default_factory=dict)  # key -> value as a form writes it
    prose: dict[str, str] = field(default_factory=dict)  # key -> value as a letter writes it
    labels: dict[str, str] = field(default_factory=dict)
    separate_currency: bool = False
    distractors: list[tuple[str, str]] = field(default_factory=list)
    amended: tuple[str, str, str] | None = None  # (key, label, corrected value as written)

    def form_items(self) -> list[tuple[str, str]]:
        """(label, value) of every stated field, the currency line and the distractors, in order."""
        items = [(self.labels[key], text) for key, text in self.written.items()]
        if self.separate_currency:
            items.append((self.labels["currency"], str(self.fields["currency"])))
        return items + self.distractors


def _value(spec: HardField, rng: random.Random, currency: tuple[str, str | None], with_code: bool) -> tuple:
    if spec.render is not None:
        return spec.render(rng)
    return hard_amount(rng, *spec.low_high, currency, with_code=with_code)


def _noisy(text: str, spec: HardField, rng: random.Random) -> str:
    return damage_digits(text, rng) if spec.digits and rng.random() < DIGIT_NOISE else text


def _label_pool(spec: HardField, held_out: bool, widen: bool) -> tuple[str, ...]:
    if held_out:
        return spec.held_out
    return spec.labels + TRAINING_LABELS.get(spec.key, ()) if widen else spec.labels


def draft(kind: str, rng: random.Random, held_out: bool, amend: bool = False, widen_labels: bool = False,
          swap_labels: bool = False) -> Draft:
    """Draw the truth and how each value and label is written (no layout yet); `widen_labels`
    (the training stream) also draws from `TRAINING_LABELS`; `swap_labels` writes each label from
    the other set (held-out for training, training for held-out)."""
    specs = HARD_FIELDS[kind]
    d = Draft(kind, held_out, {key: None for key in KIND_SPECS[kind].schema["properties"]})
    currency = rng.choice(pools.CURRENCIES)
    d.separate_currency = rng.random() < 0.35 and "currency" in d.fields
    for spec in specs:
        if spec.optional and rng.random() < 0.35:
            continue
        own_currency = currency if CURRENCY_OF.get(spec.key) else rng.choice(pools.CURRENCIES)
        separate = d.separate_currency and CURRENCY_OF.get(spec.key) is not None
        text, value = _value(spec, rng, own_currency, with_code=not separate)
        d.fields[spec.key] = value
        if CURRENCY_OF.get(spec.key):
            d.fields["currency"] = currency[0]
        d.written[spec.key] = _noisy(text, spec, rng)
        prose_text = f"{currency[0]} {text}" if separate else text  # a letter names the currency in place
        if spec.prose:
            prose_text = rng.choice(spec.prose[value])
        d.prose[spec.key] = _noisy(prose_text, spec, rng)
    for spec in (*specs, CURRENCY_FIELD):
        label = rng.choice(_label_pool(spec, held_out, widen_labels))
        if swap_labels:
            label = rng.choice(_label_pool(spec, not held_out, False))
        d.labels[spec.key] = damage_label(label, rng) if rng.random() < LABEL_NOISE else label
    for label, render in rng.sample(HARD_DISTRACTORS[kind], k=rng.randint(1, 2)):
        d.distractors.append((label, render(rng)[0]))
    if amend:
        _amend(d, rng, currency)
    return d


def _amend(d: Draft, rng: random.Random, currency: tuple[str, str | None]) -> None:
    """A later-dated correction of one stated field: the form keeps the old value, the truth is the new."""
    keys = [k for k in AMENDABLE[d.kind] if k in d.written]
    key = rng.choice(keys)
    spec = next(s for s in HARD_FIELDS[d.kind] if s.key == key)
    for _ in range(20):
        text, value = _value(spec, rng, currency, with_code=True)
        if value != d.fields[key]:
            break
    d.fields[key] = value
    d.amended = (key, d.labels[key], text)
