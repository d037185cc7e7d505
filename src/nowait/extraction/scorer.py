"""Scoring extracted JSON against ground truth: field match, whole-document match, validity.

A field is correct when the predicted value equals the truth with the same JSON type (a number
given as a string is wrong; 5000 and 5000.0 are the same number). A prediction that is not a
JSON object scores every field wrong. Every key of the kind's schema is scored, absent optional
fields included (the model must say null for them); `present_field_accuracy` scores only the
fields the document actually holds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import jsonschema

from nowait.extraction.corpus import schema_for


def parse_json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def values_equal(predicted: object, truth: object) -> bool:
    if isinstance(truth, bool) or isinstance(predicted, bool):
        return predicted is truth
    if isinstance(truth, int | float) and isinstance(predicted, int | float):
        return float(predicted) == float(truth)
    return type(predicted) is type(truth) and predicted == truth


def schema_valid(value: dict, kind: str) -> bool:
    try:
        jsonschema.validate(value, schema_for(kind))
    except jsonschema.ValidationError:
        return False
    return True


@dataclass(frozen=True)
class DocumentScore:
    kind: str
    parsed: bool
    valid: bool
    fields_correct: int
    fields_total: int
    present_correct: int
    present_total: int

    @property
    def exact(self) -> bool:
        return self.parsed and self.fields_correct == self.fields_total


def score_document(predicted_text: str, truth: dict[str, object], kind: str) -> DocumentScore:
    predicted = parse_json_object(predicted_text)
    correct = present_correct = 0
    present_total = sum(value is not None for value in truth.values())
    if predicted is not None:
        for key, value in truth.items():
            hit = key in predicted and values_equal(predicted[key], value)
            correct += hit
            present_correct += hit and value is not None
    return DocumentScore(
        kind=kind,
        parsed=predicted is not None,
        valid=predicted is not None and schema_valid(predicted, kind),
        fields_correct=correct,
        fields_total=len(truth),
        present_correct=present_correct,
        present_total=present_total,
    )


def _summary(scores: list[DocumentScore]) -> dict[str, float | int]:
    n = len(scores)
    fields_total = sum(s.fields_total for s in scores) or 1
    present_total = sum(s.present_total for s in scores) or 1
    return {
        "n": n,
        "field_accuracy": sum(s.fields_correct for s in scores) / fields_total,
        "present_field_accuracy": sum(s.present_correct for s in scores) / present_total,
        "doc_accuracy": sum(s.exact for s in scores) / max(n, 1),
        "json_parse_rate": sum(s.parsed for s in scores) / max(n, 1),
        "json_valid_rate": sum(s.valid for s in scores) / max(n, 1),
    }


def summarize(scores: Iterable[DocumentScore]) -> dict:
    """Overall metrics plus the same metrics per document kind under `per_kind`."""
    scores = list(scores)
    by_kind: dict[str, list[DocumentScore]] = defaultdict(list)
    for score in scores:
        by_kind[score.kind].append(score)
    return {**_summary(scores), "per_kind": {kind: _summary(group) for kind, group in sorted(by_kind.items())}}
