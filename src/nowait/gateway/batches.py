"""The OpenAI Batch API's runner: answers the stored batches' lines (gateway/batch_store.py holds
them and states the durability rules).

Every replica runs one. Each tenant's unfinished batches are answered in creation order, one lane
per tenant; a lane claims lines with leases (the store's rule 3), up to `max_concurrent` in flight,
renews the leases of the lines it is answering, and gives back those it stops on. Lines leased by
another replica are left to it until its lease expires; a batch is finalized once no line is left
unanswered, by whichever replica sees that first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable

# The input file's parsing has its own module; the runner calls it by this module's name.
from nowait.gateway.batch_input import BatchInputError, parse_input
from nowait.gateway.batch_store import COMPLETION_WINDOWS, DEFAULT_OWNER, UNFINISHED, BatchOwner, BatchStore
from nowait.gateway.schemas import BatchError

__all__ = ["BATCH_ENDPOINTS", "COMPLETION_WINDOWS", "DEFAULT_OWNER", "UNFINISHED", "BatchInputError", "BatchOwner",
           "BatchRunner", "BatchStore", "parse_input"]

log = logging.getLogger("nowait.gateway")

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_PROCESS_FAILURES = 5  # failed passes before a batch still validating is marked failed
DEFAULT_LEASE_S = 30.0
POLL_S = 1.0  # how often a lane waiting on others' leases, or on its own lines, looks again

# execute(endpoint, body, request_id, owner) -> (HTTP status, response body, retry after): the
# same path an HTTP request takes, as the batch's owner.
Executor = Callable[[str, dict, str, BatchOwner], Awaitable[tuple[int, dict, float | None]]]


def default_replica_name() -> str:
    """This process's name in leases and audit chains when the config names none."""
    return f"{socket.gethostname()}:{os.getpid()}"


