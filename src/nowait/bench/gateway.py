"""`nowait bench gateway`: what the HTTP gateway adds over calling the same engine in process, and
whether it holds many concurrent streaming clients.

One run, one engine (default `ar`), on loopback:

1. **Added latency.** The same request (an extraction prompt, greedy, `--max-tokens`) alternately
   through HTTP (`POST /v1/chat/completions`, keep-alive) and straight to the engine's worker in
   process (`OwnedBackend.run`: the same thread and continuous-batching loop the gateway uses).
   The difference is what parsing, auth, routing, serialization and the loopback round trip
   cost. Reported as p50/p99 of each side, their difference, and the pairwise differences.
   Goal (issue 6): p50 added <= 2 ms.
   With `--tenant-keys`, each round also sends the request with a tenant's store key whose
   limits are on (rpm, tpm and a daily budget, none reached), the HTTP requests of a round
   taking turns in order: keys on (the key looked up by its hash, limits admitted and charged)
   against keys off (a key of the configuration: one constant-time compare, no store, no
   limits, the gateway as it was before tenant keys). Both sides write a chained audit entry, so
   what the chain adds is timed apart, on the run's own entries: the chained writer against the
   unchained line it replaced. Goal: keys + limits + the audit chain <= 0.2 ms p50. The key
   lookup and the limits are also timed in process (taking turns with the configured key's
   compare), a figure a loaded machine disturbs far less than the HTTP difference.
2. **Concurrency.** `--clients` streaming clients at once, each reading its stream to `[DONE]`;
   any non-200, missing `[DONE]` or transport error counts as an error. Goal: zero errors at 200.
   The engine's queue is sized to hold every client (a bench of the gateway, not of back-pressure).

Numbers are measurements of this machine, printed side by side; nothing is asserted.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import typer

if TYPE_CHECKING:  # fastapi, uvicorn and torch load when the command runs, not with the CLI
    from nowait.gateway.config import GatewayConfig

ADDED_P50_GOAL_MS = 2.0
TENANT_KEYS_P50_GOAL_MS = 0.2  # key lookup + limits + the audit chain, per request
BENCH_API_KEY = "nowait-bench-configured-key"  # keys off: a key of the configuration, as before tenant keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentiles(values_s: list[float]) -> dict:
    ms = np.array(values_s) * 1000
    return {"p50": round(float(np.percentile(ms, 50)), 3), "p99": round(float(np.percentile(ms, 99)), 3),
            "mean": round(float(ms.mean()), 3)}


def bench_config(config: GatewayConfig, engine: str, clients: int, data_dir: Path,
                 tenant_keys: bool = False) -> GatewayConfig:
    """The config reduced to one owned engine that takes every role, its queue sized for the
    clients; with `tenant_keys`, a configured key too (the keys-off side: once the store holds a
    key, the server is no longer open)."""
    from nowait.gateway.config import RemoteEngineConfig, RoutingConfig

    if engine not in config.engines:
        raise ValueError(f"engine {engine!r} is not configured (engines: {', '.join(config.engines)})")
    spec = config.engines[engine]
    if isinstance(spec, RemoteEngineConfig):
        raise ValueError(f"engine {engine!r} is remote: the bench compares an owned engine in and out of process")
    spec = spec.model_copy(update={"max_queue": max(spec.max_queue, clients)})
    routing = RoutingConfig(batch_engine=engine, fast_engine=None, fallback_engine=engine,
                            owned_frontier_engine=engine)
    auth = config.auth.model_copy(update={"database": None})
    if tenant_keys:
        auth = auth.model_copy(update={"api_keys": [*auth.api_keys, BENCH_API_KEY]})
    return config.model_copy(update={"engines": {engine: spec}, "routing": routing, "data_dir": data_dir,
                                     "audit_log": None, "auth": auth, "batches": config.batches.model_copy(
                                         update={"database": None})})


class _Server:
    """uvicorn in a thread on loopback, for the length of the bench."""

    def __init__(self, app, port: int) -> None:
        import uvicorn

        self.app, self.port = app, port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (see the log above)")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _messages(count: int) -> list[list[dict]]:
    from nowait.extraction.corpus import documents
    from nowait.tokenizer import instruction_for

    docs = documents("test", count)
    return [[{"role": "user", "content": f"{instruction_for(d.kind)}\n{d.text}\n"}] for d in docs]


def configured_key(gateway) -> str | None:
    """A key of the configuration (the tenant default, no limits), or None on an open server."""
    keys = sorted(gateway.config.auth.keys())
    return BENCH_API_KEY if BENCH_API_KEY in keys else (keys[0] if keys else None)


def tenant_key(gateway) -> str:
    """A store key of a bench tenant with every limit on, set far above what the bench uses."""
    from nowait.gateway.keys import KeySettings

    secret, _ = gateway.keys.create(KeySettings(tenant="bench", requests_per_minute=10**6,
                                                tokens_per_minute=10**9, budget_usd_per_day=10.0**6))
    return secret


def measure_added_latency(server: _Server, engine: str, requests: int, max_tokens: int,
                          tenant_keys: bool = False) -> dict:
    import httpx

    from nowait.gateway.calls import chat_calls
    from nowait.gateway.schemas import ChatCompletionRequest

    gateway = server.app.state.gateway
    backend = gateway.backends[engine]
    key = configured_key(gateway)
    sides = {"gateway": {"Authorization": f"Bearer {key}"} if key else {}}
    if tenant_keys:
        sides["tenant_key"] = {"Authorization": f"Bearer {tenant_key(gateway)}"}
    body = {"model": engine, "messages": _messages(1)[0], "max_tokens": max_tokens}
    loop = asyncio.new_event_loop()
    times: dict[str, list[float]] = {side: [] for side in [*sides, "in_process"]}
    loop_cpu = server_loop_cpu(server)
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
            for i in range(requests + 2):  # two warm-up rounds
                # The HTTP sides take turns going first, so neither always follows the in-process run.
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                measured, used = {}, {}
                for side in order:
                    cpu_started = loop_cpu()
                    started = time.perf_counter()
                    response = client.post("/v1/chat/completions", json=body, headers=sides[side])
                    measured[side] = time.perf_counter() - started
                    used[side] = loop_cpu() - cpu_started
                    response.raise_for_status()
                [call] = chat_calls(ChatCompletionRequest.model_validate(body), {}, gateway.config.defaults, f"b{i}")
                started = time.perf_counter()
                loop.run_until_complete(backend.run(call, 120))
                measured["in_process"] = time.perf_counter() - started
                if i >= 2:
                    for side, seconds in measured.items():
                        times[side].append(seconds)
                    for side, seconds in used.items():
                        cpu[side].append(seconds)
    finally:
        loop.close()
    gateway_ms, direct_ms = _percentiles(times["gateway"]), _percentiles(times["in_process"])
    result = {"requests": requests, "gateway_ms": gateway_ms, "in_process_ms": direct_ms,
              "added_ms": {"p50": round(gateway_ms["p50"] - direct_ms["p50"], 3),
                           "p99": round(gateway_ms["p99"] - direct_ms["p99"], 3)},
              "pairwise_added_ms": _percentiles([h - d for h, d in zip(times["gateway"], times["in_process"],
                                                                        strict=True)])}
    if tenant_keys:
        keyed_ms = _percentiles(times["tenant_key"])
        result["tenant_keys"] = {
            "keys_on_ms": keyed_ms, "keys_off_ms": gateway_ms,
            "added_ms": {"p50": round(keyed_ms["p50"] - gateway_ms["p50"], 3),
                         "p99": round(keyed_ms["p99"] - gateway_ms["p99"], 3)},
            "pairwise_added_ms": _percentiles([on - off for on, off in zip(times["tenant_key"], times["gateway"],
                                                                            strict=True)]),
            "server_cpu_ms": {
                "keys_on": _percentiles(cpu["tenant_key"]), "keys_off": _percentiles(cpu["gateway"]),
                "pairwise_added": _percentiles([on - off for on, off in zip(cpu["tenant_key"], cpu["gateway"],
                                                                            strict=True)])},
            "audit_chain_us": audit_chain_cost(gateway.config.audit_log_path),
            "key_path_us": key_path_cost(gateway, sides["tenant_key"]["Authorization"].split()[-1].encode(),
                                         key.encode() if key else b"")}
    return result


def server_loop_cpu(server: _Server):
    """A clock of the CPU time the server's event-loop thread has used (Linux: its thread CPU
    clock). Every step of the keyed path (auth, limits, the audit line) runs on that thread, and
    its CPU seconds per request, unlike a request's wall time, hardly move with what else the
    machine runs: where the wall-time difference of keys on and off drowns in other jobs' noise,
    this one still shows what the keys add."""
    clock = time.pthread_getcpuclockid(server.thread.ident)
    return lambda: time.clock_gettime(clock)


def key_path_cost(gateway, tenant_secret: bytes, configured: bytes, repeats: int = 2000) -> dict:
    """The keyed path's own steps timed in process on the run's gateway, taking turns (less
    exposed to a loaded machine than the HTTP difference): the tenant key's lookup
    (`Authenticator.caller`, as a request does it) against the configured key's compare, and the
    limits' admit + headers + charge of one request (on a fresh `TenantLimits`, so the run's own
    windows are untouched), in µs (p50/p99)."""
    from nowait.gateway.limits import TenantLimits

    authenticator, limits = gateway.authenticator, TenantLimits()
    caller = authenticator.caller(tenant_secret)
    store_s, configured_s, limits_s = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        authenticator.caller(tenant_secret)
        store_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        authenticator.caller(configured)
        configured_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        limits.admit(caller)
        limits.headers(caller)
        limits.charge(caller, 0, 0.0)
        limits_s.append(time.perf_counter() - started)

    def micro(samples: list[float]) -> dict:
        us = np.array(samples) * 1e6
        return {"p50": round(float(np.percentile(us, 50)), 2), "p99": round(float(np.percentile(us, 99)), 2)}

    store, plain, limited = micro(store_s), micro(configured_s), micro(limits_s)
    return {"store_key_us": store, "configured_key_us": plain, "limits_us": limited,
            "added_p50_us": round(store["p50"] - plain["p50"] + limited["p50"], 2)}


def audit_chain_cost(path: Path, repeats: int = 20) -> dict:
    """What chaining adds to writing an audit entry, timed on this run's own entries: the chained
    writer's `record` (canonical JSON, SHA-256, the line) against the unchained line it replaced
    (one `json.dumps`, the write and the flush), taking turns, in µs (p50/p99)."""
    from nowait.gateway.audit import AuditLog, read_audit_log
    from nowait.gateway.audit.chain import CHAIN_FIELDS

    entries = [{k: v for k, v in e.items() if k not in CHAIN_FIELDS | {"time", "torn"}} for e in read_audit_log(path)]
    chained_s, unchained_s = [], []
    with tempfile.TemporaryDirectory(prefix="nowait-bench-audit-") as scratch:
        chained = AuditLog(Path(scratch) / "chained.jsonl")
        with (Path(scratch) / "unchained.jsonl").open("a", encoding="utf-8") as unchained:
            for entry in entries * repeats:
                started = time.perf_counter()
                chained.record(entry)
                chained_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                unchained.write(json.dumps({"time": round(time.time(), 3), **entry}, ensure_ascii=False,
                                           default=str) + "\n")
                unchained.flush()
                unchained_s.append(time.perf_counter() - started)
        chained.close()

    def micro(samples: list[float]) -> dict:
        us = np.array(samples) * 1e6
        return {"p50": round(float(np.percentile(us, 50)), 2), "p99": round(float(np.percentile(us, 99)), 2)}

    with_chain, without = micro(chained_s), micro(unchained_s)
    return {"entries": len(entries), "chained_us": with_chain, "unchained_us": without,
            "added_us": {"p50": round(with_chain["p50"] - without["p50"], 2),
                         "p99": round(with_chain["p99"] - without["p99"], 2)}}


async def _streaming_clients(port: int, engine: str, clients: int, max_tokens: int, api_key: str | None) -> dict:
    import httpx

    from nowait.bench.load_http import sse_events

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conversations = _messages(min(clients, 50))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def one(client: httpx.AsyncClient, index: int) -> dict:
        body = {"model": engine, "messages": conversations[index % len(conversations)], "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        first, tokens, done = None, 0, False
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
                async for event in sse_events(response):
                    if event is None:
                        done = True
                        break
                    if "error" in event:
                        return {"error": event["error"].get("message")}
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if first is None and any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                        first = time.perf_counter() - started
        except (httpx.HTTPError, ValueError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        if not done:
            return {"error": "stream ended without [DONE]"}
        return {"ttft": first if first is not None else time.perf_counter() - started,
                "e2e": time.perf_counter() - started, "tokens": tokens}

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, limits=limits,
                                 timeout=300) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, i) for i in range(clients)))
        wall = time.perf_counter() - started
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "errors": len(errors), "error_examples": errors[:3], "wall_s": round(wall, 3),
            "ttft_ms": _percentiles([r["ttft"] for r in ok]) if ok else None,
            "e2e_ms": _percentiles([r["e2e"] for r in ok]) if ok else None,
            "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0}


def run_gateway_bench(config: GatewayConfig, engine: str = "ar", requests: int = 200, clients: int = 200,
                      max_tokens: int = 16, tenant_keys: bool = False) -> dict:
    """Both measurements on one in-process server; returns the JSON the command prints."""
    from nowait.gateway.app import create_app

    with tempfile.TemporaryDirectory(prefix="nowait-bench-") as scratch:
        settings = bench_config(config, engine, clients, Path(scratch), tenant_keys)
        app = create_app(settings)
        with _Server(app, _free_port()) as server:
            backend = app.state.gateway.backends[engine]
            if not backend.available:
                raise ValueError(f"engine {engine!r} is not available: {backend.unavailable_reason}")
            latency = measure_added_latency(server, engine, requests, max_tokens, tenant_keys)
            concurrency = asyncio.run(_streaming_clients(server.port, engine, clients, max_tokens,
                                                         configured_key(app.state.gateway)))
    goals = {"added_p50_ms_at_most": ADDED_P50_GOAL_MS,
             "added_p50_met": latency["added_ms"]["p50"] <= ADDED_P50_GOAL_MS,
             "zero_errors_met": concurrency["errors"] == 0}
    if tenant_keys:
        keys = latency["tenant_keys"]
        added = keys["added_ms"]["p50"] + keys["audit_chain_us"]["added_us"]["p50"] / 1000
        # The same sum from the in-process timings: lookup + limits + chain, without HTTP's noise.
        in_process = (keys["key_path_us"]["added_p50_us"] + keys["audit_chain_us"]["added_us"]["p50"]) / 1000
        # The serving thread's CPU per request, keys on less keys off (pairwise), with the chain.
        server_cpu = keys["server_cpu_ms"]["pairwise_added"]["p50"] + keys["audit_chain_us"]["added_us"]["p50"] / 1000
        goals.update({"tenant_keys_p50_ms_at_most": TENANT_KEYS_P50_GOAL_MS, "tenant_keys_p50_ms": round(added, 3),
                      "tenant_keys_p50_met": added <= TENANT_KEYS_P50_GOAL_MS,
                      "tenant_keys_in_process_p50_ms": round(in_process, 3),
                      "tenant_keys_in_process_p50_met": in_process <= TENANT_KEYS_P50_GOAL_MS,
                      "tenant_keys_server_cpu_p50_ms": round(server_cpu, 3),
                      "tenant_keys_server_cpu_p50_met": server_cpu <= TENANT_KEYS_P50_GOAL_MS})
    return {"engine": engine, "device": getattr(config.engines.get(engine), "device", None), "max_tokens": max_tokens,
            "latency": latency, "concurrency": concurrency, "goals": goals}


def gateway(
    config: Path = typer.Option(None, "--config", "-c", help="nowait.yaml (default: the bundled demo models)"),
    engine: str = typer.Option("ar", help="the owned engine to measure"),
    requests: int = typer.Option(200, help="sequential requests for the added-latency percentiles"),
    clients: int = typer.Option(200, help="concurrent streaming clients"),
    max_tokens: int = typer.Option(16, help="output tokens per request"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads"),
    device: str = typer.Option(None, "--device", help="cpu, cuda or cuda:N: run --engine there (default: its "
                                                      "engines.<name>.device)"),
    tenant_keys: bool = typer.Option(False, "--tenant-keys", help="also time each request with a tenant's store "
                                     "key and limits on, taking turns with a configured key (keys off)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Gateway overhead over the in-process engine (p50/p99) and N concurrent streaming clients."""
    from nowait.gateway.config import ConfigError, default_config, load_config

    if requests < 1 or clients < 1 or max_tokens < 1:
        typer.echo("error: --requests, --clients and --max-tokens must be at least 1", err=True)
        raise typer.Exit(code=2)
    try:
        settings = load_config(config) if config is not None else default_config()
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    if threads:
        settings = settings.model_copy(update={"server": settings.server.model_copy(update={"torch_threads": threads})})
    if device is not None:
        from nowait.checkpoints import check_device

        try:
            check_device(device)
        except ValueError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(code=2) from None
        settings = settings.on_device([engine], device)
    try:
        result = run_gateway_bench(settings, engine, requests, clients, max_tokens, tenant_keys)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    if as_json:
        print(json.dumps(result))
        return
    lat, con = result["latency"], result["concurrency"]
    typer.echo(f"engine {engine}, {max_tokens} output tokens, {lat['requests']} requests each way")
    typer.echo(f"  in process  p50 {lat['in_process_ms']['p50']:.2f} ms  p99 {lat['in_process_ms']['p99']:.2f} ms")
    typer.echo(f"  via gateway p50 {lat['gateway_ms']['p50']:.2f} ms  p99 {lat['gateway_ms']['p99']:.2f} ms")
    typer.echo(f"  added       p50 {lat['added_ms']['p50']:.2f} ms  p99 {lat['added_ms']['p99']:.2f} ms "
               f"(goal p50 <= {ADDED_P50_GOAL_MS:g} ms: {'met' if result['goals']['added_p50_met'] else 'missed'})")
    if tenant_keys:
        keys = lat["tenant_keys"]
        typer.echo(f"  keys on     p50 {keys['keys_on_ms']['p50']:.2f} ms vs keys off "
                   f"{keys['keys_off_ms']['p50']:.2f} ms: "
                   f"added p50 {keys['added_ms']['p50']:.3f} ms (pairwise {keys['pairwise_added_ms']['p50']:.3f}), "
                   f"audit chain adds p50 {keys['audit_chain_us']['added_us']['p50']:.1f} us (goal <= "
                   f"{TENANT_KEYS_P50_GOAL_MS:g} ms: "
                   f"{'met' if result['goals']['tenant_keys_p50_met'] else 'missed'})")
        used = keys["server_cpu_ms"]
        typer.echo(f"  server CPU  keys on p50 {used['keys_on']['p50']:.3f} ms vs keys off "
                   f"{used['keys_off']['p50']:.3f} ms of the event-loop thread per request: added p50 (pairwise) "
                   f"{used['pairwise_added']['p50']:.3f} ms, with the chain "
                   f"{result['goals']['tenant_keys_server_cpu_p50_ms']:.3f} ms (goal <= "
                   f"{TENANT_KEYS_P50_GOAL_MS:g} ms: "
                   f"{'met' if result['goals']['tenant_keys_server_cpu_p50_met'] else 'missed'})")
        steps = keys["key_path_us"]
        typer.echo(f"  in process  key lookup p50 {steps['store_key_us']['p50']:.1f} us vs configured key "
                   f"{steps['configured_key_us']['p50']:.1f} us, limits {steps['limits_us']['p50']:.1f} us: "
                   f"with the chain {result['goals']['tenant_keys_in_process_p50_ms']:.3f} ms (goal <= "
                   f"{TENANT_KEYS_P50_GOAL_MS:g} ms: "
                   f"{'met' if result['goals']['tenant_keys_in_process_p50_met'] else 'missed'})")
    typer.echo(f"{con['clients']} concurrent streaming clients: {con['errors']} errors, {con['wall_s']} s, "
               f"{con['tokens_per_s']} output tok/s" + (f", TTFT p50 {con['ttft_ms']['p50']} ms p99 "
                                                        f"{con['ttft_ms']['p99']} ms" if con["ttft_ms"] else ""))


def register(app: typer.Typer) -> None:
    """Add `gateway` to the `nowait bench` group."""
    app.command("gateway")(gateway)
