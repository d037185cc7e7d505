"""`nowait plan SCENARIO --profile BENCH.json --check LOAD.json`: predicted vs measured batch-1 latency.

Issue 7's target: on this machine, with `--profile` from the benchmark, the predicted batch-1
latency of each demo engine is within 20% of the measured one. The measured side is a
`nowait bench load --json` output (or the `load.json` of its `--report`): each synchronous run
(one request at a time, so batch 1) of an AR or diffusion engine gives its e2e p50 and, for AR,
its TTFT and ITL p50, with the median prompt and answer lengths of its requests. The predicted
side is the planner's own step model for that engine (`planner.engines`, built as `nowait plan`
builds it, with the profile's step times and engine parameters) at exactly those lengths:

    e2e    request_seconds(engine, batch 1, prompt, answer)   the planner's latency of a request alone
    TTFT   prefill + the first step                            when the planner's model emits output first
    ITL    (e2e - TTFT) / (answer - 1)                         the bench's definition, on the predicted times

Median lengths against the e2e p50: at batch 1 a request's latency grows with its lengths, so the
median request is (about) the one at the median lengths. Relative error = (predicted - measured) /
measured; beyond the tolerance a figure is flagged, and the check fails when an engine's e2e is.
TTFT and ITL are diagnostics (which part of the model is off); diffusion has none, since it streams
whole blocks whose width is the engine's, not the planner's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from nowait.planner.engines import ServingModel, request_seconds

TOLERANCE = 0.20
CHECKED_KINDS = ("ar", "diffusion")  # the engines a load test's profile measures
_SKIPPED = {
    "spec": "the load test writes no speculative measurements (a step is a draft run plus a verify forward), "
            "so the planner's spec latency rests on the scenario's draft and acceptance assumptions",
    "router": "the router's model mixes engines: pin them (--model ar,diffusion, or --engine ar,diffusion)",
    "remote": "a remote upstream runs on hardware the scenario does not describe",
}


class CalibrationError(ValueError):
    """A load-test file the check cannot use (one clear line)."""


@dataclass(frozen=True)
class MeasuredRun:
    """One synchronous run of one engine, as the load test reported it (times in seconds)."""

    target: str
    engine: str  # the planner's engine: ar | diffusion
    requests: int
    prompt_tokens: float
    output_tokens: float
    lengths: str  # "median", or "mean" for a load test written before medians were reported
    e2e_s: float
    ttft_s: float | None = None
    itl_s: float | None = None
    cached_prompt_tokens: float = 0.0  # restored from the server's prefix cache, on average


@dataclass(frozen=True)
class Timeline:
    """A request alone, as the planner's step model sees it."""

    ttft_s: float
    e2e_s: float
    itl_s: float | None


@dataclass(frozen=True)
class Comparison:
    metric: str  # e2e | ttft | itl
    predicted_s: float
    measured_s: float
    relative_error: float
    flagged: bool


@dataclass(frozen=True)
class EngineCheck:
    run: MeasuredRun
    basis: str  # "profile", or "roofline" for an engine the profile does not measure
    comparisons: tuple[Comparison, ...]

    @property
    def e2e(self) -> Comparison:
        return next(c for c in self.comparisons if c.metric == "e2e")


@dataclass
class CalibrationCheck:
    engines: list[EngineCheck]
    tolerance: float = TOLERANCE
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.engines) and not any(e.e2e.flagged for e in self.engines)


# --- the arithmetic ------------------------------------------------------------------------------------


def relative_error(predicted: float, measured: float) -> float:
    """Signed: positive when the planner is slower (more conservative) than the measurement."""
    return (predicted - measured) / measured


def compare(metric: str, predicted: float, measured: float, tolerance: float = TOLERANCE) -> Comparison:
    error = relative_error(predicted, measured)
    return Comparison(metric, predicted, measured, error, abs(error) > tolerance)


def predicted_timeline(serving: ServingModel, prompt_tokens: float, output_tokens: float) -> Timeline:
    """The planner's batch-1 request: e2e as it plans it, TTFT after the prefill and first step."""
    e2e = request_seconds(serving, 1, prompt_tokens, output_tokens)
    ttft = serving.prefill_seconds(prompt_tokens, 1) + serving.step_seconds(1, prompt_tokens, output_tokens)
    itl = (e2e - ttft) / (output_tokens - 1) if output_tokens >= 2 else None
    return Timeline(ttft_s=ttft, e2e_s=e2e, itl_s=itl)


