"""The routing rule of docs/mission.md as one small, pure policy.

Two axes decide where a request goes: can it wait to be batched, and what is each token worth.
A third, the data class, only ever narrows the choice: restricted data never leaves the building.

    batchable (or a latency budget long enough to wait for a batch)  -> the batch engine (AR, continuous batching)
    high value (token value >= the policy's threshold)               -> the frontier engine: a remote API if the
                                                                        data class may go there, else owned
    latency-bound and low value                                      -> the fast engine (diffusion), with a
                                                                        fallback to AR below the confidence threshold

The gateway calls `route` per request (`pin` when the caller names an engine itself),
`should_fall_back` per diffusion answer and `failover` when a remote engine fails; the planner
calls the same `route` once per workload. Nothing here does I/O, so every decision is reproducible
from its inputs, and `Decision.reason` is the sentence that goes to the audit log.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DataClass(str, Enum):
    public = "public"
    internal = "internal"
    restricted = "restricted"  # never leaves the building, whatever a remote engine's config says


class RemoteEngine(BaseModel):
    """An engine outside the building (an external API); it may receive only the data classes listed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    data_classes: tuple[DataClass, ...] = (DataClass.public,)

    @field_validator("data_classes")
    @classmethod
    def _restricted_never_leaves(cls, classes: tuple[DataClass, ...]) -> tuple[DataClass, ...]:
        if DataClass.restricted in classes:
            raise ValueError("restricted data never leaves: a remote engine cannot list 'restricted'")
        return classes

    def may_receive(self, data_class: DataClass) -> bool:
        return data_class is not DataClass.restricted and data_class in self.data_classes


# Used when neither the config nor a calibration file (`nowait calibrate`) gives a threshold.
DEFAULT_CONFIDENCE_THRESHOLD = 0.9
# An answer (of any engine) whose confidence is below its engine's floor is not handed back as an
# ordinary one (`routing.low_confidence`). Far below the fallback threshold: the floor catches
# answers no engine was sure of (docs/gateway.md, "Low-confidence answers").
DEFAULT_CONFIDENCE_FLOOR = 0.5
LowConfidenceMode = Literal["flag", "frontier", "reject"]


def schema_hash(schema: dict) -> str:
    """The key of a JSON Schema's own calibrated threshold: SHA-256 of its canonical JSON (keys
    sorted, no spaces), so the same schema sent with other key order or spacing finds it."""
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class KindThreshold(BaseModel):
    """A document kind's calibrated threshold, found by its schema's property names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: float = Field(ge=0)
    fields: tuple[str, ...]


class RoutingPolicy(BaseModel):
    """The thresholds and engine names the rule needs; the gateway and the planner read it from their configs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    high_value_usd_per_mtok: float = Field(5.0, ge=0, description="a token worth at least this is high value")
    confidence_threshold: float = Field(DEFAULT_CONFIDENCE_THRESHOLD, ge=0,
                                        description="diffusion answers below it re-run on AR (above 1: every "
                                                    "one, as a calibration that reached no target leaves it)")
    batchable_budget_ms: float | None = Field(
        None, gt=0, description="a latency budget at least this long can wait for a batch (None: only the flag)")
    owned_engines: tuple[str, ...] = ("ar", "spec", "diffusion")
    batch_engine: str = "ar"
    fast_engine: str | None = "diffusion"
    fallback_engine: str = "ar"
    owned_frontier_engine: str = "ar"
    remote_frontier_engines: tuple[RemoteEngine, ...] = ()  # in order of preference
    # Calibrated thresholds finer than the global one (`nowait calibrate`): by schema hash, by kind.
    schema_thresholds: dict[str, float] = Field(default_factory=dict)
    kind_thresholds: dict[str, KindThreshold] = Field(default_factory=dict)
    confidence_floors: dict[str, float] = Field(default_factory=dict, description="engine -> floor (absent: "
                                                f"{DEFAULT_CONFIDENCE_FLOOR:g})")
    low_confidence: LowConfidenceMode = "flag"

    @model_validator(mode="after")
    def _engines_exist(self) -> RoutingPolicy:
        named = {"batch_engine": self.batch_engine, "fallback_engine": self.fallback_engine,
                 "owned_frontier_engine": self.owned_frontier_engine}
        if self.fast_engine is not None:
            named["fast_engine"] = self.fast_engine
        for field, engine in named.items():
            if engine not in self.owned_engines:
                raise ValueError(f"{field}: {engine!r} is not one of the owned engines {list(self.owned_engines)}")
        return self


