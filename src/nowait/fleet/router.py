"""Which replica of an engine takes a request (Ray Serve's RequestRouter API): the least loaded,
by what the replicas report (running + waiting, `EngineReplica.record_routing_stats`) and what
Ray counts in flight to each since; for AR, the replica that last took a prompt with the same
beginning when its load is within `load_slack` of the least loaded, since its prefix cache likely
holds that prefix (a cache hit skips the prefill of the shared part).

The routing rule (which engine) stays the gateway's; this only picks among one engine's replicas.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Callable

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

DEFAULT_LOAD_SLACK = 2  # requests: closer than this, a likely cache hit beats the shorter queue
AFFINITY_ENTRIES = 4096  # prompt beginnings remembered (least recently routed forgotten first)


def replica_load(stats: dict, *in_flight: int | None) -> int:
    """Requests on a replica: its report (up to a stats period old), or a newer count of what was
    sent to it (this router's own, Ray's probe) when that is higher."""
    reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
    return max(reported, *(n or 0 for n in in_flight))


def preference(loads: dict[ReplicaID, int], affine: ReplicaID | None, slack: int,
               tie: Callable[[], float] = random.random) -> list[ReplicaID]:
    """Replicas from most to least preferred: by load (ties in random order, so equal replicas
    share the work), the affine one first when its load is close."""
    order = sorted(loads, key=lambda r: (loads[r], tie()))
    if affine in loads and loads[affine] <= loads[order[0]] + slack:
        order.remove(affine)
        order.insert(0, affine)
    return order


class NowaitRequestRouter(RequestRouter):
    """Least loaded replica first; prefix affinity for requests that carry an `affinity` key."""

    def initialize_state(self, load_slack: int = DEFAULT_LOAD_SLACK, **kwargs) -> None:
        self.load_slack = load_slack
        self.affinity: OrderedDict[str, ReplicaID] = OrderedDict()
        self.sent: Counter[ReplicaID] = Counter()  # requests this router has in flight, per replica
        self.sent_to: dict[str, ReplicaID] = {}

    def _load(self, replica: RunningReplica) -> int:
        rid = replica.replica_id
        return replica_load(replica.routing_stats or {}, self.sent.get(rid), self.replica_queue_len_cache.get(rid))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        affine = self.affinity.get(key) if key else None
        order = preference({rid: self._load(r) for rid, r in by_id.items()}, affine,
                           getattr(self, "load_slack", DEFAULT_LOAD_SLACK))
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica full: wait, do not spin
        return [[by_id[rid]] for rid in order]  # one per rank: Ray tries them in this order

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if not hasattr(self, "sent"):  # initialize_state has not run
            return
        self.sent[replica_id] += 1
        self.sent_to[pending_request.metadata.internal_request_id] = replica_id
        key = pending_request.kwargs.get("affinity")
        if not key:
            return
        self.affinity[key] = replica_id
        self.affinity.move_to_end(key)
        while len(self.affinity) > AFFINITY_ENTRIES:
            self.affinity.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.sent_to.pop(internal_request_id, None) is not None and self.sent[replica_id] > 0:
            self.sent[replica_id] -= 1
