"""The real `nowait` app: every command it registers, each one's --help, one small real run of the
commands no other test runs through `nowait.cli.app`, and the installed console script.

Commands whose real run lives in another test module, on `nowait.cli.app`, are named in
RUN_ELSEWHERE; test_the_modules_named_for_a_real_run_use_the_real_app keeps that claim true.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path

import httpx
import pytest
import typer
import yaml
from typer.testing import CliRunner

from nowait.cli import app
from tests.load_support import last_json, save_corpus_models

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "nowait"  # installed by [project.scripts] next to this interpreter

# Every command and subcommand `nowait` must offer: one registration removed from cli.py (or one
# added without a test) fails test_the_app_registers_exactly_the_expected_commands.
RUN_HERE = {"plan", "serve", "demo", "bench batching", "bench gateway", "bench load"}
RUN_ELSEWHERE = {  # command -> the module whose test runs it for real through nowait.cli.app
    "train": "test_training_resume.py",
    "eval": "test_cli.py",
    "extract": "test_cli.py",
    "calibrate": "test_calibration.py",
    "generate": "test_generate_cli.py",
    "bench engines": "test_bench_engines.py",
    "bench cache-modes": "test_bench_engines.py",
    "bench physics": "test_bench_physics.py",
    "audit verify": "test_audit_cli.py",
    "audit spend": "test_audit_cli.py",
    "keys create": "test_tenants_keys.py",
    "keys list": "test_tenants_keys.py",
    "keys revoke": "test_tenants_keys.py",
    "bench soak": "test_bench_soak.py",
    "bench peers": "test_bench_peers.py",
    "export-gguf": "test_export_gguf.py",
    # The fleet's commands run as a process (`python -m nowait.cli`), as a user runs them.
    "fleet up": "test_fleet_cli.py",
    "fleet status": "test_fleet_cli.py",
    "fleet down": "test_fleet_cli.py",
}
GROUPS = {"bench", "audit", "keys", "fleet"}
# Wide, so that rich never wraps an option's name across lines in the help panels.
runner = CliRunner(env={"COLUMNS": "250"})


def walk(command, path: tuple[str, ...] = ()):
    """(path, command) for the app, each group and each command under it, as click sees them."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


REGISTERED = dict(walk(typer.main.get_command(app)))


def invoke(*args: str):
    return runner.invoke(app, list(args), prog_name="nowait")


def test_the_app_registers_exactly_the_expected_commands():
    leaves = {" ".join(path) for path, command in REGISTERED.items() if not hasattr(command, "commands")}
    groups = {" ".join(path) for path, command in REGISTERED.items() if path and hasattr(command, "commands")}
    assert leaves == RUN_HERE | set(RUN_ELSEWHERE)
    assert groups == GROUPS


@pytest.mark.parametrize("path", sorted(REGISTERED), ids=lambda path: " ".join(path) or "nowait")
def test_every_command_and_group_answers_help(path):
    """Taken from the app itself, so a command added later is covered without a line here."""
    command = REGISTERED[path]
    result = invoke(*path, "--help")
    assert result.exit_code == 0, result.output
    assert " ".join(("Usage: nowait", *path)) in result.output
    for parameter in command.params:
        names = [parameter.name] if parameter.param_type_name == "argument" else parameter.opts
        for name in [*names, *parameter.secondary_opts]:
            assert name in result.output, (path, name)
    for name in getattr(command, "commands", {}):
        assert name in result.output, (path, name)


def test_the_modules_named_for_a_real_run_use_the_real_app():
    for command, module in RUN_ELSEWHERE.items():
        text = (ROOT / "tests" / module).read_text()
        assert "from nowait.cli import app" in text or '"-m", "nowait.cli"' in text, module
        assert f'"{command.split()[-1]}"' in text, (command, module)


# --- one small real run of each command no other module runs on the real app ---


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec) -> Path:
    """Tiny random ar and draft checkpoints with room for corpus prompts."""
    return save_corpus_models(tmp_path_factory.mktemp("cli-models"), codec, diffusion=False)


