"""`nowait plan --check LOAD --replicas N`: the planner's output tokens/s beside a load test's
concurrent runs, on hand-made numbers. The profile times every forward at 10 ms whatever its
shape, so a replica of the AR engine at batch B on a 10-token prompt and a 9-token answer costs
each request its prefill (10 ms) plus 1/B of its 9 decode steps (90 ms / B):
  16 streams on 1 replica (batch 16): 9 / (0.010 + 0.090 / 16) = 576.0 tokens/s;
  16 streams on 2 replicas (batch 8 each): 2 x 9 / (0.010 + 0.090 / 8) = 847.1 tokens/s.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.planner_support import planner_app
from tests.test_planner_calibration import PROFILE, SCENARIO, run


def concurrent(target: str, streams: int, measured: float, kind: str = "ar") -> dict:
    return {**run(target, kind, 500.0, 10, 9, profile="concurrent"), "rate": float(streams),
            "output_tokens_per_s": measured}


def check(tmp_path, runs: list[dict], *extra: str):
    (tmp_path / "s.yaml").write_text(json.dumps(SCENARIO))
    (tmp_path / "bench.json").write_text(json.dumps(PROFILE))
    (tmp_path / "load.json").write_text(json.dumps({"benchmark": "nowait bench load", "runs": runs}))
    args = ["plan", str(tmp_path / "s.yaml"), "--profile", str(tmp_path / "bench.json"), "--check",
            str(tmp_path / "load.json"), "--json", *extra]
    return CliRunner().invoke(planner_app(), args)


def test_tokens_per_s_beside_each_concurrent_run_at_the_batch_its_replicas_hold(tmp_path):
    one = check(tmp_path, [concurrent("fleet-1", 16, 288.0)])
    assert one.exit_code == 0, one.output  # a throughput-only load test is not judged
    [row] = json.loads(one.output)["throughput"]
    assert (row["streams"], row["replicas"], row["batch_per_replica"]) == (16, 1, 16)
    assert row["predicted_tokens_per_s"] == 576.0 and row["relative_error"] == 1.0
    two = check(tmp_path, [concurrent("fleet-2", 16, 300.0), run("sync", "ar", 100.0, 10, 9)], "--replicas", "2")
    report = json.loads(two.output)
    [row] = report["throughput"]
    assert (row["replicas"], row["batch_per_replica"]) == (2, 8)
    assert abs(row["predicted_tokens_per_s"] - 2 * 9 / (0.010 + 0.090 / 8)) < 1e-3
    assert report["engines"], "the synchronous run is still checked for latency"


def test_a_concurrent_run_of_an_engine_the_scenario_does_not_plan_is_a_note(tmp_path):
    result = CliRunner().invoke(planner_app(), ["plan", "--help"])
    assert "--replicas" in result.output
    out = check(tmp_path, [concurrent("up", 4, 100.0, kind="remote"), concurrent("ar", 4, 100.0)])
    assert out.exit_code == 0, out.output
    assert [r["target"] for r in json.loads(out.output)["throughput"]] == ["ar"]
