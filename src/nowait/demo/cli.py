"""`nowait demo`: the command; the work is in `nowait.demo.runner`."""

from __future__ import annotations

from pathlib import Path

import typer

from nowait.cli_errors import fail


def demo(
    duration: float = typer.Option(60.0, help="seconds of traffic (answers still in flight get up to 40 s more)"),
    rate: float = typer.Option(1.5, help="real-time KYC arrivals per second (Poisson)"),
    batch_size: int = typer.Option(None, help="letters of credit in the overnight batch (default: one per 2 s "
                                              "of --duration, at least 4)"),
    loans: int = typer.Option(4, help="high-value loan decisions, spread over the run"),
    compare_every: int = typer.Option(3, help="every k-th real-time form is also sent pinned to AR, to show what "
                                              "the real-time route would cost there (0: never)"),
    latency_budget_ms: float = typer.Option(1000.0, help="the real-time requests' latency budget"),
    seed: int = typer.Option(2024, help="the held-out document stream (a fresh corpus seed)"),
    hard_fraction: float = typer.Option(0.3, help="share of the real-time forms from the corpus's hard tier "
                                                  "(scanned noise, other layouts, packets, amendments), in [0, 1]"),
    config: Path = typer.Option(None, "--config", "-c", help="a gateway config to serve instead of the demo's"),
    models: Path = typer.Option(None, "--models", help="a directory with ar/, draft/ and diffusion/ checkpoints "
                                                       "instead of the bundled models"),
    out: Path = typer.Option(Path("nowait-demo"), "--out", help="where the report goes"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads for the engines"),
    live: bool = typer.Option(True, "--live/--no-live", help="the live view (off: a status line every 10 s)"),
) -> None:
    """Serve the demo models and replay a mixed workload through the gateway: the routing rule at work.

    Real-time KYC extractions (Poisson, with a latency budget) go to the fast engine, an overnight
    batch of letters of credit goes through the Batch API to AR, and a few high-value loan
    decisions go to the frontier engine. A live view shows each route's latency, accuracy and
    fallbacks and each engine's utilization and cost per million tokens; an HTML report follows."""
    from nowait.demo.plan import DemoPlan
    from nowait.demo.runner import DemoError, DemoSettings, run_demo
    from nowait.gateway.config import ConfigError

    if not duration > 0:
        fail(f"--duration must be greater than 0 (got {duration:g})")
    if rate < 0:
        fail(f"--rate must be at least 0 (got {rate:g})")
    for flag, value in (("--batch-size", batch_size), ("--loans", loans), ("--compare-every", compare_every)):
        if value is not None and value < 0:
            fail(f"{flag} must be at least 0 (got {value})")
    if not latency_budget_ms > 0:
        fail(f"--latency-budget-ms must be greater than 0 (got {latency_budget_ms:g})")
    if not 0 <= hard_fraction <= 1:
        fail(f"--hard-fraction must be in [0, 1] (got {hard_fraction:g})")
    if config is not None and models is not None:
        fail("give --config or --models, not both (a config names its own models)")
    if models is not None and not models.is_dir():
        fail(f"--models {models}: no such directory")
    plan = DemoPlan(duration_s=duration, realtime_rate=rate, compare_every=compare_every, batch_size=batch_size,
                    loans=loans, latency_budget_ms=latency_budget_ms, seed=seed, hard_fraction=hard_fraction)
    settings = DemoSettings(plan=plan, out_dir=out, config_file=config, models_dir=models, threads=threads, live=live)
    try:
        result = run_demo(settings)
    except (ConfigError, DemoError) as error:
        fail(str(error))
    if result.exit_code:
        raise typer.Exit(code=result.exit_code)


def register(app: typer.Typer) -> None:
    """Add `demo` to the nowait CLI."""
    app.command("demo")(demo)