@pytest.fixture(scope="module")
def gateway_config(models, tmp_path_factory) -> Path:
    """A gateway config serving only the tiny AR model: no keys (loopback), one torch thread."""
    root = tmp_path_factory.mktemp("cli-gateway")
    config = {"server": {"host": "127.0.0.1", "port": 0, "torch_threads": 1},
              "auth": {"api_keys": [], "api_keys_env": None}, "data_dir": str(root / "data"),
              "engines": {"ar": {"kind": "ar", "model": str(models / "ar"), "max_num_seqs": 2}},
              "routing": {"fast_engine": None}}
    path = root / "nowait.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_plan_prints_a_route_and_figures_per_engine(tmp_path):
    scenario = {  # a 1B model on 8xH100: plans in well under a second (examples/bank.yaml takes seconds)
        "name": "small", "hardware": {"node": "8xH100-SXM"}, "model": "llama-3.2-1b",
        "workloads": [{"name": "chat", "arrival_rate_per_s": 5, "input_tokens": 200, "output_tokens": 50,
                       "p99_latency_s": 2, "token_value_usd_per_mtok": 1}],
        "simulation": {"requests": 300}}
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(scenario))
    result = invoke("plan", str(path), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    (workload,) = plan["workloads"]
    assert workload["name"] == "chat" and workload["route"] in workload["engines"]
    assert set(workload["engines"]) == {"ar", "spec", "diffusion"}
    for engine in workload["engines"].values():
        assert engine["single_stream_tokens_per_s"] > 0


def test_bench_batching_refuses_an_unknown_cuda_graphs_mode_in_one_line(models):
    result = invoke("bench", "batching", "--model", str(models / "ar"), "--cuda-graphs", "maybe")
    assert result.exit_code == 2 and "--cuda-graphs must be auto, on or off, got 'maybe'" in result.output


def test_bench_batching_compares_batched_and_one_at_a_time_runs(models):
    result = invoke("bench", "batching", "--model", str(models / "ar"), "--concurrency", "1", "--rounds", "1",
                    "--max-tokens", "2", "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    (level,) = report["results"]
    assert level["concurrency"] == 1 and level["outputs_identical"] is True
    assert 1 <= level["output_tokens"] <= 2 and level["batched_tokens_per_s"] > 0
    assert report["settings"] == {"model": str(models / "ar"), "engine": "ar", "structured": False,
                                  "max_tokens": 2, "rounds": 1, "threads": report["settings"]["threads"],
                                  "device": "cpu", "peak_flops": report["settings"]["peak_flops"],
                                  "cuda_graphs": "auto"}
    assert report["settings"]["peak_flops"] > 0  # the matmul peak the compute floors are taken against


def test_bench_gateway_measures_added_latency_and_streaming_clients(gateway_config):
    result = invoke("bench", "gateway", "--config", str(gateway_config), "--requests", "1", "--clients", "2",
                    "--max-tokens", "2", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    assert report["engine"] == "ar" and report["max_tokens"] == 2 and report["device"] == "cpu"
    assert set(report["latency"]["added_ms"]) >= {"p50", "p99"} and report["latency"]["gateway_ms"]["p50"] > 0
    assert report["concurrency"]["clients"] == 2 and report["concurrency"]["errors"] == 0
    assert 2 <= report["concurrency"]["output_tokens"] <= 4
    assert report["goals"]["zero_errors_met"] is True


def test_bench_load_runs_an_engine_in_process(gateway_config):
    result = invoke("bench", "load", "--engine", "ar", "--config", str(gateway_config), "--max-requests", "1",
                    "--max-tokens", "4", "--kinds", "kyc", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    assert last_json(result.stdout)["target"]["devices"] == {"ar": "cpu"}
    (run,) = last_json(result.stdout)["runs"]
    assert (run["target"], run["kind"], run["successful"], run["errors"]) == ("ar", "ar", 1, 0)
    assert run["engines"] == {"ar": 1} and 0 < run["mean_output_tokens"] <= 4 and run["mean_prompt_tokens"] > 10


def test_demo_serves_its_routes_and_writes_the_report(models, tmp_path):
    """Without a diffusion model the real-time form goes to AR; one form and a one-line batch."""
    result = invoke("demo", "--models", str(models), "--out", str(tmp_path / "out"), "--duration", "1",
                    "--rate", "1", "--batch-size", "1", "--loans", "0", "--compare-every", "0", "--no-live")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["engines"]["diffusion"]["available"] is False
    assert summary["batch"]["status"] == "completed" and summary["batch"]["completed"] == 1
    for route in summary["routes"].values():
        assert route["errors"] == 0 and set(route["engines"]) <= {"ar"}
    assert (tmp_path / "out" / "report.html").stat().st_size > 0
    assert f"report: {tmp_path / 'out' / 'report.html'}" in result.stdout


# --- the installed console script ---


def test_the_project_script_entry_is_the_app_and_is_installed():
    """pyproject's [project.scripts] names nowait.cli's entry, and the installed one is that same entry
    (a stale install would run another)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["nowait"]
    module, attribute = declared.split(":")
    assert getattr(import_module(module), attribute) is import_module("nowait.cli").main
    (installed,) = entry_points(group="console_scripts", name="nowait")
    assert installed.value == declared
    assert SCRIPT.is_file()


def test_the_installed_script_lists_every_command():
    result = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    assert "Usage: nowait" in result.stdout
    for name in {command.split()[0] for command in RUN_HERE | set(RUN_ELSEWHERE)}:
        assert re.search(rf"│ {re.escape(name)}\s", result.stdout), name


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_the_installed_script_serves_the_gateway_and_stops_cleanly(gateway_config):
    """`nowait serve` for real: port 0 (the address is read from uvicorn's log), one completion, then
    SIGINT, as Ctrl-C sends it."""
    server = subprocess.Popen([str(SCRIPT), "serve", "--config", str(gateway_config), "--port", "0"],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(server.stderr, lines), daemon=True).start()
    log: list[str] = []
    try:
        base_url = None
        while base_url is None:
            line = lines.get(timeout=120)  # a bound on a hang, not a speed check
            assert line is not None, "serve exited before listening:\n" + "".join(log)
            log.append(line)
            found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            base_url = found and found.group(1)
        with httpx.Client(base_url=base_url, timeout=60) as client:
            assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {"nowait", "ar"}  # routed, pinned
            reply = client.post("/v1/chat/completions", json={
                "model": "ar", "max_tokens": 2, "messages": [{"role": "user", "content": "Full name: Ada"}]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "chat.completion" and isinstance(body["choices"][0]["message"]["content"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 2 and body["nowait"]["route"] == "ar"
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
