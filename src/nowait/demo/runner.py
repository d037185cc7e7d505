"""One demo run, start to finish: serve, replay, show, summarize, report.

1. serve the demo config in process (models load before the clock starts);
2. replay the plan through the HTTP API while the live view refreshes;
3. stop the gateway (its audit log is then complete), total the ledger per engine;
4. print the summary, write the report, and judge the run: every request answered without an
   error and the batch completed is a success (exit 0); anything else is listed (exit 1);
   Ctrl-C still writes the report of what ran (exit 130).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live

from nowait.bench.load_session import stop_on_interrupt
from nowait.demo.config import client_api_key, demo_config, node_prices
from nowait.demo.economics import engine_totals
from nowait.demo.plan import DemoPlan, schedule
from nowait.demo.report import write_report
from nowait.demo.scoreboard import Scoreboard
from nowait.demo.server import InProcessGateway, free_port
from nowait.demo.traffic import DemoTraffic
from nowait.demo.view import live_view, status_line, summary_view

STATUS_EVERY_S = 10.0


class DemoError(RuntimeError):
    """The demo cannot run at all (no batch engine, the gateway would not start): one line."""


@dataclass
class DemoSettings:
    plan: DemoPlan
    out_dir: Path
    config_file: Path | None = None
    models_dir: Path | None = None
    threads: int | None = None
    live: bool = True
    drain_s: float = 40.0


@dataclass
class DemoResult:
    exit_code: int
    report: Path | None
    verdict: list[str]
    summary_board: Scoreboard


def judge(board: Scoreboard, interrupted: bool) -> list[str]:
    """What went wrong, one line each; a single 'ok' line when nothing did."""
    problems = []
    if interrupted:
        problems.append("stopped early (Ctrl-C): the report covers what ran")
    for stats in board.all_stats():
        if stats.errors:
            problems.append(f"{stats.errors} error(s) on route {stats.route}")
    batch = board.batch
    if batch.lines and (batch.status != "completed" or batch.failed or batch.completed < batch.lines):
        problems.append(f"the batch did not complete: {batch.status}, {batch.completed}/{batch.lines} lines answered"
                        + (f" ({batch.error})" if batch.error else ""))
    if not problems:
        total = sum(s.answered for s in board.all_stats())
        if not total and not batch.lines:
            return ["ok, but nothing was sent: every rate and size was 0"]
        return [f"ok: {total} requests answered with zero errors"
                + ("; the batch completed" if batch.lines else "; no batch was submitted")]
    return problems


async def _drive(traffic: DemoTraffic, board: Scoreboard, plan: DemoPlan, console: Console, live: bool) -> bool:
    """Run the traffic under the live view (or periodic status lines); True if Ctrl-C stopped it."""
    stop = asyncio.Event()

    def stopping() -> None:
        board.phase = "stopping (Ctrl-C): finishing up, the report will still be written"

    with stop_on_interrupt(stop, stopping):
        runner = asyncio.ensure_future(traffic.run(stop))
        if live:
            with Live(live_view(board, plan), console=console, refresh_per_second=4, transient=True) as screen:
                while not runner.done():
                    traffic.tick()
                    screen.update(live_view(board, plan))
                    await asyncio.wait({runner}, timeout=0.25)
        else:
            last = time.perf_counter()
            while not runner.done():
                traffic.tick()
                await asyncio.wait({runner}, timeout=0.25)
                if time.perf_counter() - last >= STATUS_EVERY_S:
                    console.print(status_line(board, plan), highlight=False)
                    last = time.perf_counter()
        await runner
    return stop.is_set()


def _check_ready(gateway: InProcessGateway, batch_engine: str) -> None:
    ready = httpx.get(f"{gateway.root_url}/readyz", timeout=10.0, trust_env=False).json()
    engine = (ready.get("engines") or {}).get(batch_engine) or {}
    if not engine.get("available"):
        raise DemoError(f"the batch engine {batch_engine!r} is not available: "
                        f"{engine.get('reason') or 'not configured'}; the demo needs it")


def run_demo(settings: DemoSettings, console: Console | None = None) -> DemoResult:
    console = console or Console()
    if not console.is_terminal:  # a pipe or a log: no terminal width to respect, keep tables whole
        console = Console(width=150)
    plan = settings.plan
    out_dir = Path(settings.out_dir)
    data_dir = out_dir / "gateway-data"
    if data_dir.exists():  # our own scratch from an earlier run: never resume its batches
        shutil.rmtree(data_dir)
    config = demo_config(settings.config_file, settings.models_dir, data_dir, free_port(), settings.threads)
    api_key = client_api_key(config)
    router_model, batch_engine = config.server.router_model, config.routing.batch_engine
    arrivals, batch = schedule(plan, router_model, batch_engine)
    board = Scoreboard()
    with console.status("starting the gateway (loading the demo models) ..."):
        try:
            gateway = InProcessGateway(config).start()
        except RuntimeError as error:
            raise DemoError(str(error)) from None
    try:
        _check_ready(gateway, batch_engine)
        traffic = DemoTraffic(gateway.root_url, gateway.base_url, api_key, plan, arrivals, batch, router_model,
                              board, settings.drain_s)
        interrupted = asyncio.run(_drive(traffic, board, plan, console, settings.live and console.is_terminal))
    finally:
        gateway.stop()  # closes the audit log: the ledger is complete from here on
    from nowait.gateway.ledger import read_audit_log

    totals = engine_totals(read_audit_log(config.audit_log_path), node_prices(config), board.elapsed_s)
    verdict = judge(board, interrupted)
    report = write_report(board, totals, plan, verdict, interrupted, out_dir)
    console.print(summary_view(board, totals, verdict, str(report)))
    ok = verdict[0].startswith("ok")
    return DemoResult(exit_code=130 if interrupted else 0 if ok else 1, report=report, verdict=verdict,
                      summary_board=board)
