"""--device on every bench and eval that runs an engine in this process: a device this machine
lacks is one clear line before any weights are read, and the config's engines move together."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nowait.cli import app
from nowait.gateway.config import parse_config
from tests.test_cli import assert_one_clear_line

runner = CliRunner()

ENGINE_COMMANDS = [
    ["eval", "--n", "1"],
    ["eval", "--engine", "ar", "--structured", "--n", "1"],
    ["eval", "--engine", "spec", "--n", "1"],
    ["eval", "--engine", "routed", "--n", "1"],
    ["calibrate", "--n", "1", "--no-write"],
    ["bench", "engines", "--n", "1"],
    ["bench", "batching"],
    ["bench", "cache-modes", "--n", "1"],
    ["bench", "physics"],
    ["bench", "peers", "--n", "1"],
    ["bench", "load", "--engine", "ar", "--max-requests", "1"],
    ["bench", "gateway", "--requests", "1", "--clients", "1"],
]


@pytest.mark.parametrize("args", ENGINE_COMMANDS, ids=lambda a: " ".join(a[:3]))
def test_every_engine_command_takes_device_and_refuses_an_unknown_one(args):
    result = runner.invoke(app, [*args, "--device", "bogus"])
    assert_one_clear_line(result, "unknown device 'bogus'")


def test_bench_load_device_needs_an_in_process_engine():
    result = runner.invoke(app, ["bench", "load", "--base-url", "http://127.0.0.1:9/v1", "--device", "cpu"])
    assert_one_clear_line(result, "--device applies to --engine")


def test_on_device_moves_the_named_in_process_engines_only():
    config = parse_config({"engines": {
        "ar": {"kind": "ar"}, "diffusion": {"kind": "diffusion"},
        "frontier": {"kind": "remote", "base_url": "http://127.0.0.1:9/v1", "model": "m",
                     "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}}})
    moved = config.on_device(["ar", "frontier", "absent"], "cuda:1")
    assert moved.engines["ar"].device == "cuda:1"
    assert moved.engines["diffusion"].device == "cpu"  # not named
    assert moved.engines["frontier"] == config.engines["frontier"]  # remote: runs elsewhere
    assert config.engines["ar"].device == "cpu"  # a copy; the original is unchanged
