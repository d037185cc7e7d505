"""`nowait plan SCENARIO.yaml [--json] [--report DIR] [--profile BENCH.json] [--measure-host] [--check LOAD.json]`.

`register(app)` adds the command to the main Typer app (src/nowait/cli.py calls it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> None:
    """One clear line per problem on stderr and a non-zero exit; no traceback."""
    for line in message.splitlines():
        err_console.print(f"[red]error:[/red] {line}", highlight=False)
    raise typer.Exit(code=2)


def _host_snippet(accelerator) -> str:
    entry = accelerator.model_dump(mode="json")
    return yaml.safe_dump({"accelerators": [entry], "hardware": {"node": "host", "price_usd_per_hour": 0}},
                          sort_keys=False)


def _print_plan(plan) -> None:
    from nowait.planner.report import findings, fmt, money

    for w in plan.workloads:
        table = Table(title=f"{w.workload.name}: route {w.decision.engine}", title_justify="left")
        for column in ("engine", "single stream tok/s", "batch", "tok/s per node", "nodes", "p99 s", "utilization",
                       "$ / Mtok"):
            table.add_column(column, justify="left" if column == "engine" else "right")
        for name, e in w.engines.items():
            table.add_row(name, fmt(e.single_stream_tokens_per_s), str(e.batch),
                          fmt(e.tokens_per_s_per_node), str(e.nodes) if e.feasible else "infeasible",
                          fmt(e.p99_latency_s) if e.feasible else f">= {fmt(e.min_p99_target_s)}",
                          f"{e.utilization:.0%}" if e.utilization is not None else "-", money(e.cost_per_mtok_usd))
        console.print(table)
        console.print(f"why: {w.decision.reason}", style="dim", highlight=False)
        for quote in w.apis:
            allowed = "" if quote.allowed else f" (may not receive {w.workload.data_class.value} data)"
            console.print(f"API {quote.name}: {money(quote.usd_per_mtok)} / Mtok for these requests{allowed}",
                          style="dim", highlight=False)
        console.print()
    for line in findings(plan):
        console.print(f"- {line.replace('**', '')}", highlight=False)


def _print_check(check) -> None:
    """One row per engine and figure: predicted, measured, relative error; a flag past the tolerance."""
    table = Table(title=f"batch-1 latency: planner vs load test (tolerance {check.tolerance:.0%})",
                  title_justify="left")
    for column in ("engine", "basis", "in/out tok", "figure", "predicted ms", "p50 ms", "error", ""):
        table.add_column(column, justify="left" if column in ("engine", "basis", "figure", "") else "right",
                         no_wrap=True)
    for e in check.engines:
        run = e.run
        name = run.engine if run.target == run.engine else f"{run.engine} ({run.target})"
        for index, c in enumerate(e.comparisons):
            first = index == 0
            table.add_row(name if first else "", e.basis if first else "",
                          f"{run.prompt_tokens:.0f}/{run.output_tokens:.0f}" if first else "", c.metric,
                          f"{c.predicted_s * 1000:.1f}", f"{c.measured_s * 1000:.1f}", f"{c.relative_error:+.0%}",
                          "[red]OFF[/red]" if c.flagged else "ok")
    console.print(table)
    for note in check.notes:
        console.print(f"note: {note}", style="dim", highlight=False)
    verdict = "within" if check.passed else "NOT within"
    console.print(f"predicted batch-1 e2e latency {verdict} {check.tolerance:.0%} of the measured one "
                  f"for every engine checked", highlight=False)


def _print_throughput(rows, notes) -> None:
    table = Table(title="output tokens/s: the planner beside the load test's concurrent runs")
    for column in ("target", "engine", "streams", "replicas", "batch/replica", "predicted", "measured", "error"):
        table.add_column(column, justify="left" if column in ("target", "engine") else "right")
    for r in rows:
        table.add_row(r.target, r.engine, str(r.streams), str(r.replicas), str(r.batch),
                      f"{r.predicted_tokens_per_s:.1f}", f"{r.measured_tokens_per_s:.1f}", f"{r.relative_error:+.0%}")
    console.print(table)
    for note in notes:
        console.print(f"note: {note}", highlight=False)


def _run_check(loaded, measured, scenario: Path, profile: Path | None, load: Path, as_json: bool,
               replicas: int = 1) -> None:
    """--check: the planner's batch-1 latency per engine against a load test (exit 1 past the
    tolerance), and its tokens/s beside each concurrent run (not judged: docs/fleet.md)."""
    from nowait.planner.calibration import CalibrationError, check_latency, load_measurements, measured_runs, to_json
    from nowait.planner.fleets import build_fleets
    from nowait.planner.profile import fit_profile
    from nowait.planner.throughput import check_throughput
    from nowait.planner.throughput import to_json as throughput_json

    try:
        data = load_measurements(load)
        runs, notes = measured_runs(data)
    except CalibrationError as error:
        _fail(str(error))
    fitted = fit_profile(measured) if measured is not None else {}
    fleets = build_fleets(loaded, fitted, measured)
    rows, throughput_notes = check_throughput(fleets, data, replicas)
    if not runs and not rows:
        _fail(f"{load}: no synchronous run of an AR or diffusion engine to check against (bench load --profile "
              "synchronous, or sweep, with --engine ar,diffusion or --model ar,diffusion), nor a concurrent one"
              + "".join(f"\n{note}" for note in notes + throughput_notes))
    check = check_latency({name: fleet.make(1) for name, fleet in fleets.items()}, runs, set(fitted))
    check.notes[:0] = notes
    if as_json:
        print(json.dumps({**to_json(check, str(scenario), str(profile) if profile else None, str(load)),
                          "throughput": throughput_json(rows)}))
    else:
        if runs:
            _print_check(check)
        if rows or throughput_notes:
            _print_throughput(rows, throughput_notes)
    if runs and not check.passed:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    """Add the `plan` command to `app`."""

    @app.command("plan")
    def plan_command(
        scenario: Path = typer.Argument(None, help="scenario YAML (see examples/bank.yaml and docs/planner.md)"),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object with a `workloads` list"),
        report: Path = typer.Option(None, "--report", help="write DIR/<scenario>-report.md and its PNG plots"),
        profile: Path = typer.Option(None, "--profile", help="measured step times (format in docs/planner.md)"),
        measure_host: bool = typer.Option(False, "--measure-host",
                                          help="measure this machine (a few seconds); usable as node 'host'"),
        measure_seconds: float = typer.Option(3.0, "--measure-seconds", min=0.2, help="time budget of --measure-host"),
        check: Path = typer.Option(None, "--check", help="a `bench load --json` output: compare each engine's "
                                                         "predicted batch-1 latency with its synchronous run"),
        fleet_out: Path = typer.Option(None, "--fleet-out", help="write the engines' fleet sections (replicas, GPUs, "
                                                                 "target ongoing requests) for `nowait fleet up`"),
        replicas: int = typer.Option(1, "--replicas", min=1, help="with --check: the replicas behind the load "
                                                                  "test's target (a fleet's), for its tokens/s"),
    ) -> None:
        """Plan the fleet: per workload the route, and per engine nodes, p99, utilization and cost per Mtok."""
        from nowait.planner.hardware import measure_host as measure
        from nowait.planner.plan import make_plan, to_json
        from nowait.planner.profile import ProfileError, load_profile
        from nowait.planner.scenario import ScenarioError, load_scenario

        if scenario is None and not measure_host:
            _fail("give a scenario file (e.g. examples/bank.yaml), or --measure-host")
        if check is not None and (scenario is None or report is not None):
            _fail("--check compares a scenario's engines with a load test: give the scenario, and no --report")
        host = None
        if measure_host:
            started = time.perf_counter()
            host = measure(budget_s=max(0.2, min(measure_seconds, 10.0)))
            took = time.perf_counter() - started
            if scenario is None:
                if as_json:
                    print(json.dumps(host.model_dump(mode="json")))
                else:
                    peaks = ", ".join(f"{v:g} TFLOP/s {k}" for k, v in host.peak_tflops.items())
                    read = f", {host.read_bandwidth_tb_s * 1000:.1f} GB/s read" if host.read_bandwidth_tb_s else ""
                    console.print(f"host: {peaks}; {host.memory_bandwidth_tb_s * 1000:.1f} GB/s memory bandwidth "
                                  f"(copy){read}; {host.memory_gb:g} GB (measured in {took:.1f} s)", highlight=False)
                    for dtype, curve in (host.gemm_efficiency or {}).items():
                        widths = ", ".join(f"{rows}: {share:.0%}" for rows, share in curve.items())
                        console.print(f"{dtype} matmul efficiency by rows: {widths}", highlight=False)
                    console.print("Plan on it with `nowait plan SCENARIO.yaml --measure-host` and "
                                  "`hardware: {node: host, price_usd_per_hour: 0}`, or paste into the scenario:",
                                  highlight=False)
                    console.print(_host_snippet(host), highlight=False, markup=False)
                return
            err_console.print(f"measured host in {took:.1f} s: {host.peak_tflops} TFLOP/s, "
                              f"{host.memory_bandwidth_tb_s * 1000:.1f} GB/s", highlight=False)
        try:
            loaded = load_scenario(scenario, host=host)
            measured = load_profile(profile) if profile is not None else None
            if check is not None:
                _run_check(loaded, measured, scenario, profile, check, as_json, replicas)
                return
            plan = make_plan(loaded, measured)
        except (ScenarioError, ProfileError) as error:
            _fail(str(error))
        if report is not None:
            from nowait.planner.report import write_report

            command = f"nowait plan {scenario} --report {report}" + (f" --profile {profile}" if profile else "")
            path = write_report(plan, report, command)
            if not as_json:
                console.print(f"report: {path}", highlight=False)
        if fleet_out is not None:
            from nowait.planner.fleet_out import fleet_config

            config, header = fleet_config(plan, f"nowait plan {scenario} --fleet-out {fleet_out}")
            fleet_out.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
            if not as_json:
                console.print(f"fleet: {fleet_out}", highlight=False)
        if as_json:
            print(json.dumps(to_json(plan)))
            return
        _print_plan(plan)
