"""One `bench load` session: targets set up, profiles run, results gathered into the report dict.

The command (`bench/load.py`) checks the arguments and prints; this module does the work:

1. targets: models at an OpenAI-compatible base URL (probed first), or owned engines of a
   gateway config loaded in process;
2. per target, one warm-up request (not recorded: a first request pays for lazy set-up such as
   compiling a schema's grammar), then the profile's runs in order (a sweep measures its
   synchronous and throughput runs first and places its Poisson rates between them);
3. the batch workload instead submits one Batch API file per model and polls it to the end.

Ctrl-C sets `stop`: the current run ends at once, nothing new starts, and what finished is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from nowait.bench.load_http import (
    BatchClient,
    ServerInfo,
    TargetError,
    auth_headers,
    complete_chat,
    probe,
    record_from_body,
    stream_chat,
)
from nowait.bench.load_inprocess import InProcessEngine
from nowait.bench.load_metrics import RequestRecord, summarize_run
from nowait.bench.load_runner import Bounds, RunResult, RunSpec, Target, execute, fixed_specs, sweep_rates
from nowait.bench.load_workload import LoadRequest, RoutingMetadata, corpus_documents, request_stream
from nowait.extraction.corpus import Document

WORKLOADS = ("realtime", "batch")
DATA_CLASSES = ("public", "internal", "restricted")


@dataclass
class LoadSettings:
    """Everything a session needs, already checked by the command."""

    base_url: str | None = None
    models: list[str] = field(default_factory=list)  # at base_url; empty: the first listed
    engines: list[str] = field(default_factory=list)  # in process
    config: object | None = None  # GatewayConfig for --engine
    api_key: str | None = None
    profile: str = "synchronous"
    rates: list[float] = field(default_factory=list)
    max_concurrency: int = 16
    workload: str = "realtime"
    kinds: tuple[str, ...] = ()
    split: str | None = "test"
    seed: int | None = None
    tier: str = "clean"  # corpus tier (nowait.corpus_tiers)
    latency_target_ms: float = 1000.0
    token_value: float = 0.5
    data_class: str = "restricted"
    max_tokens: int = 256
    use_schema: bool = True
    system_prefix: str = ""  # before every request's instruction (--system-prompt-file)
    stream: bool = True
    warmup: bool = True
    max_requests: int | None = 50
    max_seconds: float | None = 60.0
    request_timeout_s: float = 120.0
    batch_poll_s: float = 0.5


class HttpModel:
    """A model at an OpenAI-compatible base URL, as a load target."""

    def __init__(self, client: httpx.AsyncClient, info: ServerInfo, model: str, timeout_s: float,
                 stream: bool) -> None:
        self.client, self.info, self.name = client, info, model
        self.kind = info.models.get(model)
        self.timeout_s, self.stream = timeout_s, stream

    async def send(self, request: LoadRequest, t0: float) -> RequestRecord:
        chat = stream_chat if self.stream else complete_chat
        return await chat(self.client, self.info.base_url, request, self.name, t0, self.timeout_s)


class EngineModel:
    """An owned engine in process, as a load target."""

    def __init__(self, engine: InProcessEngine, timeout_s: float, stream: bool) -> None:
        self.engine, self.name, self.kind = engine, engine.name, engine.kind
        self.timeout_s, self.stream = timeout_s, stream

    async def send(self, request: LoadRequest, t0: float) -> RequestRecord:
        return await self.engine.request(request, t0, self.timeout_s, self.stream)


@contextlib.contextmanager
def stop_on_interrupt(stop: asyncio.Event, on_stop: Callable[[], None] | None = None) -> Iterator[None]:
    """The first Ctrl-C sets `stop` (finish cleanly, keep what was measured); a second one is
    the usual KeyboardInterrupt. Only in the main thread, where signals are delivered."""
    loop = asyncio.get_running_loop()
    installed = False

    def interrupted() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)
        if on_stop is not None:
            on_stop()

    try:
        loop.add_signal_handler(signal.SIGINT, interrupted)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass
    try:
        yield
    finally:
        if installed:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGINT)


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class Progress:
    """What a session reports while it runs (the command draws bars; tests pass nothing)."""

    def run_started(self, target: str, spec: RunSpec, total: int | None) -> None: ...

    def record(self, record: RequestRecord) -> None:
        self.advance(1)

    def advance(self, count: int) -> None: ...

    def run_finished(self) -> None: ...

    def message(self, text: str) -> None: ...


class LoadSession:
    def __init__(self, settings: LoadSettings, progress: Progress | None = None) -> None:
        self.s = settings
        self.progress = progress or Progress()
        self.stop = asyncio.Event()
        self.results: list[RunResult] = []
        self.kinds: dict[str, str | None] = {}
        self.batch: dict | None = None
        self.notes: list[str] = []
        self.in_process: list[InProcessEngine] = []

    # --- set-up ---

    def load_engines(self) -> None:
        """Load in-process engines before the event loop starts (blocking, seconds)."""
        for name in self.s.engines:
            engine = InProcessEngine(self.s.config, name)
            self.progress.message(f"loading engine {name} ...")
            engine.load()
            self.in_process.append(engine)
            self.kinds[name] = engine.kind

    def metadata(self) -> RoutingMetadata:
        return RoutingMetadata(latency_budget_ms=self.s.latency_target_ms, token_value_usd_per_mtok=self.s.token_value,
                               data_class=self.s.data_class, batchable=False)

    def documents(self) -> list[Document]:
        count = self.s.max_requests or 200
        return corpus_documents(min(max(count, 1), 500), self.s.kinds, self.s.split, self.s.seed, self.s.tier)

    # --- running ---

    def _requests(self, docs: list) -> Iterator[LoadRequest]:
        return request_stream(docs, self.s.max_tokens, self.s.use_schema, self.metadata(), self.s.system_prefix)

    async def _runs(self, target: Target) -> None:
        docs = self.documents()
        requests = self._requests(docs)
        bounds = Bounds(self.s.max_requests, self.s.max_seconds)
        if self.s.warmup and not self.stop.is_set():
            self.progress.message(f"warming up {target.name} ...")
            await target.send(next(self._requests(docs)), time.perf_counter())
        if self.s.profile == "sweep":
            points = int(self.s.rates[0]) if self.s.rates else 5
            first = [RunSpec("synchronous", stage="synchronous"),
                     RunSpec("concurrent", float(self.s.max_concurrency), stage="throughput")]
            measured = [await self._run(target, spec, requests, bounds) for spec in first if not self.stop.is_set()]
            if len(measured) < 2:
                return
            rates = sweep_rates(measured[0].summary.requests_per_s, measured[1].summary.requests_per_s, points)
            specs = [RunSpec("poisson", rate, stage="rate") for rate in rates]
        else:
            specs = fixed_specs(self.s.profile, self.s.rates)
        for index, spec in enumerate(specs):
            if self.stop.is_set():
                break
            await self._run(target, spec, requests, bounds, seed=index)

    async def _run(self, target: Target, spec: RunSpec, requests: Iterator[LoadRequest], bounds: Bounds,
                   seed: int = 0) -> RunResult:
        self.progress.run_started(target.name, spec, bounds.max_requests)
        try:
            result = await execute(target, spec, requests, bounds, self.stop, self.progress.record, seed)
        finally:
            self.progress.run_finished()
        self.results.append(result)
        return result

    async def _batch(self, client: httpx.AsyncClient, base_url: str, model: str) -> None:
        count = self.s.max_requests or 32
        docs = corpus_documents(count, self.s.kinds, self.s.split, self.s.seed, self.s.tier)
        requests = {f"doc-{i}": LoadRequest(doc, self.s.max_tokens, self.s.use_schema,
                                            system_prefix=self.s.system_prefix) for i, doc in enumerate(docs)}
        batches = BatchClient(client, base_url)
        spec = RunSpec("concurrent", float(len(requests)), stage="batch")
        self.progress.run_started(model, spec, len(requests))
        t0 = time.perf_counter()
        try:
            created = await batches.submit([r.batch_line(cid, model) for cid, r in requests.items()],
                                           metadata={"source": "nowait bench load"})
            done_lines = 0

            def polled(batch: dict) -> None:
                nonlocal done_lines
                counts = batch.get("request_counts") or {}
                finished = int(counts.get("completed") or 0) + int(counts.get("failed") or 0)
                if finished > done_lines:
                    self.progress.advance(finished - done_lines)
                    done_lines = finished

            deadline = t0 + (self.s.max_seconds if self.s.max_seconds is not None else 24 * 3600)
            batch = await batches.wait(created["id"], deadline, self.s.batch_poll_s, self.stop, polled)
            wall = time.perf_counter() - t0
            answers = await batches.results(batch)
        finally:
            self.progress.run_finished()
        records = []
        for custom_id, request in requests.items():
            status, body, error = answers.get(custom_id, (0, None, "never answered"))
            records.append(record_from_body(request, model, 0.0, wall, status, body, error=error))
        summary = summarize_run(records, duration_s=wall)
        # Lines of a batch have no timings of their own: only the batch's wall time means anything.
        per_line = ("ttft_ms", "itl_ms", "e2e_ms", "goodput", "mean_concurrency")
        self.batch = {"batch_id": batch["id"], "model": model, "status": batch["status"],
                      **{k: v for k, v in summary.as_dict().items() if k not in per_line}}
        self.batch["cost_usd"] = sum(r.cost_usd or 0.0 for r in records)

    async def run(self) -> None:
        with stop_on_interrupt(self.stop, lambda: self.progress.message("stopping: finishing what is measured")):
            if self.s.base_url is not None:
                await self._run_http()
            else:
                await self._run_in_process()

    async def _run_http(self) -> None:
        base_url = self.s.base_url
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(headers=auth_headers(self.s.api_key), limits=limits,
                                     timeout=self.s.request_timeout_s, trust_env=not is_loopback(base_url)) as client:
            info = await probe(client, base_url)
            self.kinds.update(info.models)
            models = self.s.models or list(info.models)[:1]
            if not models:
                raise TargetError(f"{base_url} lists no models: name one with --model")
            unknown = [m for m in models if info.models and m not in info.models]
            if unknown:
                raise TargetError(f"model {', '.join(unknown)} is not served at {base_url} "
                                  f"(models: {', '.join(info.models)})")
            for model in models:
                if self.stop.is_set():
                    break
                if self.s.workload == "batch":
                    await self._batch(client, base_url, model)
                else:
                    await self._runs(HttpModel(client, info, model, self.s.request_timeout_s, self.s.stream))

    async def _run_in_process(self) -> None:
        for engine in self.in_process:
            if self.stop.is_set():
                break
            await engine.start()
            try:
                await self._runs(EngineModel(engine, self.s.request_timeout_s, self.s.stream))
            finally:
                await engine.stop()

    # --- results ---

    def kind_of(self, engine: str) -> str | None:
        return self.kinds.get(engine)

    def target_description(self) -> str:
        if self.s.base_url is not None:
            return f"{self.s.base_url} (model {', '.join(self.s.models) or 'first listed'})"
        return f"in process (engine {', '.join(self.s.engines)})"

    def default_hardware(self) -> str:
        if self.s.base_url is not None:
            return f"the server at {self.s.base_url}"
        import torch

        device = (self.s.config.engines[self.s.engines[0]].device if self.s.engines else "cpu")
        if device.startswith("cuda") and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"

    def report(self) -> dict:
        s = self.s
        description = ("single documents, one request each, with a latency target" if s.workload == "realtime"
                       else "one Batch API file of documents, polled to the end")
        return {
            "benchmark": "nowait bench load",
            "target": {"base_url": s.base_url, "models": s.models, "engines": s.engines,
                       # Where each in-process engine ran (--device, else its config's; remote: none).
                       "devices": ({name: getattr(s.config.engines.get(name), "device", None) for name in s.engines}
                                   if s.config else None),
                       "description": self.target_description()},
            "workload": {"name": s.workload, "description": description, "kinds": list(s.kinds),
                         "latency_target_ms": s.latency_target_ms if s.workload == "realtime" else None,
                         "token_value_usd_per_mtok": s.token_value, "data_class": s.data_class,
                         "max_tokens": s.max_tokens, "schema": s.use_schema,
                         "system_prefix_chars": len(s.system_prefix)},
            "settings": {"profile": s.profile, "rates": s.rates, "max_requests": s.max_requests,
                         "max_seconds": s.max_seconds, "stream": s.stream, "split": s.split if s.seed is None else None,
                         "seed": s.seed, "warmup": s.warmup, "request_timeout_s": s.request_timeout_s},
            "tier": s.tier,
            "interrupted": self.stop.is_set(),
            "runs": [r.as_dict() for r in self.results],
            "batch": self.batch,
            "notes": self.notes,
        }