@dataclass(frozen=True)
class RouteRequest:
    """What the rule reads from a request (the gateway's `nowait` fields, or a planner workload)."""

    batchable: bool
    latency_budget_ms: float | None
    token_value_usd_per_mtok: float
    data_class: DataClass = DataClass.internal


@dataclass(frozen=True)
class Decision:
    engine: str
    reason: str
    fallback_engine: str | None = None
    rule: str = ""  # "batch", "frontier", "fast" or "pinned": which branch of the rule decided


class DataClassViolation(PermissionError):
    """Raised before anything is sent where the data class forbids it."""


def can_wait_for_batch(request: RouteRequest, policy: RoutingPolicy) -> bool:
    if request.batchable:
        return True
    budget = request.latency_budget_ms
    return policy.batchable_budget_ms is not None and budget is not None and budget >= policy.batchable_budget_ms


def is_high_value(request: RouteRequest, policy: RoutingPolicy) -> bool:
    return request.token_value_usd_per_mtok >= policy.high_value_usd_per_mtok


def route(request: RouteRequest, policy: RoutingPolicy) -> Decision:
    """The engine for one request, and the reason in one sentence."""
    data_class = DataClass(request.data_class)
    value = f"${request.token_value_usd_per_mtok:g}/Mtok"
    if can_wait_for_batch(request, policy):
        why = "marked batchable" if request.batchable else (
            f"a {request.latency_budget_ms:g} ms budget can wait for a batch (>= {policy.batchable_budget_ms:g} ms)")
        return Decision(policy.batch_engine, f"{why}: AR with continuous batching is already efficient "
                                             f"there, whatever the token value ({value})", rule="batch")
    if is_high_value(request, policy):
        threshold = f"${policy.high_value_usd_per_mtok:g}/Mtok"
        for remote in policy.remote_frontier_engines:
            if remote.may_receive(data_class):
                return Decision(remote.name, f"high value ({value} >= {threshold}) and {data_class.value} data "
                                             f"may go to {remote.name}: the frontier model", rule="frontier")
        where = ("restricted data never leaves the building" if data_class is DataClass.restricted
                 else f"no remote frontier engine may receive {data_class.value} data"
                 if policy.remote_frontier_engines else "no remote frontier engine is configured")
        return Decision(policy.owned_frontier_engine,
                        f"high value ({value} >= {threshold}) and {where}: the owned frontier engine", rule="frontier")
    if policy.fast_engine is None:
        return Decision(policy.batch_engine, "latency-bound but no fast (diffusion) engine is available: AR",
                        rule="fast")
    budget = "no stated budget" if request.latency_budget_ms is None else f"a {request.latency_budget_ms:g} ms budget"
    fallback, rerun = fast_fallback(policy)
    return Decision(policy.fast_engine,
                    f"latency-bound ({budget}) and low value ({value}): diffusion clears a request in a few "
                    f"parallel passes; {rerun}", fallback_engine=fallback, rule="fast")


def fast_fallback(policy: RoutingPolicy) -> tuple[str | None, str]:
    """The fast engine's fallback and what the reason says of it. A fast engine that is its own
    fallback (a one-engine config) has none: a re-run on the same weights is the same answer, paid twice."""
    if policy.fallback_engine == policy.fast_engine:
        return None, f"{policy.fast_engine} is its own fallback: no re-run"
    return policy.fallback_engine, (f"answers below confidence {policy.confidence_threshold:g} re-run on "
                                    f"{policy.fallback_engine}")


def threshold_for(schema: dict | None, policy: RoutingPolicy) -> tuple[float, str]:
    """The fallback threshold of a request and where it came from: its schema's own (by hash),
    else its document kind's (the kind whose fields the schema's properties are), else the global one."""
    if schema is not None:
        found = policy.schema_thresholds.get(schema_hash(schema))
        if found is not None:
            return found, "schema"
        properties = schema.get("properties")
        names = sorted(properties) if isinstance(properties, dict) else None
        for kind, entry in policy.kind_thresholds.items():
            if names is not None and sorted(entry.fields) == names:
                return entry.threshold, f"kind {kind}"
    return policy.confidence_threshold, "global"


