"""`nowait plan SCENARIO --fleet-out fleet.yaml`: the plan's nodes and batches as the engines'
fleet sections, in a file the gateway config accepts as it is."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from nowait.gateway.config import load_config
from tests.planner_support import planner_app
from tests.test_planner_cli import SMALL


def test_fleet_out_writes_what_the_plan_sized(tmp_path):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(yaml.safe_dump({**SMALL, "tensor_parallel": 2}))
    out = tmp_path / "fleet.yaml"
    result = CliRunner().invoke(planner_app(), ["plan", str(scenario), "--json", "--fleet-out", str(out)])
    assert result.exit_code == 0, result.output
    (workload,) = json.loads(result.stdout)["workloads"]
    planned = workload["engines"][workload["route"]]
    config = load_config(out)  # deploys as it is: a valid gateway config
    engine = config.engines[workload["route"]]
    fleet = engine.fleet
    replicas_per_node = 8 // 2  # 8 accelerators, tensor parallel 2
    assert fleet.replicas.min == fleet.replicas.max == planned["nodes"] * replicas_per_node
    assert fleet.gpus_per_replica == 2
    assert fleet.target_ongoing_requests == planned["batch"]
    assert set(config.engines) == {workload["route"], *([workload["fallback"]] if workload["fallback"] else [])}
    assert out.read_text().startswith(f"# nowait plan {scenario} --fleet-out {out}")
