"""Replays the demo's plan against the gateway over HTTP, filling the scoreboard as answers come.

Three concurrent tasks on one event loop, all through the official API:

- arrivals: each interactive request is sent at its planned time (`POST /v1/chat/completions`,
  routing metadata in `x-nowait-*` headers) without waiting for earlier answers: an open loop,
  as customers arrive;
- the batch: one JSONL file uploaded (`/v1/files`), one batch created (`/v1/batches`), polled
  until it ends, then its output and error files read and every line scored;
- the gauges: `/readyz` and `/metrics` scraped every second for the live view and the report.

At the end of the planned duration nothing new is sent; requests in flight and the batch get
`drain_s` more seconds, after which what is left is cancelled and counted as an error. `stop`
(Ctrl-C) ends everything at once; what finished is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from nowait.bench.load_http import BatchClient, TargetError, auth_headers, complete_chat, record_from_body
from nowait.bench.load_metrics import RequestRecord
from nowait.bench.load_workload import LoadRequest
from nowait.demo.gauges import scrape
from nowait.demo.plan import BATCH, Arrival, DemoPlan
from nowait.demo.scoreboard import Scoreboard

REQUEST_TIMEOUT_S = 60.0
SCRAPE_EVERY_S = 1.0
BATCH_POLL_S = 0.5


class DemoTraffic:
    def __init__(self, root_url: str, base_url: str, api_key: str | None, plan: DemoPlan, arrivals: list[Arrival],
                 batch: list[LoadRequest], batch_model: str, board: Scoreboard, drain_s: float = 40.0) -> None:
        self.root_url, self.base_url, self.api_key = root_url, base_url, api_key
        self.plan, self.arrivals, self.batch, self.batch_model = plan, arrivals, batch, batch_model
        self.board, self.drain_s = board, drain_s
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def drain_deadline(self) -> float:
        """perf_counter time after which nothing is waited for any more."""
        return self.t0 + self.plan.duration_s + self.drain_s

    async def _sleep_until(self, at_s: float, stop: asyncio.Event) -> None:
        wait = self.t0 + at_s - time.perf_counter()
        if wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def _arrivals(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        board = self.board
        in_flight: dict[asyncio.Task, Arrival] = {}

        def answered(task: asyncio.Task) -> None:
            arrival = in_flight.pop(task, None)
            if arrival is not None and not task.cancelled() and task.exception() is None:
                board.add(arrival.route, task.result(), arrival.request.doc.tier)

        for arrival in self.arrivals:
            await self._sleep_until(arrival.at_s, stop)
            if stop.is_set():
                break
            board.sent[arrival.route] += 1
            task = asyncio.ensure_future(complete_chat(client, self.base_url, arrival.request, arrival.model, self.t0,
                                                       REQUEST_TIMEOUT_S, label=arrival.label))
            in_flight[task] = arrival
            task.add_done_callback(answered)
        while in_flight and not stop.is_set() and time.perf_counter() < self.drain_deadline:
            await asyncio.wait(set(in_flight), timeout=0.2)
        for task, arrival in list(in_flight.items()):
            if task.done():  # answered at the deadline: its done callback records it
                continue
            task.cancel()
            if not stop.is_set():  # still unanswered after the drain: the demo failed to serve it
                route = arrival.route
                board.add(route, RequestRecord(target=route, sent_s=0.0, done_s=self.now(), status=0,
                                               error=f"unanswered {self.drain_s:.0f} s after the demo ended",
                                               label=route), arrival.request.doc.tier)
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _batch(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        state = self.board.batch
        state.lines = len(self.batch)
        if not self.batch:
            state.status = "none"
            return
        await self._sleep_until(self.plan.batch_submit_at_s, stop)
        if stop.is_set():
            return
        batches = BatchClient(client, self.base_url)
        requests = {f"loc-{i:04d}": request for i, request in enumerate(self.batch)}
        try:
            created = await batches.submit([r.batch_line(cid, self.batch_model) for cid, r in requests.items()],
                                           metadata={"job": "nowait demo: overnight letters of credit"})
            state.batch_id, state.status, state.submitted_s = created["id"], created["status"], self.now()

            def polled(batch: dict) -> None:
                counts = batch.get("request_counts") or {}
                state.status = batch["status"]
                state.completed, state.failed = int(counts.get("completed") or 0), int(counts.get("failed") or 0)

            batch = await batches.wait(state.batch_id, self.drain_deadline, BATCH_POLL_S, stop, polled)
            state.finished_s = self.now()
            answers = await batches.results(batch)
        except (TargetError, httpx.HTTPError) as error:
            state.status, state.error = "failed", str(error)
            return
        for custom_id, request in requests.items():
            status, body, error = answers.get(custom_id, (0, None, "never answered (batch cancelled)"))
            self.board.add(BATCH, record_from_body(request, self.batch_model, state.submitted_s, state.finished_s,
                                                   status, body, error=error, label=BATCH))

    async def _gauges(self, client: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            try:
                self.board.snapshots.append(await scrape(client, self.root_url, round(self.now(), 2)))
            except (httpx.HTTPError, ValueError, KeyError):
                self.board.scrape_errors += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), SCRAPE_EVERY_S)

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=64)
        async with httpx.AsyncClient(headers=auth_headers(self.api_key), limits=limits, timeout=REQUEST_TIMEOUT_S,
                                     trust_env=False) as client:  # loopback only: no proxy
            self.t0 = time.perf_counter()
            self.board.started, self.board.phase = True, "traffic"
            done = asyncio.Event()
            gauges = asyncio.ensure_future(self._gauges(client, done))
            work = [asyncio.ensure_future(self._arrivals(client, stop)),
                    asyncio.ensure_future(self._batch(client, stop))]
            try:
                await asyncio.gather(*work)
            finally:
                for task in work:
                    task.cancel()
                await asyncio.gather(*work, return_exceptions=True)
                done.set()
                await asyncio.gather(gauges, return_exceptions=True)
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):  # the final numbers
                    self.board.snapshots.append(await scrape(client, self.root_url, round(self.now(), 2)))
                self.board.elapsed_s = self.now()
                self.board.phase = "stopped" if stop.is_set() else "done"

    def tick(self) -> None:
        """Refresh the clock and the phase the live view shows."""
        if not self.board.started or self.board.phase in ("done", "stopped"):
            return
        self.board.elapsed_s = self.now()
        if self.board.elapsed_s >= self.plan.duration_s and self.board.phase == "traffic":
            self.board.phase = "draining: waiting for the last answers and the batch"
