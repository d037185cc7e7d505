"""How well a confidence floor catches wrong answers: recall against false flags.

The gateway flags an answer below its engine's floor (`routing.low_confidence`,
router.below_floor). A floor is worth its flags when it catches the answers with a wrong field
(recall: the share of them below it) while leaving the right ones alone (false-flag rate: the
share of fully correct answers below it). These are pure functions over (confidence, wrong)
lists, so `nowait eval --engine routed` and `nowait calibrate` report the same arithmetic on the
confidences they already decoded. A rate over an empty class is None (undefined), not 0 or 1:
with no wrong answers there is nothing a floor could catch or miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

# issue 23's goal for the default floor: catch at least half the wrong answers, flag at most a
# tenth of the right ones.
GOAL_RECALL = 0.5
GOAL_FALSE_FLAG_RATE = 0.10
GOAL = {"recall_at_least": GOAL_RECALL, "false_flag_rate_at_most": GOAL_FALSE_FLAG_RATE}  # as the reports say it
SWEEP = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def below(confidence: float | None, floor: float) -> bool:
    """The gateway's test (router.below_floor): no confidence is never below, NaN always is."""
    return confidence is not None and not confidence >= floor


def _rate(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


@dataclass(frozen=True)
class FloorRates:
    """One floor's flags over some answers."""

    floor: float | None  # None: a row of answers each at its own engine's floor, and these differ
    wrong: int  # answers with at least one wrong field
    wrong_flagged: int
    correct: int  # answers with every field right
    correct_flagged: int
    recall: float | None  # wrong_flagged / wrong; None without wrong answers
    false_flag_rate: float | None  # correct_flagged / correct; None without correct answers
    meets_goal: bool | None  # recall >= GOAL_RECALL, false flags <= GOAL_FALSE_FLAG_RATE; None: either undefined


def _rates(floor: float | None, n_wrong: int, wrong_flagged: int, n_correct: int, correct_flagged: int) -> FloorRates:
    recall, false_flags = _rate(wrong_flagged, n_wrong), _rate(correct_flagged, n_correct)
    # Undefined unless both classes are there: with no correct answers even a floor that flags
    # everything would look perfect, with no wrong ones there is nothing to catch.
    meets = (None if recall is None or false_flags is None
             else recall >= GOAL_RECALL and false_flags <= GOAL_FALSE_FLAG_RATE)
    return FloorRates(floor, n_wrong, wrong_flagged, n_correct, correct_flagged, recall, false_flags, meets)


def floor_rates(confidences: Sequence[float | None], wrong: Sequence[bool], floor: float) -> FloorRates:
    """Recall and false-flag rate of one floor over answers (confidence, has a wrong field)."""
    pairs = list(zip(confidences, wrong, strict=True))
    n_wrong = sum(w for _, w in pairs)
    wrong_flagged = sum(w and below(c, floor) for c, w in pairs)
    correct_flagged = sum(not w and below(c, floor) for c, w in pairs)
    return _rates(floor, n_wrong, wrong_flagged, len(pairs) - n_wrong, correct_flagged)


def sweep_floors(default_floors: Sequence[float], sweep: Sequence[float] = SWEEP) -> list[float]:
    """The sweep with the default floor(s) in it, ascending, each once."""
    return sorted({round(f, 6) for f in (*sweep, *default_floors)})


def floor_report(confidences: Sequence[float | None], wrong: Sequence[bool], floor: float,
                 floors: Sequence[float]) -> dict:
    """One engine's answers: the figures at its floor, at each floor of the sweep, and which
    floors of the sweep meet the goal."""
    sweep = [floor_rates(confidences, wrong, f) for f in floors]
    return {"n": len(wrong), "floor": floor, "at_floor": asdict(floor_rates(confidences, wrong, floor)),
            "sweep": [asdict(r) for r in sweep], "floors_meeting_goal": [r.floor for r in sweep if r.meets_goal]}


def routed_report(confidences: Sequence[float | None], wrong: Sequence[bool], engines: Sequence[str],
                  floors_by_engine: dict[str, float], floors: Sequence[float]) -> dict:
    """The answers as the gateway returns them (each from the engine that kept it): at the
    default, each answer against its own engine's floor (the gateway's flags); in the sweep, one
    floor for every engine."""
    at_floor = _combine([floor_rates([c], [w], floors_by_engine[e]) for c, w, e in
                         zip(confidences, wrong, engines, strict=True)])
    sweep = [floor_rates(confidences, wrong, f) for f in floors]
    return {"n": len(wrong), "floor": dict(floors_by_engine), "at_floor": asdict(at_floor),
            "sweep": [asdict(r) for r in sweep], "floors_meeting_goal": [r.floor for r in sweep if r.meets_goal]}


def _combine(rows: list[FloorRates]) -> FloorRates:
    """Several answers' counts, each at its own floor, as one row."""
    floors = {r.floor for r in rows}
    return _rates(floors.pop() if len(floors) == 1 else None, sum(r.wrong for r in rows),
                  sum(r.wrong_flagged for r in rows), sum(r.correct for r in rows),
                  sum(r.correct_flagged for r in rows))
