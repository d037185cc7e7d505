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

Kinds differ (a letter of credit's fields are harder than a KYC form's), so the file also holds
a threshold per document kind and per JSON Schema (by `router.schema_hash`), chosen the same way
on that kind's answers; the router takes the request's own (schema, then kind, then global). And
how well the confidence tells wrong answers from right ones, per engine: the AUROC of the
confidence against "has a wrong field" (`auroc`), and how well the gateway's confidence floor
would flag them (`low_confidence`: recall against false flags, flag_rates). A file written
before these keys still loads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nowait.extraction.scorer import score_document
from nowait.flag_rates import GOAL, floor_report, sweep_floors
from nowait.router import DEFAULT_CONFIDENCE_FLOOR, KindThreshold, schema_hash

CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class ScoredAnswer:
    """One held-out document as the fast engine answered it."""

    confidence: float
    fields_correct: int
    fields_total: int
    fallback_fields_correct: int | None = None  # the AR answer to the same document, when measured
    kind: str = ""
    fallback_confidence: float | None = None  # the AR answer's confidence, when measured

    @property
    def wrong(self) -> bool:
        return self.fields_correct < self.fields_total


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


def auroc(confidences: Sequence[float], wrong: Sequence[bool]) -> float | None:
    """How well a low confidence finds the answers with a wrong field: the probability that a
    wrong answer's confidence is below a right one's (ties count half). 1.0: every wrong answer
    is less sure than every right one; 0.5: no better than chance. None without both kinds."""
    bad = [c for c, w in zip(confidences, wrong, strict=True) if w]
    good = [c for c, w in zip(confidences, wrong, strict=True) if not w]
    if not bad or not good:
        return None
    pairs = sum(1.0 if b < g else 0.5 if b == g else 0.0 for b in bad for g in good)
    return pairs / (len(bad) * len(good))


def score_answers(texts: Sequence[str], confidences: Sequence[float], docs: Sequence,
                  fallback_texts: Sequence[str] | None = None,
                  fallback_confidences: Sequence[float] | None = None) -> list[ScoredAnswer]:
    """Score each fast answer (and the AR answer to the same document, if given)."""
    answers = []
    for i, (text, confidence, doc) in enumerate(zip(texts, confidences, docs, strict=True)):
        score = score_document(text, doc.fields, doc.kind)
        fallback = (score_document(fallback_texts[i], doc.fields, doc.kind).fields_correct
                    if fallback_texts is not None else None)
        answers.append(ScoredAnswer(confidence, score.fields_correct, score.fields_total, fallback, doc.kind,
                                    fallback_confidences[i] if fallback_confidences is not None else None))
    return answers


def per_kind_thresholds(answers: Sequence[ScoredAnswer], target_field_accuracy: float | None) -> dict[str, dict]:
    """Each kind's threshold, chosen on that kind's answers alone (the target: the given one,
    else AR's accuracy on that kind), with the kind's schema hash and fields for the router."""
    from nowait.extraction.corpus import schema_for

    kinds: dict[str, dict] = {}
    for kind in sorted({a.kind for a in answers if a.kind}):
        mine = [a for a in answers if a.kind == kind]
        target = target_field_accuracy
        if target is None:
            target = _accuracy(sum(a.fallback_fields_correct or 0 for a in mine), sum(a.fields_total for a in mine))
        choice = choose_threshold(mine, target)
        schema = schema_for(kind)
        kinds[kind] = {"confidence_threshold": choice.threshold, "reached": choice.reached, "n": len(mine),
                       "target_field_accuracy": target, "acceptance_rate": choice.acceptance_rate,
                       "schema_hash": schema_hash(schema), "fields": sorted(schema["properties"])}
    return kinds


def discrimination(answers: Sequence[ScoredAnswer]) -> dict[str, float | None]:
    """The AUROC of each engine's confidence against "has a wrong field" (AR's when measured)."""
    out = {"diffusion": auroc([a.confidence for a in answers], [a.wrong for a in answers])}
    if all(a.fallback_confidence is not None and a.fallback_fields_correct is not None for a in answers):
        out["ar"] = auroc([a.fallback_confidence for a in answers],  # type: ignore[misc]
                          [a.fallback_fields_correct < a.fields_total for a in answers])  # type: ignore[operator]
    return out


def low_confidence_figures(answers: Sequence[ScoredAnswer], floor: float = DEFAULT_CONFIDENCE_FLOOR) -> dict:
    """Recall (answers with a wrong field below the floor) against false flags (fully correct
    ones below it) of each engine's confidence over every document, at the gateway's default
    floor and over the sweep (AR's when measured). `eval --engine routed` adds the answers as
    the gateway returns them."""
    sweep = sweep_floors([floor])
    engines = {"diffusion": floor_report([a.confidence for a in answers], [a.wrong for a in answers], floor, sweep)}
    if all(a.fallback_confidence is not None and a.fallback_fields_correct is not None for a in answers):
        engines["ar"] = floor_report([a.fallback_confidence for a in answers],
                                     [a.fallback_fields_correct < a.fields_total for a in answers],  # type: ignore[operator]
                                     floor, sweep)
    return {"goal": GOAL, "floors": sweep, "engines": engines}


