"""`nowait bench load --workload batch --stores sqlite,postgresql,postgresql:2`: the same Batch API
file through gateways on each store, side by side.

Each entry is a store and a number of gateway replicas (`postgresql:2`: two `nowait serve`
processes on one database, their runners sharing the batch's lines through leases; SQLite is one
process's store, so `sqlite` is one replica). For each entry the bench starts the replicas on a
fresh store (a SQLite file in a scratch folder; a fresh database on the PostgreSQL server at
`--store`, else on a private server it starts, with fsync on as SQLite's synchronous=FULL syncs:
nowait.store.scratch_postgres), submits one batch to the first replica and polls it to the end:

- lines/s: the batch's lines over its wall time (submit to completed, polled every 0.5 s);
- store ms/line: the time the batch store's calls take per line, measured in this process on the
  same kind of store without the engines, after the gateways stopped (the median of five
  rounds, the kinds taking turns): a batch of the same size is started and answered by a
  loop making the calls a runner makes (gateway/batches.py): per line the answer and a claim of
  the freed slot, the batch's status and expiry once a second, its creation, validation and
  finalization spread over its lines; as many lines in flight as the gateways hold
  (`batches.max_concurrent_lines`).

The audit entries a line writes are not in the figure: on PostgreSQL they are queued and written
by a thread off the request path (gateway/audit/store_log.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from nowait.bench.load_session import LoadSession, LoadSettings, Progress
from nowait.cli_errors import fail
from nowait.gateway.batches import POLL_S

STORE_KINDS = ("sqlite", "postgresql")
READY_TIMEOUT_S = 300.0
LEASE_S = 30.0
COST_ROUNDS = 5


@dataclass(frozen=True)
class StoreRun:
    kind: str  # sqlite or postgresql
    replicas: int

    @property
    def label(self) -> str:
        return self.kind if self.replicas == 1 else f"{self.kind}:{self.replicas}"


def parse_stores(text: str) -> list[StoreRun]:
    """`sqlite,postgresql,postgresql:2` as runs; ValueError (one line) for anything else."""
    runs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        kind, _, count = part.partition(":")
        if kind not in STORE_KINDS:
            raise ValueError(f"--stores: unknown store {kind!r}; choose sqlite or postgresql[:REPLICAS]")
        try:
            replicas = int(count) if count else 1
        except ValueError:
            raise ValueError(f"--stores: {part!r}: the replica count must be a whole number") from None
        if replicas < 1:
            raise ValueError(f"--stores: {part!r}: at least one replica")
        if kind == "sqlite" and replicas > 1:
            raise ValueError(f"--stores: {part!r}: SQLite is one process's store; several replicas need postgresql")
        runs.append(StoreRun(kind, replicas))
    if not runs:
        raise ValueError("--stores needs at least one store (sqlite, postgresql or postgresql:N)")
    return runs


def store_cost_ms(url: str, lines: int, in_flight: int) -> float:
    """Milliseconds of batch store calls per line for a batch of `lines` (module docstring)."""
    from nowait.gateway.batch_store import BatchStore
    from nowait.store.database import open_database

    database = open_database(url)
    store = BatchStore(database)
    body = json.dumps({"model": "nowait", "max_tokens": 64,
                       "messages": [{"role": "user", "content": "Extract the fields of this KYC packet. " * 8}]})
    response = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "ar",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": json.dumps({"name": "x" * 120})}}],
                "usage": {"prompt_tokens": 90, "completion_tokens": 40, "total_tokens": 130}}
    owner = f"bench/{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        file = store.create_file("bench.jsonl", "batch", body.encode() * lines)
        batch_id = store.create_batch(file.id, "/v1/chat/completions", "24h", None).id
        store.start(batch_id, [(n, f"doc-{n}", body) for n in range(1, lines + 1)])
        looked = time.perf_counter()
        store.status(batch_id)
        store.expire_due(batch_id)
        held = [line for line, _, _ in store.claim(batch_id, owner, in_flight, LEASE_S)]
        while held:
            line = held.pop(0)
            store.answer(batch_id, line, 200, response, f"req-{line}")
            if time.perf_counter() - looked >= POLL_S:  # the runner reads these once a second
                store.status(batch_id)
                store.expire_due(batch_id)
                looked = time.perf_counter()
            held += [n for n, _, _ in store.claim(batch_id, owner, in_flight - len(held), LEASE_S)]
        store.has_pending(batch_id)
        store.mark_finalizing(batch_id)
        store.finalize(batch_id, "completed")
        return (time.perf_counter() - t0) * 1000.0 / lines
    finally:
        store.close()
        database.close()


class _Replicas:
    """The gateway processes of one run, stopped on exit."""

    def __init__(self, config_path: Path | None, work: Path, url: str, count: int) -> None:
        from nowait.bench.gateway import _free_port
        from nowait.bench.soak import SOAK_API_KEY, GatewayProcess, soak_config

        self.api_key = SOAK_API_KEY
        self.processes = []
        for k in range(count):
            folder = work / f"replica-{k + 1}"
            folder.mkdir(parents=True)
            config = soak_config(config_path, work / "data", _free_port())
            config["store"] = {**config.get("store", {}), "url": url, "replica": f"bench-{k + 1}", "lease_s": LEASE_S}
            self.processes.append(GatewayProcess(config, folder))
        self.max_concurrent = config["batches"]["max_concurrent_lines"]

    async def start(self) -> None:
        import httpx

        from nowait.bench.soak import wait_ready

        for process in self.processes:
            process.start()
        async with httpx.AsyncClient(trust_env=False) as client:
            for process in self.processes:
                await wait_ready(client, process, READY_TIMEOUT_S)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def run_stores(settings: LoadSettings, runs: list[StoreRun], config_path: Path | None, server_url: str | None,
               progress: Progress) -> dict:
    """Every run's figures and the PostgreSQL store's extra cost per line over SQLite's."""
    results = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="nowait-bench-stores-") as scratch:
        postgres = None
        if server_url is None and any(r.kind == "postgresql" for r in runs):
            from nowait.store.scratch_postgres import PostgresNotFound, ScratchPostgres

            try:
                postgres = stack.enter_context(ScratchPostgres(durable=True))
            except (PostgresNotFound, RuntimeError) as error:
                fail(f"--stores: no PostgreSQL server to run on (give one with --store URL): {error}")

        def fresh_url(kind: str, name: str) -> str:
            if kind == "sqlite":
                return f"sqlite:///{Path(scratch) / f'{name}.sqlite'}"
            return postgres.create_database(f"bench_{name}_{uuid.uuid4().hex[:8]}") if postgres else server_url

        for index, run in enumerate(runs):
            work = Path(scratch) / f"{index + 1}-{run.label.replace(':', '-')}"
            replicas = _Replicas(config_path, work, fresh_url(run.kind, f"batches-{index + 1}"), run.replicas)
            try:
                asyncio.run(replicas.start())
                base_url = f"http://127.0.0.1:{replicas.processes[0].port}/v1"
                session = LoadSession(dataclasses.replace(settings, base_url=base_url, api_key=replicas.api_key),
                                      progress)
                asyncio.run(session.run())
            finally:
                replicas.stop()
            batch = session.batch or {}
            results.append({"store": run.label, "replicas": run.replicas,
                            "lines": batch.get("requests") or settings.max_requests or 32,
                            "status": batch.get("status"), "successful": batch.get("successful"),
                            "duration_s": batch.get("duration_s"), "lines_per_s": batch.get("requests_per_s"),
                            "in_flight": replicas.max_concurrent})
        # The store loops after the gateways are gone, the kinds taking turns, the median of
        # COST_ROUNDS: one loop is disturbed by whatever else the machine does at that moment.
        lines, in_flight = max(r["lines"] for r in results), results[0]["in_flight"]
        kinds = list(dict.fromkeys(run.kind for run in runs))
        rounds: dict[str, list[float]] = {kind: [] for kind in kinds}
        for round_index in range(COST_ROUNDS):
            for kind in kinds:
                rounds[kind].append(round(store_cost_ms(fresh_url(kind, f"cost-{round_index}"), lines, in_flight), 3))
    cost = {kind: statistics.median(values) for kind, values in rounds.items()}
    for run, result in zip(runs, results, strict=True):
        result["store_ms_per_line"] = cost[run.kind]
    extra = round(cost["postgresql"] - cost["sqlite"], 3) if len(cost) == 2 else None
    return {"benchmark": "nowait bench load --stores", "workload": "batch", "max_tokens": settings.max_tokens,
            "postgres": "given (--store)" if server_url else "private (scratch, fsync on)", "runs": results,
            "store_cost": {"lines": lines, "in_flight": in_flight, "rounds_ms_per_line": rounds},
            "postgresql_extra_ms_per_line": extra}


def print_stores_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Batch API by store (one batch per row)")
    for column in ("store", "replicas", "lines", "status", "wall s", "lines/s", "store ms/line"):
        table.add_column(column, justify="left" if column in ("store", "status") else "right")
    for r in result["runs"]:
        table.add_row(r["store"], str(r["replicas"]), f"{r['successful']}/{r['lines']}", str(r["status"]),
                      f"{r['duration_s'] or 0:.2f}", f"{r['lines_per_s'] or 0:.2f}", f"{r['store_ms_per_line']:.3f}")
    console = Console(width=120)
    console.print(table)
    cost = result["store_cost"]
    console.print(f"store ms/line: the median of {COST_ROUNDS} rounds of {cost['lines']} lines, {cost['in_flight']} "
                  f"in flight: {json.dumps(cost['rounds_ms_per_line'])}", highlight=False)
    if result["postgresql_extra_ms_per_line"] is not None:
        console.print(f"PostgreSQL store over SQLite: {result['postgresql_extra_ms_per_line']:+.3f} ms per line "
                      "(issue target: at most +2 ms)", highlight=False)
