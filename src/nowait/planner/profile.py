"""Measured step times (`nowait plan --profile BENCH.json`): read, fit, and use instead of the roofline.

The format (written by the benchmark, documented in docs/planner.md):

    {"format": "nowait-profile/1", "model": "...", "hardware": "...", "measured_at": "2025-06-01",
     "measurements": [{"engine": "ar", "batch": 1, "new_tokens": 1, "context": 300, "seconds": 0.0041}, ...],
     "engine_parameters": {"spec": {"acceptance_rate": 0.71, "gamma": 4},
                           "diffusion": {"tokens_per_forward": 3.2, "fallback_rate": 0.04}}}

Each measurement is one forward of one model: `ar` (the target model, also the verifier of
speculative decoding), `draft` (the speculative draft) or `diffusion`. Per engine the planner fits
seconds = c0 + c1 * tokens + c2 * cache_reads + c3 * attention_pairs by least squares with
non-negative coefficients, the roofline's terms as features: c0 the weights read and the fixed
overhead, c1 per token processed, c2 per cached token read, c3 per (query, key) pair. Only the
features the measurements can tell apart are fitted (`identifiable_features`), so a profile of a
few points, such as one synchronous load test, still extrapolates sensibly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROFILE_FORMAT = "nowait-profile/1"
FEATURES = ("per_forward", "tokens", "cache_reads", "attention_pairs")


class Measurement(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: Literal["ar", "draft", "diffusion"]
    batch: int = Field(ge=1)
    new_tokens: int = Field(ge=1)
    context: int = Field(0, ge=0, description="cached tokens per sequence before this forward")
    seconds: float = Field(gt=0)


class SpecParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    acceptance_rate: float | None = Field(None, ge=0, le=1)
    gamma: int | None = Field(None, ge=1)


class DiffusionParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_forward: float | None = Field(None, gt=0)
    fallback_rate: float | None = Field(None, ge=0, le=1)


class EngineParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: SpecParameters = SpecParameters()
    diffusion: DiffusionParameters = DiffusionParameters()


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["nowait-profile/1"] = PROFILE_FORMAT
    model: str = ""
    hardware: str = ""
    measured_at: str = ""
    measurements: list[Measurement] = Field(min_length=1)
    engine_parameters: EngineParameters = EngineParameters()


class ProfileError(ValueError):
    pass


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ProfileError(f"{path}: cannot read a profile ({error})") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise ProfileError(f"{path}: {where}: {first['msg']}") from None


def step_features(new_tokens: float, cached_tokens: float, batch: float) -> np.ndarray:
    """The roofline's terms of one forward: one weight pass, tokens, cache reads, attention pairs."""
    tokens = batch * new_tokens
    return np.array([1.0, tokens, batch * cached_tokens, tokens * (cached_tokens + new_tokens)])


# Non-negative least squares by elimination: refit without any feature whose coefficient comes out
# negative (a measured time cannot fall as work grows); enough for four features.
def fit_non_negative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    active = list(range(features.shape[1]))
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients = np.zeros(features.shape[1])
            coefficients[active] = solution
            return coefficients
        del active[int(np.argmin(solution))]
    return np.zeros(features.shape[1])


@dataclass(frozen=True)
class FittedStepTime:
    """A ForwardTimer fitted to measurements; `coefficients` follow FEATURES."""

    engine: str
    coefficients: tuple[float, ...]
    measurements: int
    worst_relative_error: float  # on the measurements themselves

    def __call__(self, new_tokens: float, cached_tokens: float, batch: float) -> float:
        return float(step_features(new_tokens, cached_tokens, batch) @ np.array(self.coefficients))


def identifiable_features(features: np.ndarray) -> list[int]:
    """The features the measurements can tell apart, taken in FEATURES order.

    A feature joins only if it adds a dimension to those already taken. Without this, fewer
    distinct measurements than features leave the least-squares problem underdetermined and its
    minimum-norm answer puts the time on the largest feature (attention pairs): one diffusion
    forward measured at 95 new tokens over 180 cached would predict a 32-token forward at a third
    of its time. With one measurement the fit is a constant time per forward; with a prefill and
    a decode step, a time per forward plus a time per token; decode steps alone never separate
    attention pairs from tokens plus cache reads (for one new token they are their sum).
    """
    scaled = features / np.maximum(np.linalg.norm(features, axis=0), 1e-300)
    chosen: list[int] = []
    for column in range(features.shape[1]):
        if np.linalg.matrix_rank(scaled[:, [*chosen, column]]) > len(chosen):
            chosen.append(column)
    return chosen


def fit_engine(engine: str, measurements: list[Measurement]) -> FittedStepTime:
    rows = [m for m in measurements if m.engine == engine]
    if not rows:
        raise ProfileError(f"the profile has no measurements for engine {engine!r}")
    features = np.stack([step_features(m.new_tokens, m.context, m.batch) for m in rows])
    seconds = np.array([m.seconds for m in rows])
    # Scale each row by 1/seconds so the fit minimizes relative, not absolute, error (a prefill of
    # 0.5 s would otherwise drown a decode step of 5 ms).
    scaled = features / seconds[:, None]
    usable = identifiable_features(scaled)
    coefficients = np.zeros(features.shape[1])
    coefficients[usable] = fit_non_negative(scaled[:, usable], np.ones_like(seconds))
    predicted = features @ coefficients
    worst = float(np.max(np.abs(predicted - seconds) / seconds))
    return FittedStepTime(engine, tuple(float(c) for c in coefficients), len(rows), worst)


def fit_profile(profile: Profile) -> dict[str, FittedStepTime]:
    """One fitted step time per engine present in the profile."""
    engines = sorted({m.engine for m in profile.measurements})
    return {engine: fit_engine(engine, profile.measurements) for engine in engines}
