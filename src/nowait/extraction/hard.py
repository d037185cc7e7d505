"""The hard tier: documents laid out as tables, two columns, letters, packets and amendments,
with scanned-form noise, label wordings the clean tier never uses, and values to normalise.

Each layout family has a training layout and a held-out one (`LAYOUT_FAMILIES`). A held-out
document pairs a held-out layout with the held-out label set (`hard_kinds.HELD_OUT_LABELS`);
only the test split and fresh seeds draw them (`HELD_OUT_SHARE` of their documents), so a
score on them is a score on layouts and labels no training document used.
"""

from __future__ import annotations

import random

from nowait.extraction.hard_draft import Draft, draft
from nowait.extraction.hard_letters import letter_lines
from nowait.extraction.hard_values import hard_date, hard_person
from nowait.extraction.kinds import KIND_SPECS
from nowait.extraction.noise import break_label, stray_marks

LAYOUT_FAMILIES = {"table": "table_transposed", "two_column": "two_column_stacked",
                   "letter": "letter_third_person", "packet": "packet_email", "amendment": "amendment_table"}
TRAIN_LAYOUTS = tuple(LAYOUT_FAMILIES)
HELD_OUT_LAYOUTS = tuple(LAYOUT_FAMILIES.values())
# Layouts where a value's line may sit under its label's: no stray marks there (a line of marks would part
# the two, and a mark before a value line would read as part of the value).
POSITIONAL_LAYOUTS = ("table", "two_column", "table_transposed", "two_column_stacked")
HELD_OUT_SHARE = 0.4  # of the test split's and fresh seeds' hard documents
MAX_GAP = 8  # spaces between columns at most (each space is about one token of the prompt)


def _pad(cell: str, width: int) -> str:
    """A column gap: aligned where that takes few spaces; each space is a token of the prompt."""
    return cell + " " * min(max(3, width - len(cell)), MAX_GAP)


def _table(items: list[tuple[str, str]], rng: random.Random) -> list[str]:
    roll = rng.random()
    if roll < 0.4:
        return ["| Field | Details |", "|---|---|"] + [f"| {label} | {value} |" for label, value in items]
    if roll < 0.75:
        width = max(len(label) for label, _ in items) + 3
        return [_pad(label, width) + value for label, value in items]
    return _header_rows(items, rng)