def below_threshold(confidence: float, threshold: float) -> bool:
    """A NaN confidence (a half-precision model's overflow) is not at or above any threshold."""
    return not confidence >= threshold


def should_fall_back(confidence: float, policy: RoutingPolicy, schema: dict | None = None) -> bool:
    """A diffusion answer below the request's threshold (`threshold_for`) is re-run on the
    fallback engine (both runs are paid for)."""
    return below_threshold(confidence, threshold_for(schema, policy)[0])


def confidence_floor(engine: str, policy: RoutingPolicy) -> float:
    return policy.confidence_floors.get(engine, DEFAULT_CONFIDENCE_FLOOR)


def below_floor(engine: str, confidence: float | None, policy: RoutingPolicy) -> bool:
    """An answer below its engine's floor; one without a confidence (a remote upstream without
    logprobs) has nothing to compare, and a NaN one is below."""
    return confidence is not None and not confidence >= confidence_floor(engine, policy)


def low_confidence_rerun(data_class: DataClass, tried: set[str], policy: RoutingPolicy) -> str | None:
    """Where `routing.low_confidence: frontier` re-runs a low-confidence answer: the frontier
    engine `route` would give high-value work of this data class (a remote one only if it may
    receive it; restricted data never leaves), unless it already answered. None: flag instead."""
    if policy.low_confidence != "frontier":
        return None
    data_class = DataClass(data_class)
    remote = next((r.name for r in policy.remote_frontier_engines if r.may_receive(data_class)), None)
    engine = remote or policy.owned_frontier_engine
    return None if engine in tried else engine


def check_destination(engine: str, data_class: DataClass, policy: RoutingPolicy) -> None:
    """Refuse to send `data_class` to a remote engine that may not receive it (the last check before I/O)."""
    data_class = DataClass(data_class)
    for remote in policy.remote_frontier_engines:
        if remote.name == engine and not remote.may_receive(data_class):
            raise DataClassViolation(f"{data_class.value} data may not be sent to remote engine {engine!r}")
    if engine not in policy.owned_engines and engine not in {r.name for r in policy.remote_frontier_engines}:
        raise DataClassViolation(f"unknown engine {engine!r}: neither owned nor a configured remote engine")


def pin(engine: str, policy: RoutingPolicy) -> Decision:
    """A request that names its engine itself (a model name other than the router's).

    The caller chooses, but two things still hold: a remote engine may receive only the data
    classes it allows (the caller of `pin` checks with `RemoteEngine.may_receive` or
    `check_destination` as its last step before any I/O), and the fast engine keeps its confidence
    fallback, because a diffusion answer below the threshold is not one to hand back.
    """
    if engine == policy.fast_engine:
        fallback, rerun = fast_fallback(policy)
        return Decision(engine, f"the caller asked for {engine}; {rerun}", fallback_engine=fallback, rule="pinned")
    return Decision(engine, f"the caller asked for {engine}", rule="pinned")


def failover(engine: str, policy: RoutingPolicy) -> str | None:
    """Where a request goes when remote `engine` fails (unreachable, 5xx, timeout): the owned
    frontier engine, which may receive every data class. None for an owned engine: its failure
    is the answer (re-running the same weights elsewhere would fail the same way)."""
    if engine in {r.name for r in policy.remote_frontier_engines}:
        return policy.owned_frontier_engine
    return None


def restrict_to_available(policy: RoutingPolicy, available: set[str]) -> RoutingPolicy:
    """The policy without the engines that cannot serve now (a model not trained yet, a remote
    without its API key): an unavailable fast engine sends latency-bound work to AR, an
    unavailable remote leaves high-value work on the owned frontier engine. The owned batch,
    fallback and frontier engines stay named even when down: there is no substitute for them,
    and the caller gets a clear error instead."""
    fast = policy.fast_engine if policy.fast_engine in available else None
    remotes = tuple(r for r in policy.remote_frontier_engines if r.name in available)
    return policy.model_copy(update={"fast_engine": fast, "remote_frontier_engines": remotes})
