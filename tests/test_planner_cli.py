"""`nowait plan` through Typer: JSON keys exactly as issue 7 names them, the report, errors, the host."""

from __future__ import annotations

import json

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tests.planner_support import planner_app

SMALL = {  # a 1B model on 8xH100, one replica per accelerator; small enough to plan in well under a second
    "name": "small", "hardware": {"node": "8xH100-SXM"}, "model": "llama-3.2-1b",
    "apis": [{"name": "api", "input_usd_per_mtok": 0.1, "output_usd_per_mtok": 0.4, "data_classes": ["public"]}],
    "workloads": [{"name": "chat", "arrival_rate_per_s": 5, "input_tokens": {"mean": 200, "sd": 50},
                   "output_tokens": 50, "p99_latency_s": 2, "token_value_usd_per_mtok": 1}],
    "simulation": {"requests": 300},
}
ENGINE_KEYS = {"single_stream_tokens_per_s", "tokens_per_s_per_node", "nodes", "p99_latency_s", "utilization",
               "cost_per_mtok_usd"}


@pytest.fixture
def app() -> typer.Typer:
    return planner_app()


@pytest.fixture
def scenario(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return path


def test_json_has_the_keys_the_issue_names(app, scenario):
    result = CliRunner().invoke(app, ["plan", str(scenario), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    (workload,) = plan["workloads"]
    assert {"name", "route", "engines"} <= set(workload)
    assert (workload["name"], workload["route"]) == ("chat", "diffusion")
    assert set(workload["engines"]) == {"ar", "spec", "diffusion"}
    for engine in workload["engines"].values():
        assert set(engine) >= ENGINE_KEYS
        assert engine["nodes"] is None or isinstance(engine["nodes"], int)


def test_table_output_and_report(app, scenario, tmp_path):
    result = CliRunner().invoke(app, ["plan", str(scenario), "--report", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "chat: route diffusion" in result.stdout
    report = (tmp_path / "out" / "small-report.md").read_text()
    for heading in ("# Plan: small", "## Findings", "## Summary", "## Assumptions", "### chat"):
        assert heading in report
    for figure in ("cost-vs-utilization", "nodes-vs-rate", "latency-vs-batch", "roofline"):
        png = tmp_path / "out" / f"small-{figure}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and f"(small-{figure}.png)" in report


def test_a_bad_scenario_is_one_error_line(app, tmp_path):
    path = tmp_path / "bad.yaml"
    bad = {**SMALL, "workloads": [{**SMALL["workloads"][0], "arrival_rate_per_s": -1}]}
    path.write_text(yaml.safe_dump(bad))
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert result.stderr.count("error:") == 1
    assert "workloads[0] (chat).arrival_rate_per_s: must be greater than 0" in result.stderr


def test_a_model_that_does_not_fit_is_an_error_not_a_traceback(app, tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "model": "llama-3-70b"}))  # tensor_parallel 1: 141 GB on one H100
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert "model: llama-3-70b needs 141 GB" in result.stderr


def test_measure_host_prints_figures_usable_in_a_scenario(app, tmp_path):
    result = CliRunner().invoke(app, ["plan", "--measure-host", "--measure-seconds", "0.2", "--json"])
    assert result.exit_code == 0, result.output
    host = json.loads(result.stdout)
    assert host["name"] == "host" and host["peak_tflops"]["fp32"] > 0 and host["memory_bandwidth_tb_s"] > 0
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump({**SMALL, "dtype": "fp32", "accelerators": [host],
                                    "model": {"name": "tiny", "config": {
                                        "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4,
                                        "num_attention_heads": 6, "vocab_size": 1024}},
                                    "hardware": {"node": "host", "price_usd_per_hour": 0}}))
    result = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["node"]["accelerator"] == "host"