def check_engine(serving: ServingModel, run: MeasuredRun, basis: str, tolerance: float = TOLERANCE) -> EngineCheck:
    if run.cached_prompt_tokens and hasattr(serving, "shared_prefix_tokens"):
        # The run's prompts began with what the server's prefix cache restored: predict the same.
        serving = replace(serving, shared_prefix_tokens=run.cached_prompt_tokens)
    predicted = predicted_timeline(serving, run.prompt_tokens, run.output_tokens)
    comparisons = [compare("e2e", predicted.e2e_s, run.e2e_s, tolerance)]
    if run.engine == "ar":  # token by token in the planner and in the engine, so TTFT and ITL compare
        if run.ttft_s:
            comparisons.append(compare("ttft", predicted.ttft_s, run.ttft_s, tolerance))
        if run.itl_s and predicted.itl_s is not None:
            comparisons.append(compare("itl", predicted.itl_s, run.itl_s, tolerance))
    return EngineCheck(run, basis, tuple(comparisons))


# --- reading the load test -----------------------------------------------------------------------------


def _p50_s(figures: dict | None) -> float | None:
    value = (figures or {}).get("p50")
    return None if value is None else float(value) / 1000.0


def measured_runs(load: dict, default_kind: str = "ar") -> tuple[list[MeasuredRun], list[str]]:
    """The synchronous runs of AR and diffusion engines in a `bench load --json` object, and notes
    on the runs left out. A server that does not say its engines' kinds (vLLM, SGLang) is taken as
    `default_kind`, as `bench load --profile-out` takes it."""
    runs, notes = [], []
    for run in load.get("runs") or []:
        if run.get("profile") != "synchronous":
            continue
        target = str(run.get("target"))
        kind = run.get("kind") or default_kind
        if kind not in CHECKED_KINDS:
            notes.append(f"{target} ({kind}): not checked: {_SKIPPED.get(kind, 'no step model for this kind')}")
            continue
        e2e = _p50_s(run.get("e2e_ms"))
        if not run.get("successful") or e2e is None:
            notes.append(f"{target}: not checked: its synchronous run has no successful request")
            continue
        medians = run.get("median_prompt_tokens") is not None and run.get("median_output_tokens") is not None
        prefix = "median" if medians else "mean"
        if not medians:
            notes.append(f"{target}: this load test reports no median lengths; predicted at the mean lengths")
        runs.append(MeasuredRun(
            target=target, engine=kind, requests=int(run["successful"]),
            prompt_tokens=float(run[f"{prefix}_prompt_tokens"]), output_tokens=float(run[f"{prefix}_output_tokens"]),
            lengths=prefix, e2e_s=e2e, ttft_s=_p50_s(run.get("ttft_ms")), itl_s=_p50_s(run.get("itl_ms")),
            cached_prompt_tokens=float(run.get("mean_cached_prompt_tokens") or 0.0)))
    return runs, notes


def load_measurements(path: str | Path) -> dict:
    """A `bench load --json` output (or the load.json of its --report)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CalibrationError(f"{path}: cannot read a load test ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise CalibrationError(f"{path}: not a `nowait bench load --json` output (no runs list)")
    return data


def check_latency(servings: dict[str, ServingModel], measured: list[MeasuredRun], profiled: set[str],
                  tolerance: float = TOLERANCE) -> CalibrationCheck:
    """Each measured run against the planner's engine of its kind, built at batch cap 1."""
    engines = [check_engine(servings[run.engine], run, "profile" if run.engine in profiled else "roofline", tolerance)
               for run in measured]
    notes = [f"{run.engine}: not in the profile, predicted by the roofline" for run in measured
             if run.engine not in profiled]
    return CalibrationCheck(engines=engines, tolerance=tolerance, notes=list(dict.fromkeys(notes)))


def to_json(check: CalibrationCheck, scenario: str, profile: str | None, load: str) -> dict:
    """The `--check --json` object: per engine, predicted, measured and relative error of each figure."""
    def figure(c: Comparison) -> dict:
        return {"predicted_s": round(c.predicted_s, 6), "measured_s": round(c.measured_s, 6),
                "relative_error": round(c.relative_error, 4), "flagged": c.flagged}

    return {
        "scenario": scenario, "profile": profile, "load": load, "tolerance": check.tolerance,
        "passed": check.passed,
        "engines": [{
            "engine": e.run.engine, "target": e.run.target, "basis": e.basis, "requests": e.run.requests,
            "prompt_tokens": e.run.prompt_tokens, "output_tokens": e.run.output_tokens, "lengths": e.run.lengths,
            "within_tolerance": not e.e2e.flagged,
            **{c.metric: figure(c) for c in e.comparisons},
        } for e in check.engines],
        "notes": check.notes,
    }
