"""The gateway's domain objects: a parsed request (`Call`), one engine's run of it (`Attempt`), and
the interface every engine the gateway drives offers (`Backend`), owned or remote.

HTTP handlers and the batch runner turn OpenAI bodies into `Call`s (calls.py); the dispatcher
routes a Call to backends and collects Attempts (dispatch.py); responses.py turns the result back
into OpenAI objects. Nothing here knows about HTTP.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol

from nowait.gateway.tenants import Caller, current_caller
from nowait.router import DataClass, RouteRequest

if TYPE_CHECKING:
    from nowait.gateway.engine_stats import EngineStats
    from nowait.gateway.logprobs import LogprobEntry


@dataclass(frozen=True)
class Metadata:
    """What the routing rule reads from a request (body `nowait` object, `x-nowait-*` headers, defaults)."""

    latency_budget_ms: float | None
    token_value_usd_per_mtok: float
    data_class: DataClass
    batchable: bool

    def route_request(self) -> RouteRequest:
        return RouteRequest(batchable=self.batchable, latency_budget_ms=self.latency_budget_ms,
                            token_value_usd_per_mtok=self.token_value_usd_per_mtok, data_class=self.data_class)


@dataclass(frozen=True)
class Sampling:
    """Sampling as the client gave it; None means "not given" (owned engines then decode greedily,
    remote ones apply their own defaults)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Call:
    """One generation the gateway must answer (a chat request, or one prompt of a completions request)."""

    request_id: str
    endpoint: Literal["chat", "completions"]
    model: str
    meta: Metadata
    sampling: Sampling = field(default_factory=Sampling)
    messages: list[dict[str, str]] | None = None  # chat: role/content strings
    prompt: str | list[int] | None = None  # completions: text or token ids
    schema: dict | None = None  # JSON Schema the answer must satisfy (response_format)
    json_mode: bool = False  # response_format asked for JSON (json_object or json_schema)
    response_format: dict | None = None  # as the client sent it, for remote upstreams
    logprobs: int | None = None  # None: not asked; k: each token's logprob and its k most likely alternatives
    arrival: float = field(default_factory=time.perf_counter)
    # On fallback: the fast engine's answer, which a speculative fallback engine verifies as its
    # draft (the output is still the fallback model's own); other engines ignore it.
    draft_text: str | None = None
    # Who asked (tenant, key id, what the key allows): the request's or batch line's (tenants.py).
    caller: Caller = field(default_factory=current_caller)

    def __post_init__(self) -> None:
        # A key's data-class floor holds whatever the request declares: a restricted key's
        # request is restricted, so no rule or pin can send it off the premises.
        floored = self.caller.floored(self.meta.data_class)
        if floored != self.meta.data_class:
            self.meta = replace(self.meta, data_class=floored)


@dataclass
class Attempt:
    """One engine's run of a Call: its answer (or why it has none), tokens, time and cost."""

    engine: str
    text: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from a prefix cache
    completion_tokens: int = 0
    confidence: float | None = None  # None: the engine gave none (a remote fast engine without logprobs)
    confidence_missing: str = ""  # why there is none, where one was needed (the fallback's reason says it)
    seconds: float = 0.0  # wall time, submission to answer
    queued_s: float = 0.0
    first_token_s: float | None = None
    compute_s: float = 0.0  # the engine's busy time attributed to this request
    forwards: int | None = None  # model forwards the answer took (owned engines; the load bench reads it)
    cost_usd: float = 0.0
    outcome: str = ""  # finish reason, or what went wrong
    logprobs: list[LogprobEntry] | None = None  # of the answer's tokens, when the call asked

    def __post_init__(self) -> None:
        self.outcome = self.outcome or self.finish_reason


class AttemptStream(Protocol):
    """Text deltas of one attempt; `attempt` is complete once the iteration ends."""

    attempt: Attempt | None

    def deltas(self) -> AsyncIterator[str]: ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    """An engine as the gateway drives it: an owned engine worker or a remote upstream."""

    name: str
    kind: str  # ar | spec | diffusion | remote
    owned: bool  # inside the building (in process, or an on-premises upstream)
    available: bool
    unavailable_reason: str
    stats: EngineStats
    admits: int  # requests it accepts at once (running and queued); one more gets 429

    def may_receive(self, data_class: DataClass) -> bool: ...

    async def run(self, call: Call, timeout_s: float) -> Attempt: ...

    async def open_stream(self, call: Call, timeout_s: float) -> AttemptStream: ...

    def running(self) -> int: ...

    def waiting(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
