"""An owned engine of a fleet as the gateway's dispatcher sees it (`domain.Backend`): its requests
go to the engine's Ray Serve deployment through a handle, and Ray's request router (router.py)
picks the replica. The routing rule, fallback and accounting above it are `nowait serve`'s.

A replica lost mid-request (killed, its node gone) is retried once on another replica when no
token has reached the client yet; after one has, only a greedy or seeded request is (its text is
the same on any replica: what the client has is checked and skipped); any other stream ends with
an error event, since a retry would send it a second answer's tokens. Retries count in
`nowait:replica_retries_total`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator

from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from nowait.engines.config import DiffusionEngineConfig, OwnedEngineSpec
from nowait.fleet.replies import Reply
from nowait.gateway.domain import Attempt, Call
from nowait.gateway.engine_stats import EngineStats
from nowait.gateway.errors import APIError, timed_out
from nowait.router import DataClass

log = logging.getLogger("nowait.gateway")

# What Ray raises when the replica holding a request is gone; anything else is the engine's own error.
REPLICA_LOST = (ray_errors.RayActorError, ray_errors.WorkerCrashedError, ray_errors.NodeDiedError,
                ray_errors.ObjectLostError, serve_errors.ReplicaUnavailableError)
AFFINITY_CHARS = 256  # of the rendered prompt: enough to tell shared system prompts apart


def affinity_key(call: Call) -> str:
    """A short digest of the prompt's beginning: requests that share it likely share a prefix in
    an AR replica's prefix cache, so the router sends them to the same replica when loads are close."""
    head = json.dumps(call.messages)[:AFFINITY_CHARS] if call.endpoint == "chat" else str(call.prompt)[:AFFINITY_CHARS]
    return hashlib.blake2b(head.encode(), digest_size=8).hexdigest()


def replica_lost(engine: str, error: BaseException) -> APIError:
    return APIError(502, f"engine {engine!r}: the replica answering this request was lost ({type(error).__name__})",
                    type="server_error", code="replica_lost")


class FleetBackend:
    """An owned engine's deployment, reached through its handle from a gateway replica."""

    owned = True
    available = True
    unavailable_reason = ""

    def __init__(self, name: str, spec: OwnedEngineSpec, handle: DeploymentHandle, window_s: float) -> None:
        self.name, self.kind, self.handle = name, spec.kind, handle
        self.capacity = spec.max_batch if isinstance(spec, DiffusionEngineConfig) else spec.max_num_seqs
        replicas = spec.fleet.replicas.max if spec.fleet is not None else 1
        self.admits = (self.capacity + spec.max_queue) * replicas
        self.prefix_affinity = spec.kind in ("ar", "spec")
        # Engine time and tokens of the answers this gateway replica received: the cost identity
        # over the deployment's replicas, as seen from here.
        self.stats = EngineStats(window_s, spec.node_usd_per_hour)
        self.in_flight = 0
        self.replica_retries = 0
        # replica id -> its own totals (requests, output tokens, engine seconds, dollars, running,
        # waiting), whichever gateway replica sent the requests: read from every replica at each
        # scrape (refresh_replicas), so every gateway replica's /metrics shows the same numbers.
        self.replica_totals: dict[str, dict] = {}
        # One handle per method, made once: options() builds a new handle object each call.
        self._run_handle = handle.options(method_name="run")
        self._stream_handle = handle.options(method_name="stream", stream=True)

    def may_receive(self, data_class: DataClass) -> bool:
        return True  # inside the building

    def running(self) -> int:
        return min(self.in_flight, self.capacity)

    def waiting(self) -> int:
        return max(0, self.in_flight - self.capacity)

    async def start(self) -> None:
        pass  # the replicas are Ray's to start

    async def stop(self) -> None:
        pass

    def _kwargs(self, call: Call) -> dict:
        return {"affinity": affinity_key(call) if self.prefix_affinity else None}

    async def refresh_replicas(self, timeout_s: float = 5.0) -> None:
        """Every running replica's own totals (`EngineReplica.totals`), for a metrics scrape; a
        replica that does not answer in time keeps its last totals."""
        try:
            answers = await self.handle.broadcast("totals").results_async(timeout_s=timeout_s, return_exceptions=True)
        except Exception as error:  # no replica running yet, or the controller busy: the last totals stand
            log.warning("engine %s: replica totals not read (%s)", self.name, type(error).__name__)
            return
        for answer in answers:
            if isinstance(answer, dict):
                self.replica_totals[answer["replica"]] = answer

    def _answered(self, reply: Reply) -> Attempt:
        reply.raise_error()
        attempt = reply.attempt
        self.stats.record(busy_s=attempt.compute_s, tokens=attempt.completion_tokens)
        self.stats.record_request(attempt.seconds)
        return attempt

    def _retrying(self, error: BaseException) -> None:
        self.replica_retries += 1
        log.warning("engine %s: a replica was lost (%s); retrying the request on another", self.name,
                    type(error).__name__)

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        self.in_flight += 1
        try:
            for attempt in range(2):
                response = self._run_handle.remote(call, timeout_s, **self._kwargs(call))
                try:
                    # The replica times the engine out itself; the margin covers a replica that cannot answer.
                    reply = await asyncio.wait_for(response, timeout_s + 5)
                except REPLICA_LOST as error:
                    if attempt == 0:
                        self._retrying(error)
                        continue
                    raise replica_lost(self.name, error) from None
                except asyncio.TimeoutError:
                    response.cancel()
                    raise timed_out(self.name, timeout_s) from None
                except asyncio.CancelledError:  # the client went away: so does the replica's work
                    response.cancel()
                    raise
                return self._answered(reply)
            raise AssertionError("unreachable")
        finally:
            self.in_flight -= 1

    async def _open(self, call: Call, timeout_s: float) -> tuple[DeploymentResponseGenerator, Reply]:
        replies = self._stream_handle.remote(call, timeout_s, **self._kwargs(call))
        try:
            first = await asyncio.wait_for(replies.__anext__(), timeout_s + 5)
        except asyncio.TimeoutError:
            replies.cancel()
            raise timed_out(self.name, timeout_s) from None
        except BaseException:
            replies.cancel()
            raise
        return replies, first

    async def open_stream(self, call: Call, timeout_s: float) -> FleetStream:
        """Returns once a replica's engine accepted the request, so a refusal is still an HTTP error."""
        self.in_flight += 1
        try:
            try:
                replies, first = await self._open(call, timeout_s)
            except REPLICA_LOST as error:
                self._retrying(error)
                try:
                    replies, first = await self._open(call, timeout_s)
                except REPLICA_LOST as again:
                    raise replica_lost(self.name, again) from None
            first.raise_error()
        except BaseException:
            self.in_flight -= 1
            raise
        return FleetStream(self, call, timeout_s, replies)