def _header_rows(items: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """A spreadsheet export: a row of labels over a row of values, 4 to a row, `;` or tab between.
    (The held-out `table_transposed` draws such rows with pipes, 3 to a row, and other labels.)"""
    separator = rng.choice(["; ", "\t"])
    lines = []
    for at in range(0, len(items), 4):
        chunk = items[at: at + 4]
        lines += [separator.join(label for label, _ in chunk), separator.join(value for _, value in chunk)]
    return lines


def _table_transposed(items: list[tuple[str, str]], rng: random.Random) -> list[str]:
    lines = []
    for at in range(0, len(items), 3):
        chunk = items[at: at + 3]
        lines += ["| " + " | ".join(label for label, _ in chunk) + " |",
                  "| " + " | ".join(value for _, value in chunk) + " |", ""]
    return lines[:-1]


def _two_column(items: list[tuple[str, str]], rng: random.Random) -> list[str]:
    if rng.random() < 0.25:  # the form read down one column: each label on a line above its value
        return [line for label, value in items for line in (label, value)]
    cells = [f"{label}: {value}" for label, value in items]
    left, right = cells[: (len(cells) + 1) // 2], cells[(len(cells) + 1) // 2:]
    width = max(len(c) for c in left) + 4
    return [(_pad(a, width) + b).rstrip() for a, b in zip(left, [*right, ""], strict=False)]


def _two_column_stacked(items: list[tuple[str, str]], rng: random.Random) -> list[str]:
    lines = []
    for at in range(0, len(items), 2):
        pair = items[at: at + 2]
        width = max(len(x) for item in pair for x in item) + 4
        lines.append("".join(_pad(label, width) for label, _ in pair).rstrip())
        lines.append("".join(_pad(value, width) for _, value in pair).rstrip())
    return lines


def _colon_lines(items: list[tuple[str, str]], rng: random.Random) -> list[str]:
    separator = rng.choice([": ", " : ", ":  ", " - "])
    return [break_label(label, value, separator, rng) for label, value in items]


COVERS = ("Dear Sir or Madam,\nPlease find enclosed the {title} for processing. Kindly contact {sender} with any "
          "questions.\nYours faithfully,\n{sender}",
          "To the Operations Department,\nAttached is the completed {title}; the supporting papers follow it.\n"
          "Regards,\n{sender}")
DISCLAIMERS = ("Disclaimer: the bank accepts no liability for errors in information supplied by the customer. "
               "This document is confidential.",
               "Important: this pack is for the addressee only. Figures in the cover letter are indicative; the "
               "form governs.")


def _packet(d: Draft, rng: random.Random, body: list[str], title: str) -> list[str]:
    sender, _ = hard_person(rng)
    cover = rng.choice(COVERS).format(title=title.lower(), sender=sender).split("\n")
    return (["SECTION 1 - COVER LETTER", *cover, "", f"SECTION 2 - {title.upper()}", *body, "",
             "SECTION 3 - TERMS", rng.choice(DISCLAIMERS)])


def _packet_email(d: Draft, rng: random.Random, body: list[str], title: str) -> list[str]:
    sender, _ = hard_person(rng)
    return ([f"From: {sender.lower().replace(' ', '.')}@example.com", "To: onboarding@example.org",
             f"Subject: Fwd: {title}", "", "Hi team, forwarding the form below as received. Thanks.", "",
             "---------- Forwarded message ----------", *body, "",
             "This e-mail and any attachment are confidential; if you received it in error, delete it."])


def _later(rng: random.Random) -> str:
    return hard_date(rng, 2026, 2026)[0]


def _amendment(d: Draft, rng: random.Random, body: list[str]) -> list[str]:
    key, label, text = d.amended or ("", "", "")
    form_date = hard_date(rng, 2024, 2025)[0]
    note = rng.choice(["AMENDMENT No. 1 dated {date}: {label} amended to read: {value}",
                       "Correction ({date}): the {label} stated above is wrong; the correct {label} is {value}",
                       "Amended on {date} - {label}: {value} (supersedes the value above)",
                       "Change log {date}: {label}: {old} -> {value}"])
    return [f"Form date: {form_date}", *body, "",
            note.format(date=_later(rng), label=label.lower(), value=text, old=d.written[key])]


def _amendment_table(d: Draft, rng: random.Random, body: list[str]) -> list[str]:
    key, label, text = d.amended or ("", "", "")
    return [*body, "", "CORRECTIONS", "| Field | Was | Now | Date |", "|---|---|---|---|",
            f"| {label} | {d.written[key]} | {text} | {_later(rng)} |"]


def layout_lines(d: Draft, layout: str, rng: random.Random) -> list[str]:
    """The document's lines in `layout` (before stray marks)."""
    title = rng.choice(KIND_SPECS[d.kind].titles)
    items = d.form_items()
    rng.shuffle(items)
    if layout in ("letter", "letter_third_person"):
        return letter_lines(d, layout == "letter_third_person", rng)
    if layout == "table":
        return [title, *_table(items, rng)]
    if layout == "table_transposed":
        return [title, *_table_transposed(items, rng)]
    if layout == "two_column":
        return [title, *_two_column(items, rng)]
    if layout == "two_column_stacked":
        return [title, *_two_column_stacked(items, rng)]
    body = [*(_table if rng.random() < 0.3 else _colon_lines)(items, rng)]
    if layout == "packet":
        return _packet(d, rng, body, title)
    if layout == "packet_email":
        return _packet_email(d, rng, [title, *body], title)
    if layout == "amendment":
        return [title, *_amendment(d, rng, body)]
    if layout == "amendment_table":
        return [title, *_amendment_table(d, rng, body)]
    raise ValueError(f"unknown layout {layout!r}")


def render_hard(kind: str, rng: random.Random, held_out: bool, widen_labels: bool = False,
                swap_labels: bool = False) -> tuple[str, dict[str, object], str]:
    """(text, truth, layout) of one hard document; `held_out` picks a held-out layout and labels,
    `widen_labels` (training documents) the training-only wordings beside the usual ones;
    `swap_labels` the other label set for the same layout (a diagnostic: layout or labels?)."""
    family = rng.choice(TRAIN_LAYOUTS)
    layout = LAYOUT_FAMILIES[family] if held_out else family
    d = draft(kind, rng, held_out, amend=family == "amendment", widen_labels=widen_labels, swap_labels=swap_labels)
    lines = layout_lines(d, layout, rng)
    lines = lines if layout in POSITIONAL_LAYOUTS else stray_marks(lines, rng)
    return "\n".join(lines).strip(), d.fields, layout
