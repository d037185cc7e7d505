"""`nowait bench soak`: a gateway under mixed traffic for minutes, watched for leaks.

    nowait bench soak --minutes 10 --json
    nowait bench soak --minutes 60 --config nowait.yaml --concurrency 8

The gateway runs as its own process (`python -m nowait.gateway`, the config given or the bundled
demo models, on a free loopback port, its data in a temporary directory), so what is sampled is
the server alone: every `--sample-interval` seconds its resident memory, open file descriptors
and threads (/proc), the size of its store and the requests queued in its engines (/readyz).
The traffic is soak_traffic.py's; the trend and the batch-line tally soak_probe.py's.

Printed: per series its first, middle and last value, its trend per hour over the second half
and whether it levels off; the 5xx count; batch lines lost and duplicated. `--json` prints one
object with `rss_growth_pct` (growth over the second half), `server_errors`, `lines_lost`,
`lines_duplicated` and `samples`, and the rest. Goal (issue 22), over 10 minutes: RSS growth
<= 5%, 0 server errors, 0 lines lost or duplicated. Nothing is asserted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
import yaml

from nowait.bench.gateway import _free_port
from nowait.bench.soak_probe import METRICS, Sample, data_bytes, queued, read_process, tally, trend
from nowait.cli_errors import fail

SOAK_API_KEY = "nowait-soak-key"
APPEND_ONLY = {"audit_bytes": " (append-only by design: one entry a request)",
               "store_bytes": " (batch records are kept, as OpenAI keeps them; their files are deleted)"}
RSS_GROWTH_GOAL_PCT = 5.0
STOP_GRACE_S = 60.0


def soak_config(config_path: Path | None, data_dir: Path, port: int) -> dict:
    """The config to soak, its store, keys database and audit log moved into `data_dir`, with a
    key of the soak's own (an open server would do, but a keyed one is what runs in production)."""
    from nowait.gateway.config import ConfigError, default_config, load_config

    try:
        config = load_config(config_path) if config_path is not None else default_config()
    except ConfigError as error:
        fail(str(error))
    auth = config.auth.model_copy(update={"api_keys": [*config.auth.api_keys, SOAK_API_KEY], "database": None})
    server = config.server.model_copy(update={"host": "127.0.0.1", "port": port})
    config = config.model_copy(update={"server": server, "auth": auth, "data_dir": data_dir, "audit_log": None,
                                       "batches": config.batches.model_copy(update={"database": None})})
    return config.model_dump(mode="json")


