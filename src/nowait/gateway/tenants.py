"""Who is calling: the authenticated `Caller` of a request (its tenant, its key and what the key
allows), and where each layer finds it.

The auth layer (middleware.py) records the Caller before any route runs, twice: in the ASGI
scope's state (`request.state.caller`, `scope["state"]["caller"]`) and in the context variable
`CURRENT_CALLER`, which every `Call` built while the request runs takes as its `Call.caller`
(domain.py). So no route can forget to stamp it, and the dispatcher, the ledger and the audit log
read the tenant and the key id from the Call. A batch line runs as the key that created its batch
(the batch runner sets the variable for the line). A Call's data class is never below its
caller's floor. The key records live in keys.py; the rate limits and budgets in limits.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from nowait.router import DataClass

DEFAULT_TENANT = "default"  # the keys of auth.api_keys / NOWAIT_API_KEYS, and an open server's callers

_STRICTNESS = list(DataClass)  # public < internal < restricted


def stricter(first: DataClass, second: DataClass | None) -> DataClass:
    """The stricter of two data classes (None: no constraint)."""
    if second is None:
        return DataClass(first)
    return max(DataClass(first), DataClass(second), key=_STRICTNESS.index)


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of one request: its tenant, the id of its key (None for a key of the
    configuration or an open server) and what that key allows."""

    tenant: str = DEFAULT_TENANT
    key_id: str | None = None
    allowed_models: frozenset[str] | None = None  # router model and engine names; None: every model
    data_class_floor: DataClass | None = None  # every request is treated as at least this class
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens of answered requests
    budget_usd_per_day: float | None = None  # the tenant's ledger cost per UTC day

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def floored(self, data_class: DataClass) -> DataClass:
        """The data class a request of this caller is treated as."""
        return stricter(data_class, self.data_class_floor)

    @cached_property  # asked two or three times a request; a frozen dataclass's fields never change
    def limited(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                            self.budget_usd_per_day))


DEFAULT_CALLER = Caller()  # a key of the configuration, or anyone on an open (keyless, loopback) server


# The caller of the request (or batch line) being served in this context: asyncio copies it into
# the tasks a request starts, and a Call takes it by default.
CURRENT_CALLER: ContextVar[Caller] = ContextVar("nowait_caller", default=DEFAULT_CALLER)


def current_caller() -> Caller:
    return CURRENT_CALLER.get()


def set_caller(scope: dict[str, Any], caller: Caller) -> None:
    """Record the caller of an ASGI request (before the routes run, in the request's own task)."""
    scope.setdefault("state", {})["caller"] = caller
    CURRENT_CALLER.set(caller)


def caller_in(scope: Mapping[str, Any]) -> Caller:
    """The caller the auth layer recorded; the default tenant where none did (an open server)."""
    return (scope.get("state") or {}).get("caller", DEFAULT_CALLER)


def models_named(names: Iterable[str] | None) -> frozenset[str] | None:
    """Allowed models from a list (None or empty: every model)."""
    models = frozenset(n.strip() for n in names or () if n.strip())
    return models or None
