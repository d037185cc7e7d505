"""No silent garbage: an answer below its engine's confidence floor (`routing.low_confidence`).

The router decides what may happen (router.below_floor, router.low_confidence_rerun: a frontier
re-run only where the data class may go); the dispatcher applies it. This module holds what both
the dispatcher and the responses speak of: the record of one such answer, the 422 a `reject`
answers with, and the header a flagged answer carries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from nowait.gateway.errors import APIError

if TYPE_CHECKING:
    from nowait.gateway.domain import Attempt

LOW_CONFIDENCE_HEADER = "x-nowait-low-confidence"
LOW_CONFIDENCE = "low_confidence"  # the 422's error code


@dataclass(frozen=True)
class LowConfidence:
    """One answer below its engine's floor and what was done: flag, frontier (re-run) or reject."""

    engine: str
    confidence: float
    floor: float
    action: str

    def record(self) -> dict:
        return asdict(self)


class LowConfidenceError(APIError):
    """`routing.low_confidence: reject`: 422, with every engine's confidence in the body."""

    def __init__(self, low: LowConfidence, attempts: list[Attempt]) -> None:
        tried = ", ".join(f"{a.engine} {a.confidence:.3g}" for a in attempts if a.confidence is not None)
        super().__init__(422, f"no answer is sure enough to return: {low.engine} confidence {low.confidence:.3g} is "
                              f"below its floor {low.floor:g} (confidences: {tried})", code=LOW_CONFIDENCE)
        self.low = low
        self.confidences = [{"engine": a.engine, "confidence": a.confidence} for a in attempts
                            if a.finish_reason != "error"]

    def body(self) -> dict:
        body = super().body()
        body["error"]["confidences"] = self.confidences
        body["error"]["floor"] = self.low.floor
        return body
