"""The planner's output tokens/s beside a load test's concurrent runs (`nowait plan SCENARIO
--check LOAD.json --replicas N`): the same engine model the plan uses (`EngineFleet.make`,
`replica_tokens_per_s`), at the batch each of the target's N replicas holds when the run's
streams are spread over them, times N. No second model: what the planner would predict for
that config, printed beside what was measured.

The planner gives each replica its own accelerator (a node's GPU); N replicas sharing one CPU,
as a local fleet on a small machine does, measure far below N times one, and that gap is the
machine, not the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nowait.planner.engines import replica_tokens_per_s
from nowait.planner.fleets import EngineFleet


@dataclass(frozen=True)
class ThroughputRow:
    target: str
    engine: str
    streams: int
    replicas: int
    batch: int  # per replica
    prompt_tokens: float
    output_tokens: float
    predicted_tokens_per_s: float
    measured_tokens_per_s: float

    @property
    def relative_error(self) -> float:
        """Signed: positive when the planner predicts more than was measured."""
        return (self.predicted_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s


def predicted_tokens_per_s(fleet: EngineFleet, streams: int, replicas: int, prompt_tokens: float,
                           output_tokens: float) -> tuple[int, float]:
    """(batch per replica, output tokens/s of all replicas) for `streams` closed-loop streams."""
    batch = max(1, min(math.ceil(streams / replicas), fleet.max_batch))
    serving = fleet.make(batch)
    return batch, replicas * replica_tokens_per_s(serving, batch, prompt_tokens, output_tokens)


def check_throughput(fleets: dict[str, EngineFleet], load: dict, replicas: int,
                     default_kind: str = "ar") -> tuple[list[ThroughputRow], list[str]]:
    """Each concurrent run of a kind the scenario plans, with the planner's figure beside it; and
    notes on the runs left out."""
    rows, notes = [], []
    for run in load.get("runs") or []:
        if run.get("profile") != "concurrent":
            continue
        target, kind = str(run.get("target")), run.get("kind") or default_kind
        measured = run.get("output_tokens_per_s")
        if kind not in fleets:
            notes.append(f"{target} ({kind}): throughput not checked: the scenario plans no such engine")
            continue
        if not run.get("successful") or not measured:
            notes.append(f"{target}: throughput not checked: its concurrent run has no successful request")
            continue
        prefix = "median" if run.get("median_output_tokens") is not None else "mean"
        prompt, output = float(run[f"{prefix}_prompt_tokens"]), float(run[f"{prefix}_output_tokens"])
        streams = int(float(run["rate"]))
        batch, predicted = predicted_tokens_per_s(fleets[kind], streams, replicas, prompt, output)
        rows.append(ThroughputRow(target, kind, streams, replicas, batch, prompt, output, predicted, float(measured)))
    return rows, notes


def to_json(rows: list[ThroughputRow]) -> list[dict]:
    return [{"target": r.target, "engine": r.engine, "streams": r.streams, "replicas": r.replicas,
             "batch_per_replica": r.batch, "predicted_tokens_per_s": round(r.predicted_tokens_per_s, 3),
             "measured_tokens_per_s": round(r.measured_tokens_per_s, 3),
             "relative_error": round(r.relative_error, 4)} for r in rows]