class BatchRunner:
    """Answers each tenant's batches in creation order, up to `max_concurrent` lines of a tenant in
    flight, resuming on start. Tenants run side by side, one lane each: a tenant whose lines wait
    out its rate limit, or whose batch is long, never holds up another tenant's batches."""

    def __init__(self, store: BatchStore, execute: Executor, max_concurrent: int, replica: str | None = None,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.store, self.execute, self.max_concurrent = store, execute, max_concurrent
        # A lease names this process, not only its replica: a restarted replica does not take
        # over its former self's leases before they expire (their lines may still be running).
        self.lease_owner = f"{replica or default_replica_name()}/{uuid.uuid4().hex[:8]}"
        self.lease_s = lease_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lanes: dict[str, asyncio.Task] = {}  # tenant -> the task answering its batches
        self._failures: dict[str, int] = {}  # batch id -> processing passes failed in a row

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="nowait-batch-runner")

    async def stop(self) -> None:
        for task in [self._task, *self._lanes.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        """Start a lane for each tenant with unfinished batches and none running; then wait for
        a new batch (`wake`) or a second."""
        while True:
            try:
                tenants = await asyncio.to_thread(self.store.unfinished_tenants)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store could not be read: try again shortly
                log.exception("batch runner could not list the unfinished batches")
                tenants = []
            for tenant in tenants:
                lane = self._lanes.get(tenant)
                if lane is None or lane.done():
                    self._lanes[tenant] = asyncio.create_task(self._lane(tenant), name=f"nowait-batches-{tenant}")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _lane(self, tenant: str) -> None:
        """One tenant's unfinished batches in creation order, until it has none."""
        while True:
            try:
                batch_ids = await asyncio.to_thread(self.store.unfinished, tenant)
            except Exception:  # the store could not be read: the runner starts the lane again
                log.exception("batch runner could not list tenant %s's unfinished batches", tenant)
                return
            if not batch_ids:
                return
            for batch_id in batch_ids:
                try:
                    await self._process(batch_id)
                    self._failures.pop(batch_id, None)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # one failing batch must not hold up the ones after it
                    log.exception("batch %s failed in processing", batch_id)
                    await self._after_failure(batch_id, error)

    async def _after_failure(self, batch_id: str, error: Exception) -> None:
        """A batch still being validated after `MAX_PROCESS_FAILURES` failed passes is marked
        failed with the error (its input will not get better); one with accepted lines keeps
        being retried, as its lines are durable, while the batches after it go on."""
        self._failures[batch_id] = self._failures.get(batch_id, 0) + 1
        if self._failures[batch_id] >= MAX_PROCESS_FAILURES and \
                await asyncio.to_thread(self.store.status, batch_id) == "validating":
            message = f"the batch could not be processed: {type(error).__name__}: {error}"
            await asyncio.to_thread(self.store.fail, batch_id, [BatchError(code="internal_error", message=message)])
            self._failures.pop(batch_id, None)
        else:
            await asyncio.sleep(1.0)

    async def _process(self, batch_id: str) -> None:
        store = self.store
        batch = await asyncio.to_thread(store.get_batch, batch_id)
        if batch.status == "validating":
            owner = await asyncio.to_thread(store.owner, batch_id)
            content = await asyncio.to_thread(store.file_content, batch.input_file_id, owner.tenant)
            try:
                if content is None:
                    raise BatchInputError([BatchError(code="invalid_input_file",
                                                      message=f"input file {batch.input_file_id} no longer exists")])
                lines = await asyncio.to_thread(parse_input, content, batch.endpoint)  # off the event loop
            except BatchInputError as error:
                await asyncio.to_thread(store.fail, batch_id, error.errors)
                return
            await asyncio.to_thread(store.start, batch_id, lines)  # a no-op if another replica was first
        if await asyncio.to_thread(store.expire_due, batch_id):
            return
        if await asyncio.to_thread(store.status, batch_id) in ("in_progress", "cancelling"):
            await self._answer_lines(batch_id, batch.endpoint)
        status = await asyncio.to_thread(store.status, batch_id)
        if status == "in_progress" and await asyncio.to_thread(store.mark_finalizing, batch_id):
            status = "finalizing"
        if status in ("finalizing", "cancelling"):
            await asyncio.to_thread(store.finalize, batch_id, "completed" if status == "finalizing" else "cancelled")

    async def _answer_lines(self, batch_id: str, endpoint: str) -> None:
        """Claim and answer this batch's lines until none is left unanswered or it stops being
        in_progress; lines other replicas hold are waited for (their leases may expire)."""
        store, in_flight = self.store, {}  # line -> its task
        owner = await asyncio.to_thread(store.owner, batch_id)
        renewer = asyncio.create_task(self._renew_leases(batch_id, in_flight))
        loop, looked = asyncio.get_running_loop(), None  # when the status and the expiry were last read
        try:
            while True:
                # Read once per POLL_S, not once per line: each read is a round trip to a shared
                # store, and a claim itself takes no line of a batch no longer in_progress.
                if looked is None or loop.time() - looked >= POLL_S:
                    if await asyncio.to_thread(store.status, batch_id) != "in_progress" or \
                            await asyncio.to_thread(store.expire_due, batch_id):
                        break
                    looked = loop.time()
                free = self.max_concurrent - len(in_flight)
                claimed = await asyncio.to_thread(store.claim, batch_id, self.lease_owner, free, self.lease_s)
                for line, _custom_id, body in claimed:
                    in_flight[line] = asyncio.create_task(self._answer(batch_id, endpoint, line, body, owner))
                if not in_flight and not claimed and not await asyncio.to_thread(store.has_pending, batch_id):
                    break  # every line answered
                waiting = list(in_flight.values())
                if waiting:
                    done, _ = await asyncio.wait(waiting, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for line in [n for n, task in in_flight.items() if task in done]:
                        in_flight.pop(line).result()
                else:  # the rest is leased to other replicas: look again for expired leases
                    await asyncio.sleep(min(POLL_S, self.lease_s / 4))
            if in_flight:
                await asyncio.gather(*in_flight.values())
        finally:
            renewer.cancel()
            for task in in_flight.values():
                task.cancel()
            if in_flight:  # stopped mid-batch: the lines it held go back at once, not after their lease
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(store.release, batch_id, self.lease_owner, list(in_flight))

    async def _renew_leases(self, batch_id: str, in_flight: dict[int, asyncio.Task]) -> None:
        """Keep the leases of the lines this lane is answering from expiring under them."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await asyncio.to_thread(self.store.renew, batch_id, self.lease_owner, list(in_flight), self.lease_s)
            except Exception:  # the store is away: the lines may be claimed again, and answered once
                log.warning("could not renew the leases of batch %s's lines", batch_id, exc_info=True)

    async def _answer(self, batch_id: str, endpoint: str, line: int, body: dict, owner: BatchOwner) -> None:
        request_id = f"req_{batch_id.removeprefix('batch_')}_{line}"
        while True:
            status, response, retry_after = await self.execute(endpoint, body, request_id, owner)
            if status != 429 or (response.get("error") or {}).get("code") == "insufficient_quota":
                break
            # A full engine queue, or the key's rate limit, is back-pressure, not an answer: wait
            # and try again while the batch runs (a cancelled batch leaves the line unanswered).
            # An engine that is not available (503) is an answer: waiting for it would hold up
            # every later batch; so is a spent budget, which lasts until the next day.
            await asyncio.sleep(retry_after or 0.5)
            if await asyncio.to_thread(self.store.status, batch_id) != "in_progress":
                await asyncio.to_thread(self.store.release, batch_id, self.lease_owner, [line])
                return
        await self._record(batch_id, line, status, response, request_id)

    async def _record(self, batch_id: str, line: int, status: int, response: dict, request_id: str) -> None:
        """Store a line's answer; while the store is away, keep trying (the answer is not lost
        while this process lives; if it dies, the line's lease expires and it runs again)."""
        while True:
            try:
                await asyncio.to_thread(self.store.answer, batch_id, line, status, response, request_id)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("could not store the answer of batch %s line %d: retrying", batch_id, line, exc_info=True)
                await asyncio.sleep(POLL_S)
