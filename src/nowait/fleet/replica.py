"""One engine replica of a fleet: the engine the factory builds from `engines.<name>`, behind the
same worker thread and back-pressure as in `nowait serve` (gateway/owned.py), in a Ray Serve
replica. deploy.py makes it a deployment; the gateway reaches it through a FleetBackend.

Errors the engine answers (a bad request, a full queue, a timeout) come back as replies, so the
gateway answers them exactly as `nowait serve` does; only a lost replica is a Ray error.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from nowait.engines.config import OwnedEngineSpec
from nowait.engines.factory import ModelCache
from nowait.fleet import deltas
from nowait.fleet.replies import Reply, error_fields
from nowait.gateway.domain import Attempt, Call
from nowait.gateway.engines import build_owned
from nowait.gateway.errors import APIError
from nowait.gateway.owned import OwnedBackend, UnavailableBackend
from nowait.host_memory import keep_freed_memory


def replica_id() -> str:
    """This replica's id in Ray Serve (its process id outside one, in a unit test)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica
        return f"pid-{os.getpid()}"


def serving(name: str, backend: OwnedBackend | UnavailableBackend) -> OwnedBackend:
    """The engine a replica runs; a missing or unsuitable model fails its deployment's start."""
    if not isinstance(backend, OwnedBackend):
        raise RuntimeError(f"engine {name!r} cannot serve: {backend.unavailable_reason}")
    return backend


def engine_load(backend: OwnedBackend) -> dict:
    """Requests running and waiting, and free cache rows: what the request router reads."""
    running = backend.running()
    return {"running": running, "waiting": backend.waiting(), "free_cache": max(0, backend.capacity - running)}


def process_facts() -> dict:
    """This replica's process id and niceness (`fleet status` shows both; a niced replica decodes
    behind every other process on its cores)."""
    return {"pid": os.getpid(), "niceness": os.getpriority(os.PRIO_PROCESS, 0)}


def check_worker(backend: OwnedBackend) -> None:
    """A replica's health check: raising marks it unhealthy, and Ray replaces it."""
    if not backend.worker.alive():
        raise RuntimeError(f"engine {backend.name!r}: its worker thread has stopped "
                           f"({backend.worker.last_failure or 'no failure recorded'})")


class EngineReplica:
    """An owned engine in a Ray Serve replica: run, stream, its load for the request router, and
    a health check that fails once the engine thread is gone."""

    def __init__(self, name: str, spec: OwnedEngineSpec, window_s: float, default_max_tokens: int,
                 torch_threads: int | None = None) -> None:
        keep_freed_memory()  # a replica's process is Ray's worker, not a nowait command
        if torch_threads:  # before the engine thread's first operation (deploy.engine_replica_threads)
            import torch

            torch.set_num_threads(torch_threads)
        self.backend = backend = serving(name, build_owned(name, spec, ModelCache(), window_s, default_max_tokens))
        self.id = replica_id()
        self.served = 0  # requests answered (the tests read which replicas served)
        # Of the requests this replica answered, whichever gateway replica sent them: what the
        # metrics' `replica` series show, the same from every gateway replica (totals()).
        self.tokens, self.busy_s, self.cost_usd = 0, 0.0, 0.0
        backend.worker.start()  # what OwnedBackend.start does, from a constructor that is not async

    async def run(self, call: Call, timeout_s: float, affinity: str | None = None) -> Reply:
        """`affinity` is the request router's (router.py): it is not the engine's business."""
        try:
            attempt = await self.backend.run(call, timeout_s)
            self._count(attempt)
            return Reply("done", attempt=attempt, replica=self.id)
        except APIError as error:
            return Reply("error", error=error_fields(error), replica=self.id)

    def _count(self, attempt: Attempt) -> None:
        self.served += 1
        self.tokens += attempt.completion_tokens
        self.busy_s += attempt.compute_s
        self.cost_usd += attempt.cost_usd

    async def stream(self, call: Call, timeout_s: float, affinity: str | None = None) -> AsyncIterator[Reply]:
        """open (the engine accepted), deltas, then done (with the text held since the last delta);
        or an error, before or after open. Deltas go in groups (deltas.py): fewer Ray objects."""
        try:
            stream = await self.backend.open_stream(call, timeout_s)
        except APIError as error:
            yield Reply("error", error=error_fields(error), replica=self.id)
            return
        try:
            yield Reply("open", replica=self.id)
            async for text, last in deltas.grouped(stream.deltas(), deltas.GROUP_WINDOW_S):
                if last:
                    self._count(stream.attempt)
                    yield Reply("done", text=text, attempt=stream.attempt, replica=self.id)
                else:
                    yield Reply("delta", text=text)
        except APIError as error:
            yield Reply("error", error=error_fields(error), replica=self.id)
        finally:  # the gateway went away mid-stream: the engine stops decoding for it
            await stream.aclose()

    def load(self) -> dict:
        """Requests running and waiting, and free cache rows: what the request router reads."""
        return {**engine_load(self.backend), "served": self.served, **process_facts()}

    def totals(self) -> dict:
        """This replica's own counts since it started, and its load: what every gateway replica's
        /metrics shows under its `replica` label (FleetBackend.refresh_replicas)."""
        return {"replica": self.id, "requests": self.served, "generation_tokens": self.tokens,
                "busy_seconds": self.busy_s, "cost_usd": self.cost_usd, **self.load()}

    def record_routing_stats(self) -> dict:
        """Ray Serve calls this every `request_routing_stats_period_s`; the router reads its answer."""
        return self.load()

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy and Ray replaces it."""
        check_worker(self.backend)

    def __del__(self) -> None:
        worker = getattr(getattr(self, "backend", None), "worker", None)
        if worker is not None:
            worker.stop(timeout_s=1.0)