def per_tier_figures(answers: Sequence[ScoredAnswer], tiers: Sequence[str], threshold: float) -> dict[str, dict]:
    """For documents of several tiers: each tier's diffusion and AR accuracy and the share its
    answers keep on diffusion at the chosen (global) threshold. The router does not know a
    request's tier, so the threshold stays one; this shows where it keeps and where it sends."""
    out: dict[str, dict] = {}
    for tier in sorted(set(tiers)):
        mine = [a for a, t in zip(answers, tiers, strict=True) if t == tier]
        total = sum(a.fields_total for a in mine)
        ar = (None if any(a.fallback_fields_correct is None for a in mine)
              else _accuracy(sum(a.fallback_fields_correct for a in mine), total))  # type: ignore[misc]
        out[tier] = {"n": len(mine), "fast_field_accuracy": _accuracy(sum(a.fields_correct for a in mine), total),
                     "ar_field_accuracy": ar,
                     "acceptance_rate": sum(a.confidence >= threshold for a in mine) / len(mine),
                     "low_confidence": low_confidence_figures(mine)}
    return out


def calibrate(diffusion_model, ar_model, codec, n: int = 200, split: str = "validation", structured: bool = True,
              target_field_accuracy: float | None = None, batch_size: int = 8,
              on_batch: Callable[[int], None] | None = None, tier: str = "clean", seed: int | None = None) -> dict:
    """Decode n held-out documents of a corpus tier (a split's, or with `seed` a fresh sample's,
    as `nowait eval` takes them) with the diffusion engine's defaults (and greedy AR, the
    fallback) and choose the threshold. The target defaults to AR's field accuracy on them."""
    from nowait.evaluation import decode_records
    from nowait.extraction.corpus import documents

    docs = documents(split, n, seed=seed, tier=tier)
    diffusion_model.eval()
    records = decode_records(diffusion_model, codec, "diffusion", docs, batch_size, structured=structured,
                             on_batch=on_batch)
    fallback_texts = fallback_confidences = None
    if ar_model is not None:
        ar_model.eval()
        fallback = ar_completions(ar_model, codec, docs)
        fallback_texts, fallback_confidences = [c.text for c in fallback], [c.confidence for c in fallback]
    answers = score_answers([r.text for r in records], [r.confidence for r in records], docs, fallback_texts,
                            fallback_confidences)
    ar_accuracy = None
    if fallback_texts is not None:
        ar_accuracy = _accuracy(sum(a.fallback_fields_correct for a in answers), sum(a.fields_total for a in answers))
    explicit_target = target_field_accuracy is not None
    if target_field_accuracy is None:
        if ar_accuracy is None:
            raise ValueError("give a target field accuracy, or an AR model to take it from")
        target_field_accuracy = ar_accuracy
    curve = acceptance_curve(answers)
    choice = choose_threshold(answers, target_field_accuracy, curve)
    tiers = [d.tier for d in docs]
    by_tier = {"per_tier": per_tier_figures(answers, tiers, choice.threshold)} if len(set(tiers)) > 1 else {}
    return {"confidence_threshold": choice.threshold, **{k: v for k, v in asdict(choice).items() if k != "threshold"},
            "ar_field_accuracy": ar_accuracy, "n": n, "split": None if seed is not None else split, "seed": seed,
            "tier": tier, **by_tier,
            "structured": structured,
            "confidence_kind": "min_token_probability",
            "per_kind": per_kind_thresholds(answers, target_field_accuracy if explicit_target else None),
            "discrimination": discrimination(answers),
            "low_confidence": low_confidence_figures(answers),
            "curve": [{"threshold": round(t, 6), "acceptance_rate": round(a, 4), "accepted_field_accuracy": round(f, 4)}
                      for t, a, f in _thin(curve)]}


def ar_completions(ar_model, codec, docs: Sequence) -> list:
    """Greedy AR answers through the AR engine (its confidence is the one serving reports)."""
    from nowait.engines.config import ArEngineConfig
    from nowait.engines.factory import EngineModel, engine_from
    from nowait.evaluation import decode_documents_with

    engine = engine_from(ArEngineConfig(kind="ar"), EngineModel(ar_model, codec))
    return decode_documents_with(engine, list(docs), codec)


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


def _threshold(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else None


def calibrated_thresholds(model_dir: Path) -> tuple[dict[str, float], dict[str, KindThreshold]]:
    """The per-schema (hash -> threshold) and per-kind thresholds of a calibration file; both
    empty for a file written before them, or none. A malformed entry is skipped, not fatal."""
    path = Path(model_dir) / CALIBRATION_FILE
    try:
        kinds = json.loads(path.read_text()).get("per_kind") or {}
    except (OSError, ValueError, AttributeError):
        return {}, {}
    by_schema: dict[str, float] = {}
    by_kind: dict[str, KindThreshold] = {}
    for kind, entry in kinds.items() if isinstance(kinds, dict) else ():
        threshold = _threshold(entry.get("confidence_threshold")) if isinstance(entry, dict) else None
        if threshold is None:
            continue
        if isinstance(entry.get("schema_hash"), str):
            by_schema[entry["schema_hash"]] = threshold
        if isinstance(entry.get("fields"), list) and all(isinstance(f, str) for f in entry["fields"]):
            by_kind[kind] = KindThreshold(threshold=threshold, fields=tuple(entry["fields"]))
    return by_schema, by_kind
