"""`nowait bench load`: a load test in the manner of guidellm, on the extraction corpus.

    nowait bench load --base-url http://127.0.0.1:8000 --model nowait --profile sweep --report out/
    nowait bench load --engine ar,diffusion --profile concurrent --rate 1,2,4,8 --profile-out bench.json
    nowait bench load --base-url http://vllm:8000 --model meta-llama/... --profile poisson --rate 0.5,1,2
    nowait bench load --base-url http://127.0.0.1:8000 --workload batch --max-requests 64
    nowait bench load --workload batch --stores sqlite,postgresql,postgresql:2 --max-requests 64

The target is either any OpenAI-compatible server (`--base-url`: the nowait gateway, vLLM, SGLang,
an external API), owned engines of a gateway config loaded in this process (`--engine`), or, for
the batch workload, gateways the bench starts on each store of `--stores` (bench/load_stores.py). The
figures, their definitions and how to feed the planner are in docs/bench.md. Argument errors,
an unreachable server or an engine that cannot load are one line on stderr and exit code 2.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer

from nowait.bench.load_runner import PROFILES, RunSpec, check_rates
from nowait.bench.load_session import DATA_CLASSES, WORKLOADS, LoadSession, LoadSettings, Progress
from nowait.cli_errors import fail
from nowait.corpus_tiers import TIER_HELP, check_tier


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _rates(text: str | None) -> list[float]:
    rates = []
    for part in _names(text):
        try:
            rates.append(float(part))
        except ValueError:
            fail(f"--rate takes numbers separated by commas (got {part!r})")
    return rates


class BarProgress(Progress):
    """Rich progress bars on stderr, one per run (transient with --json)."""

    def __init__(self, transient: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.console = Console(stderr=True)
        self.bars = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=transient)
        self.task = None

    def __enter__(self) -> BarProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.stop()

    def run_started(self, target: str, spec: RunSpec, total: int | None) -> None:
        self.task = self.bars.add_task(f"{target} {spec.label}", total=total)

    def advance(self, count: int) -> None:
        if self.task is not None:
            self.bars.advance(self.task, count)

    def run_finished(self) -> None:
        if self.task is not None:
            self.bars.stop_task(self.task)
        self.task = None

    def message(self, text: str) -> None:
        self.bars.console.print(text, style="dim", highlight=False)


def settings_from_arguments(**a) -> LoadSettings:
    """Check every argument and build the settings, or fail with one line naming the problem."""
    from nowait.bench.load_http import TargetError, normalize_base_url
    from nowait.bench.load_workload import parse_kinds

    if a["stores"] is not None:
        if a["base_url"] is not None or a["engine"] is not None:
            fail("--stores starts its own gateways on each store: leave out --base-url and --engine")
        if a["workload"] != "batch":
            fail("--stores compares stores on the Batch API: add --workload batch")
        a["base_url"] = "http://127.0.0.1"  # checked as a target below; each run gets its gateway's
    elif a["store"] is not None:
        fail("--store names the PostgreSQL database of --stores")
    if (a["base_url"] is None) == (a["engine"] is None):
        fail("give exactly one target: --base-url URL (an OpenAI-compatible server) or --engine NAME (in process)")
    if a["model"] and a["engine"]:
        fail("--model names models at --base-url; with --engine the engine names are the models")
    if a["config"] is not None and a["base_url"] is not None and a["stores"] is None:
        fail("--config configures in-process engines (--engine); a server at --base-url has its own")
    if a["workload"] not in WORKLOADS:
        fail(f"unknown workload {a['workload']!r}; choose one of: {', '.join(WORKLOADS)}")
    if a["workload"] == "batch" and a["base_url"] is None:
        fail("the batch workload goes through the Batch API (/v1/files, /v1/batches): use --base-url")
    if a["workload"] == "batch" and (a["profile"] is not None or a["rate"] is not None):
        fail("the batch workload submits one batch; --profile and --rate apply to the realtime workload")
    profile = a["profile"] or "synchronous"
    rates = _rates(a["rate"])
    try:
        check_rates(profile, rates)
    except ValueError as error:
        fail(str(error))
    if a["max_requests"] is not None and a["max_requests"] < 1:
        fail(f"--max-requests must be at least 1 (got {a['max_requests']})")
    if a["max_seconds"] is not None and not a["max_seconds"] > 0:
        fail(f"--max-seconds must be greater than 0 (got {a['max_seconds']:g})")
    for flag, value in (("--max-tokens", a["max_tokens"]), ("--max-concurrency", a["max_concurrency"])):
        if value < 1:
            fail(f"{flag} must be at least 1 (got {value})")
    for flag, value in (("--latency-target-ms", a["latency_target_ms"]), ("--request-timeout", a["request_timeout"])):
        if not value > 0:
            fail(f"{flag} must be greater than 0 (got {value:g})")
    if a["token_value"] < 0:
        fail(f"--token-value must be at least 0 (got {a['token_value']:g})")
    if a["data_class"] not in DATA_CLASSES:
        fail(f"unknown data class {a['data_class']!r}; choose one of: {', '.join(DATA_CLASSES)}")
    if a["seed"] is None and a["split"] not in ("validation", "test"):
        fail(f"unknown split {a['split']!r}; choose validation or test (or give --seed)")
    try:
        check_tier(a["tier"])
    except ValueError as error:
        fail(str(error))
    if a["profile_engine"] not in ("ar", "diffusion"):
        fail(f"--profile-engine must be ar or diffusion (got {a['profile_engine']!r})")
    try:
        kinds = parse_kinds(a["kinds"])
        base_url = normalize_base_url(a["base_url"]) if a["base_url"] is not None else None
    except (ValueError, TargetError) as error:
        fail(str(error))
    config = None
    engines = _names(a["engine"])
    if a["engine"] is not None:
        from nowait.gateway.config import ConfigError, default_config, load_config

        if not engines:
            fail("--engine needs at least one engine name")
        try:
            config = load_config(a["config"]) if a["config"] is not None else default_config()
        except ConfigError as error:
            fail(str(error))
        if a["device"] is not None:
            from nowait.checkpoints import check_device

            try:
                check_device(a["device"])
            except ValueError as error:
                fail(str(error))
            config = config.on_device(engines, a["device"])
    elif a["device"] is not None:
        fail("--device applies to --engine (engines run in this process); a server at --base-url runs where it runs")
    system_prefix = ""
    if a["system_prompt_file"] is not None:
        try:
            system_prefix = a["system_prompt_file"].read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            fail(f"--system-prompt-file: cannot read {a['system_prompt_file']}: {error}")
        if not system_prefix:
            fail(f"--system-prompt-file: {a['system_prompt_file']} is empty")
    # Bounds: both apply; without either, a run stops at 50 requests or 60 s.
    max_requests, max_seconds = a["max_requests"], a["max_seconds"]
    if max_requests is None and max_seconds is None:
        max_requests, max_seconds = (50 if a["workload"] == "realtime" else 32), 60.0
    return LoadSettings(
        base_url=base_url, models=_names(a["model"]), engines=engines, config=config, api_key=a["api_key"],
        profile=profile, rates=rates, max_concurrency=a["max_concurrency"], workload=a["workload"], kinds=kinds,
        split=a["split"] if a["seed"] is None else None, seed=a["seed"], tier=a["tier"],
        latency_target_ms=a["latency_target_ms"],
        token_value=a["token_value"], data_class=a["data_class"], max_tokens=a["max_tokens"],
        use_schema=a["schema"], system_prefix=system_prefix, stream=a["stream"], warmup=a["warmup"],
        max_requests=max_requests,
        max_seconds=max_seconds, request_timeout_s=a["request_timeout"])


def load(
    base_url: str = typer.Option(None, "--base-url", help="an OpenAI-compatible server (its root or /v1 URL)"),
    engine: str = typer.Option(None, "--engine", help="owned engine(s) of the gateway config, in process "
                                                      "(comma-separated)"),
    model: str = typer.Option(None, "--model", help="model(s) at --base-url, comma-separated (default: the first "
                                                    "listed by /v1/models; the nowait gateway lists its router first)"),
    config: Path = typer.Option(None, "--config", "-c", help="gateway config for --engine (default: the bundled "
                                                             "demo models)"),
    api_key: str = typer.Option(None, "--api-key", envvar="NOWAIT_API_KEY", help="sent as Authorization: Bearer"),
    profile: str = typer.Option(None, "--profile", help=f"{', '.join(PROFILES)} (default synchronous)"),
    rate: str = typer.Option(None, "--rate", help="concurrent: streams; poisson: requests/s; sweep: number of runs "
                                                  "(comma-separated lists run one after another)"),
    max_concurrency: int = typer.Option(16, help="sweep: streams of its throughput run"),
    workload: str = typer.Option("realtime", help="realtime (single documents with a latency target) or batch "
                                                  "(one Batch API file)"),
    kinds: str = typer.Option(None, help="document kinds, comma-separated (default: kyc, letter_of_credit, "
                                         "loan_application)"),
    split: str = typer.Option("test", help="corpus split (validation or test; ignored with --seed)"),
    seed: int = typer.Option(None, help="a fresh sample of the corpus, never seen in training"),
    tier: str = typer.Option("clean", help=TIER_HELP),
    latency_target_ms: float = typer.Option(1000.0, help="the latency target (goodput) and the request's "
                                                         "x-nowait-latency-budget-ms"),
    token_value: float = typer.Option(0.5, help="x-nowait-token-value, $ per million tokens"),
    data_class: str = typer.Option("restricted", help="x-nowait-data-class"),
    max_tokens: int = typer.Option(256, help="max_tokens per request"),
    system_prompt_file: Path = typer.Option(None, "--system-prompt-file", help="text put before every request's "
                                            "instruction in its system message: your deployment's own system "
                                            "prompt, the shared beginning a prefix cache serves"),
    schema: bool = typer.Option(True, "--schema/--no-schema", help="ask for the kind's JSON Schema "
                                                                   "(response_format)"),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="stream answers (TTFT and ITL need it)"),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="one unrecorded request per target first"),
    max_requests: int = typer.Option(None, help="per run: stop issuing after this many requests (batch: lines)"),
    max_seconds: float = typer.Option(None, help="per run: stop issuing after this many seconds"),
    request_timeout: float = typer.Option(120.0, help="seconds per request"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads for --engine"),
    device: str = typer.Option(None, "--device", help="cpu, cuda or cuda:N: run the --engine engines there "
                                                      "(default: each engine's engines.<name>.device)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    report: Path = typer.Option(None, "--report", help="directory for report.html, load.json and PNG plots"),
    profile_out: Path = typer.Option(None, "--profile-out", help="write the planner profile (nowait plan --profile)"),
    profile_engine: str = typer.Option("ar", help="the engine kind of a server that does not say (vLLM, SGLang)"),
    hardware: str = typer.Option(None, help="what the profile says it was measured on"),
    stores: str = typer.Option(None, "--stores", help="batch workload: gateways started on each store, side by "
                                                      "side: sqlite, postgresql, postgresql:REPLICAS "
                                                      "(comma-separated; --config is their config)"),
    store: str = typer.Option(None, "--store", help="with --stores: the PostgreSQL database to use "
                                                    "(postgresql://...; default: a private server)"),
) -> None:
    """Load-test a server or an engine: TTFT, ITL, e2e p50/p90/p99, tokens/s, goodput, accuracy."""
    arguments = dict(locals())
    settings = settings_from_arguments(**arguments)
    if stores is not None:
        _compare_stores(settings, stores, config, store, as_json)
        return
    from rich.console import Console

    from nowait.bench.load_http import TargetError
    from nowait.bench.load_profile_out import ProfileWriteError, build_profile, write_profile
    from nowait.bench.load_report import print_report, write_html_report

    if threads:
        import torch

        torch.set_num_threads(threads)
    with BarProgress(transient=as_json) as progress:
        session = LoadSession(settings, progress)
        try:
            session.load_engines()
            asyncio.run(session.run())
        except TargetError as error:
            fail(str(error))
    result = session.report()
    profile_error = None
    if profile_out is not None:
        try:
            written, notes = build_profile(session.results, session.kind_of,
                                           model=", ".join(settings.models or settings.engines) or "served model",
                                           hardware=hardware or session.default_hardware(),
                                           default_kind=profile_engine)
            result["profile_out"] = str(write_profile(written, profile_out))
            result["notes"] += notes
        except ProfileWriteError as error:
            profile_error = f"no profile written: {error}"
            result["notes"].append(profile_error)
    if report is not None:
        result["report"] = str(write_html_report(result, report))
    if as_json:
        print(json.dumps(result))
    else:
        console = Console()
        if not console.is_terminal:  # a pipe or a log: keep the wide table whole
            console = Console(width=160)
        print_report(result, console)
        if result.get("profile_out"):
            console.print(f"planner profile: {result['profile_out']} (nowait plan SCENARIO --profile "
                            f"{result['profile_out']})", highlight=False)
        if result.get("report"):
            console.print(f"report: {result['report']}", highlight=False)
    if result["interrupted"]:
        raise typer.Exit(code=130)
    if profile_error is not None:
        fail(profile_error)


def _compare_stores(settings: LoadSettings, stores: str, config: Path | None, store: str | None, as_json: bool) -> None:
    from nowait.bench.load_stores import parse_stores, print_stores_report, run_stores
    from nowait.store.url import StoreError, parse_store_url

    try:
        runs = parse_stores(stores)
        if store is not None and parse_store_url(store).kind != "postgresql":
            fail(f"--store: {store!r} is not a postgresql:// URL")
    except (ValueError, StoreError) as error:
        fail(str(error))
    with BarProgress(transient=as_json) as progress:
        result = run_stores(settings, runs, config, store, progress)
    if as_json:
        print(json.dumps(result))
    else:
        print_stores_report(result)


def register(bench_app: typer.Typer) -> None:
    """Add `load` to the `nowait bench` group."""
    bench_app.command("load")(load)
