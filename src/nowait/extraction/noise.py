"""Scanned-form noise for the hard tier, applied so that the ground truth stays recoverable.

- Labels: OCR confusions (`0` for `o`, `1` for `l`, `rn` for `m`, ...) anywhere in a label.
- Values: only a digit inside a run of digits of a date, amount or phone number becomes its
  look-alike letter (`0`->`O`, `1`->`l`, `5`->`S`): with digits on both sides the truth is
  unambiguous. Names, identifiers and references are never touched (a `5` or an `S` in
  "AB5S1234" could be either).
- Lines: stray marks (a stamp, a tick, dots, a scanner's smudge) on lines of their own or
  before a line, and a label broken from its value onto the next line. Marks never touch a value.
"""

from __future__ import annotations

import random

LABEL_SWAPS = (("o", "0"), ("O", "0"), ("l", "1"), ("I", "l"), ("m", "rn"), ("e", "c"), ("i", "1"),
               ("S", "5"), ("B", "8"), ("h", "b"))
DIGIT_LOOKALIKES = {"0": "O", "1": "l", "5": "S"}
STRAY_LINES = ("~ ~ ~", ". . .", "[ ]", "____", "|", "* * *", "[stamp: RECEIVED]", "(scanned copy)", "-- -- --",
               "[illegible]", "x", "//")
STRAY_PREFIXES = ("` ", "' ", "| ", ". ", "~ ", "* ")


def damage_label(label: str, rng: random.Random,
                 swaps: tuple[tuple[str, str], ...] = LABEL_SWAPS) -> str:
    """One OCR confusion in a label (labels carry no truth, so any character may go); the clean
    tier draws from fewer `swaps` than the hard tier's."""
    candidates = [(a, b) for a, b in swaps if a in label]
    if not candidates:
        return label
    a, b = rng.choice(candidates)
    at = rng.choice([i for i in range(len(label)) if label.startswith(a, i)])
    return label[:at] + b + label[at + len(a):]


def damage_digits(text: str, rng: random.Random, count: int = 1) -> str:
    """Replace up to `count` digits that sit between two digits with their look-alike letters."""
    spots = [i for i in range(1, len(text) - 1)
             if text[i] in DIGIT_LOOKALIKES and text[i - 1].isdigit() and text[i + 1].isdigit()]
    for at in rng.sample(spots, k=min(count, len(spots))):
        text = text[:at] + DIGIT_LOOKALIKES[text[at]] + text[at + 1:]
    return text


def restore_digits(text: str) -> str:
    """The inverse of `damage_digits` on a whole text, for checks: a look-alike letter between
    two digit-like characters is read back as its digit."""
    back = {v: k for k, v in DIGIT_LOOKALIKES.items()}
    chars = list(text)
    digit_like = [c.isdigit() or c in back for c in chars]
    for i in range(1, len(chars) - 1):
        if chars[i] in back and digit_like[i - 1] and digit_like[i + 1] and (
                chars[i - 1].isdigit() or chars[i + 1].isdigit()):
            chars[i] = back[chars[i]]
    return "".join(chars)


def stray_marks(lines: list[str], rng: random.Random, rate: float = 0.15) -> list[str]:
    """Scanner debris: a few lines of marks, and marks before some lines (never inside one)."""
    out = []
    for line in lines:
        if rng.random() < rate / 2:
            out.append(rng.choice(STRAY_LINES))
        out.append(rng.choice(STRAY_PREFIXES) + line if line and rng.random() < rate / 2 else line)
    return out


def break_label(label: str, value: str, separator: str, rng: random.Random, rate: float = 0.12) -> str:
    """`label: value`, or with the scan's line broken between label and value (or inside the label)."""
    if rng.random() >= rate:
        return f"{label}{separator}{value}"
    words = label.split(" ")
    if len(words) > 1 and rng.random() < 0.5:
        cut = rng.randint(1, len(words) - 1)
        return f"{' '.join(words[:cut])}\n{' '.join(words[cut:])}{separator}{value}"
    return f"{label}{separator.rstrip()}\n{value}"