def replayable(call: Call) -> bool:
    """Greedy (or seeded) decoding gives the same tokens on any replica of one engine: a stream cut
    mid-way can be run again elsewhere and resumed where the client is, once its text is checked."""
    return not call.sampling.temperature or call.sampling.seed is not None


class FleetStream:
    """The deltas of one request streamed from a replica; closing it early cancels the request there.

    A replica lost before any token: the request runs on another. After some: a greedy or seeded
    request runs again on another, its text up to what the client already has is checked and
    skipped, and the stream goes on; otherwise (or if the text differs) it ends with an error event.
    """

    def __init__(self, backend: FleetBackend, call: Call, timeout_s: float,
                 replies: DeploymentResponseGenerator) -> None:
        self.backend, self.call, self.timeout_s, self.replies = backend, call, timeout_s, replies
        self.attempt: Attempt | None = None
        self.sent = ""  # text the client has
        self.again: str | None = None  # after a retry: the new replica's text while it catches up
        self._released = False

    async def _replies(self) -> AsyncIterator[Reply]:
        retried = False
        while True:
            try:
                async for reply in self.replies:
                    yield reply
                return
            except REPLICA_LOST as error:
                if retried or (self.sent and not replayable(self.call)):
                    raise replica_lost(self.backend.name, error) from None
                retried = True
                self.backend._retrying(error)
                self.replies, first = await self.backend._open(self.call, self.timeout_s)
                first.raise_error()
                if self.sent:
                    self.again = ""

    def _caught_up(self, text: str) -> str:
        """The part of a retried replica's delta the client does not have yet ('' while catching up)."""
        self.again += text
        shorter = min(len(self.again), len(self.sent))
        if self.again[:shorter] != self.sent[:shorter]:
            raise self._differs()
        if len(self.again) <= len(self.sent):
            return ""
        new, self.again = self.again[len(self.sent):], None
        return new

    def _differs(self) -> APIError:
        return APIError(502, f"engine {self.backend.name!r}: the replica answering this stream was lost and "
                             "another's answer differs from what was sent", type="server_error", code="replica_lost")

    async def deltas(self) -> AsyncIterator[str]:
        try:
            async for reply in self._replies():
                if reply.kind in ("delta", "done") and reply.text:  # done carries the text held since the last delta
                    text = reply.text if self.again is None else self._caught_up(reply.text)
                    if text:
                        self.sent += text
                        yield text
                if reply.kind == "done":
                    if self.again is not None and self.again != self.sent:
                        raise self._differs()  # ended short of the text already sent
                    self.attempt = self.backend._answered(reply)
                    return
                elif reply.kind == "error":
                    reply.raise_error()
        finally:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.backend.in_flight -= 1

    async def aclose(self) -> None:
        if self.attempt is None:
            self.replies.cancel()
        self._release()
