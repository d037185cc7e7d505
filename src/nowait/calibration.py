"""The confidence threshold below which a diffusion answer falls back to AR, chosen on held-out data.

The router re-runs a fast-engine answer on AR when its confidence (the minimum token
probability, engines/base.py) is below a threshold. A fixed number cannot be right for every
model: a partly trained model is unsure of tokens it gets right, a well trained one is sure of
tokens it gets wrong. So the threshold is measured: decode validation documents with the engine
as it serves, score each answer, and take the lowest threshold at which the answers that pass
are as accurate as the target (by default the AR model's own accuracy on the same documents).
That serves as many requests as possible on the fast engine without lowering the quality the
caller gets. `nowait calibrate` writes the result beside the model (calibration.json); the
gateway uses it when its config sets no threshold.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nowait.extraction.scorer import score_document

CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class ScoredAnswer:
    """One held-out document as the fast engine answered it."""

    confidence: float
    fields_correct: int
    fields_total: int
    fallback_fields_correct: int | None = None  # the AR answer to the same document, when measured


@dataclass(frozen=True)
class ThresholdChoice:
    threshold: float
    target_field_accuracy: float
    reached: bool  # False: no threshold lets any answer through at the target accuracy
    acceptance_rate: float  # share of answers at or above the threshold (kept on the fast engine)
    accepted_field_accuracy: float | None
    fast_field_accuracy: float  # every answer kept, no fallback
    routed_field_accuracy: float | None  # accepted fast answers plus AR for the rest (if measured)


def _accuracy(correct: int, total: int) -> float:
    return correct / total if total else 1.0


def acceptance_curve(answers: Sequence[ScoredAnswer]) -> list[tuple[float, float, float]]:
    """(threshold, acceptance rate, accepted field accuracy) for each distinct confidence, highest
    first: at a threshold every answer with confidence >= it is kept."""
    ordered = sorted(answers, key=lambda a: a.confidence, reverse=True)
    curve: list[tuple[float, float, float]] = []
    correct = total = 0
    for i, answer in enumerate(ordered):
        correct += answer.fields_correct
        total += answer.fields_total
        if i + 1 == len(ordered) or ordered[i + 1].confidence < answer.confidence:
            curve.append((answer.confidence, (i + 1) / len(ordered), _accuracy(correct, total)))
    return curve


def choose_threshold(answers: Sequence[ScoredAnswer], target_field_accuracy: float,
                     curve: list[tuple[float, float, float]] | None = None) -> ThresholdChoice:
    """The lowest threshold whose kept answers reach the target field accuracy (as many requests
    as possible stay on the fast engine); above every confidence when none does. `curve`: the
    answers' `acceptance_curve`, if the caller already has it."""
    if not answers:
        raise ValueError("calibration needs at least one scored answer")
    curve = curve or acceptance_curve(answers)
    passing = [point for point in curve if point[2] >= target_field_accuracy]
    if passing:
        threshold, acceptance, accepted_accuracy = min(passing, key=lambda point: point[0])
    else:
        # Nothing passes: a threshold above the surest answer keeps none, even one at 1.0.
        # 1e-5 above: still above it once floored to the six places the file keeps.
        threshold, acceptance, accepted_accuracy = curve[0][0] + 1e-5, 0.0, None
    routed = None
    if all(a.fallback_fields_correct is not None for a in answers):
        routed_correct = sum(a.fields_correct if a.confidence >= threshold else a.fallback_fields_correct
                             for a in answers)
        routed = _accuracy(routed_correct, sum(a.fields_total for a in answers))
    return ThresholdChoice(
        # Floored, not rounded: rounding up could move the cut past an answer the curve accepted.
        threshold=math.floor(threshold * 1e6) / 1e6, target_field_accuracy=target_field_accuracy,
        reached=bool(passing),
        acceptance_rate=acceptance, accepted_field_accuracy=accepted_accuracy,
        fast_field_accuracy=_accuracy(sum(a.fields_correct for a in answers), sum(a.fields_total for a in answers)),
        routed_field_accuracy=routed)


def score_answers(texts: Sequence[str], confidences: Sequence[float], docs: Sequence,
                  fallback_texts: Sequence[str] | None = None) -> list[ScoredAnswer]:
    """Score each fast answer (and the AR answer to the same document, if given)."""
    answers = []
    for i, (text, confidence, doc) in enumerate(zip(texts, confidences, docs, strict=True)):
        score = score_document(text, doc.fields, doc.kind)
        fallback = (score_document(fallback_texts[i], doc.fields, doc.kind).fields_correct
                    if fallback_texts is not None else None)
        answers.append(ScoredAnswer(confidence, score.fields_correct, score.fields_total, fallback))
    return answers


def calibrate(diffusion_model, ar_model, codec, n: int = 200, split: str = "validation", structured: bool = True,
              target_field_accuracy: float | None = None, batch_size: int = 8,
              on_batch: Callable[[int], None] | None = None) -> dict:
    """Decode n held-out documents with the diffusion engine's defaults (and greedy AR, the
    fallback) and choose the threshold. The target defaults to AR's field accuracy on them."""
    from nowait.evaluation import decode_documents, decode_records
    from nowait.extraction.corpus import documents

    docs = documents(split, n)
    diffusion_model.eval()
    records = decode_records(diffusion_model, codec, "diffusion", docs, batch_size, structured=structured,
                             on_batch=on_batch)
    fallback_texts = None
    if ar_model is not None:
        ar_model.eval()
        fallback_texts = decode_documents(ar_model, codec, docs)
    answers = score_answers([r.text for r in records], [r.confidence for r in records], docs, fallback_texts)
    ar_accuracy = None
    if fallback_texts is not None:
        ar_accuracy = _accuracy(sum(a.fallback_fields_correct for a in answers), sum(a.fields_total for a in answers))
    if target_field_accuracy is None:
        if ar_accuracy is None:
            raise ValueError("give a target field accuracy, or an AR model to take it from")
        target_field_accuracy = ar_accuracy
    curve = acceptance_curve(answers)
    choice = choose_threshold(answers, target_field_accuracy, curve)
    return {"confidence_threshold": choice.threshold, **{k: v for k, v in asdict(choice).items() if k != "threshold"},
            "ar_field_accuracy": ar_accuracy, "n": n, "split": split, "structured": structured,
            "confidence_kind": "min_token_probability",
            "curve": [{"threshold": round(t, 6), "acceptance_rate": round(a, 4), "accepted_field_accuracy": round(f, 4)}
                      for t, a, f in _thin(curve)]}


def _thin(curve: list[tuple[float, float, float]], points: int = 20) -> list[tuple[float, float, float]]:
    """At most `points` evenly spaced entries of the curve (for the file and the table)."""
    if len(curve) <= points:
        return curve
    step = (len(curve) - 1) / (points - 1)
    return [curve[round(i * step)] for i in range(points)]


def write_calibration(model_dir: Path, result: dict) -> Path:
    path = Path(model_dir) / CALIBRATION_FILE
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def calibrated_threshold(model_dir: Path) -> float | None:
    """The threshold `nowait calibrate` wrote beside a model, or None if it was never calibrated."""
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())["confidence_threshold"]
    except (ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, int | float) and 0 <= value <= 1 else None