class GatewayProcess:
    """`python -m nowait.gateway` on loopback, its output in a log file."""

    def __init__(self, config: dict, work: Path) -> None:
        self.port = config["server"]["port"]
        self.config_path = work / "nowait.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = work / "gateway.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "nowait.gateway", "--config", str(self.config_path),
                                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def wait_ready(client, gateway: GatewayProcess, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            fail(f"the gateway exited with status {gateway.process.returncode}:\n{gateway.log_tail()}")
        try:
            if (await client.get(f"http://127.0.0.1:{gateway.port}/readyz", timeout=5.0)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    fail(f"the gateway was not ready after {timeout_s:g} s:\n{gateway.log_tail()}")


async def sample_loop(client, gateway: GatewayProcess, data_dir: Path, interval_s: float, t0: float,
                      stop: asyncio.Event, samples: list[Sample]) -> None:
    async def one() -> None:
        rss, fds, threads = read_process(gateway.process.pid)
        try:
            readyz = (await client.get(f"http://127.0.0.1:{gateway.port}/readyz", timeout=30.0)).json()
        except Exception:  # an unanswered probe is a sample without queue lengths, not the end of the run
            readyz = {}
        samples.append(Sample(round(time.perf_counter() - t0, 3), rss, fds, threads, *data_bytes(data_dir),
                              queued(readyz)))

    await one()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        await one()


async def run_soak(gateway: GatewayProcess, data_dir: Path, minutes: float, interval_s: float, concurrency: int,
                   model: str, max_tokens: int, batch_lines: int, startup_timeout_s: float) -> dict:
    import httpx

    from nowait.bench.soak_traffic import Traffic

    headers = {"Authorization": f"Bearer {SOAK_API_KEY}"}
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        await wait_ready(client, gateway, startup_timeout_s)
        traffic = Traffic(client, gateway.base_url, model, max_tokens)
        stop = asyncio.Event()
        samples: list[Sample] = []
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_loop(client, gateway, data_dir, interval_s, t0, stop, samples))
        load = [asyncio.create_task(traffic.worker(seed, stop)) for seed in range(concurrency)]
        load.append(asyncio.create_task(traffic.batch_loop(stop, batch_lines)))
        await asyncio.sleep(minutes * 60)
        stop.set()
        await sampler  # the last sample is taken as the traffic stops, not after it drains
        await asyncio.gather(*load)
    lost, duplicated = tally(traffic.batches.accepted, traffic.batches.answered)
    # The soak itself never has more requests in flight than its workers and one batch's lines:
    # a queue that moves within that is the traffic, not entries left behind.
    floors = {"queued": concurrency + batch_lines}
    trends = {metric: trend(samples, metric, floors.get(metric)) for metric in METRICS}
    return {"minutes": minutes, "sample_interval_s": interval_s, "concurrency": concurrency, "model": model,
            "rss_growth_pct": trends["rss_bytes"]["second_half_growth_pct"],
            "server_errors": traffic.counts.server_errors, "transport_errors": traffic.counts.transport_errors,
            "lines_lost": lost, "lines_duplicated": duplicated,
            "batch_lines": sum(len(ids) for ids in traffic.batches.accepted.values()),
            "batches": len(traffic.batches.accepted), "batches_cancelled": traffic.batches.cancelled,
            "batches_cancelled_unvalidated": traffic.batches.unvalidated,
            "requests": traffic.counts.by_kind(), "trends": trends,
            "samples": [s.as_dict() for s in samples]}


def print_report(report: dict) -> None:
    mib = {"rss_bytes", "store_bytes", "audit_bytes"}

    def shown(metric: str, value: float) -> str:
        return f"{value / 2**20:.1f} MiB" if metric in mib else f"{value:g}"

    typer.echo(f"soak: {report['minutes']:g} min, {len(report['samples'])} samples every "
               f"{report['sample_interval_s']:g} s, {report['concurrency']} clients on model {report['model']!r}")
    typer.echo(f"{'series':<12} {'first':>11} {'middle':>11} {'last':>11} {'per hour (2nd half)':>20}  levels off")
    for metric, t in report["trends"].items():
        typer.echo(f"{metric:<12} {shown(metric, t['first']):>11} {shown(metric, t['middle']):>11} "
                   f"{shown(metric, t['last']):>11} {shown(metric, t['per_hour']):>20}  "
                   f"{'yes' if t['levels_off'] else 'NO'}{APPEND_ONLY.get(metric, '')}")
    total = sum(n for statuses in report["requests"].values() for n in statuses.values())
    typer.echo(f"requests: {total} ({', '.join(f'{k} {v}' for k, v in report['requests'].items())})")
    typer.echo(f"RSS growth over the second half: {report['rss_growth_pct']:.2f}% (goal <= {RSS_GROWTH_GOAL_PCT:g}%)")
    typer.echo(f"server errors (5xx): {report['server_errors']}  transport errors: {report['transport_errors']}")
    typer.echo(f"batch lines: {report['batch_lines']} in {report['batches']} batches "
               f"({report['batches_cancelled']} cancelled, {report['batches_cancelled_unvalidated']} of them before "
               f"validation, so with no lines accepted): lost {report['lines_lost']}, "
               f"duplicated {report['lines_duplicated']}")


def soak(
    minutes: float = typer.Option(..., min=0.01, help="how long the traffic runs"),
    json_output: bool = typer.Option(False, "--json", help="print one JSON object instead of the table"),
    config: Path = typer.Option(None, "--config", "-c", help="nowait.yaml (default: the bundled demo models)"),
    sample_interval: float = typer.Option(10.0, min=0.1, help="seconds between samples of the server"),
    concurrency: int = typer.Option(4, min=1, help="request workers at once (besides the batch loop)"),
    model: str = typer.Option("nowait", help="the model the traffic asks for (the router by default)"),
    max_tokens: int = typer.Option(16, min=1, help="max_tokens of every request"),
    batch_lines: int = typer.Option(4, min=1, help="lines per batch"),
    startup_timeout: float = typer.Option(600.0, min=1, help="seconds the gateway may take to load its engines"),
) -> None:
    """Mixed traffic against a gateway process; RSS, fds, threads, store and queues sampled for leaks."""
    if sys.platform != "linux" or not Path(f"/proc/{os.getpid()}/status").exists():
        fail("bench soak samples the server through /proc, which this system does not have")
    with tempfile.TemporaryDirectory(prefix="nowait-soak-") as work:
        data_dir = Path(work) / "data"
        gateway = GatewayProcess(soak_config(config, data_dir, _free_port()), Path(work))
        gateway.start()
        try:
            report = asyncio.run(run_soak(gateway, data_dir, minutes, sample_interval, concurrency, model,
                                          max_tokens, batch_lines, startup_timeout))
        finally:
            gateway.stop()
    if json_output:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report)


def register(app: typer.Typer) -> None:
    app.command("soak")(soak)
