"""Who may call: an `Authorization: Bearer` key to the request's `Caller`, or a 401.

    /v1/*     a key of the store (`nw-...`, `nowait keys create`): its tenant and what it allows,
              looked up on every request (reused only while the store is unchanged,
              keys.py), so a revoke or a change holds from the next request on; a key
              of `auth.api_keys` / `NOWAIT_API_KEYS`: the tenant `default`, without limits
    /admin/*  an admin key (`auth.admin_keys` / `NOWAIT_ADMIN_KEYS`) and nothing else

A server with no key anywhere (none configured, none in the store) is open, as the quick start
on loopback wants: its callers are the tenant `default`. A shared store that cannot be reached
answers a key it never read 503 `store_unavailable` (with Retry-After); keys it read before keep
working from that read (keys.py).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

from nowait.gateway.errors import APIError, store_unavailable
from nowait.gateway.keys import KEY_PREFIX, KeyRecord, KeyStore
from nowait.gateway.tenants import DEFAULT_CALLER, Caller
from nowait.store.database import StoreUnavailable

ADMIN_PREFIX = "/admin/"
KEY_PREFIX_BYTES = KEY_PREFIX.encode()


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def _matches(token: bytes, keys: list[bytes]) -> bool:
    # Every key is compared (no early exit), each in constant time: timing tells nothing.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/")


def needs_key(path: str) -> bool:
    """/v1 and /admin; health, readiness and metrics never need a key."""
    return path.startswith("/v1/") or is_admin_path(path)


class Authenticator:
    def __init__(self, api_keys: set[str], admin_keys: set[str], store: KeyStore,
                 clock: Callable[[], float] = time.time) -> None:
        self.api_keys = [k.encode() for k in api_keys]
        self.admin_keys = [k.encode() for k in admin_keys]
        self.store, self.clock = store, clock

    def open(self) -> bool:
        """No key anywhere: every /v1 request is the default tenant's (the loopback quick start)."""
        return not self.api_keys and not self.admin_keys and not self.store.any_keys()

    def admin(self, token: bytes) -> None:
        if not self.admin_keys:
            raise unauthorized("/admin needs an admin key, and this server has none: set NOWAIT_ADMIN_KEYS "
                               "(or auth.admin_keys), or use `nowait keys` on the server")
        if not _matches(token, self.admin_keys):
            raise unauthorized("Incorrect or missing admin key: /admin needs `Authorization: Bearer <admin key>` "
                               "with a key of NOWAIT_ADMIN_KEYS / auth.admin_keys")

    def record(self, token: bytes) -> KeyRecord | None:
        """The store's record of a `nw-` key (revoked and expired ones included), else None."""
        if not token.startswith(KEY_PREFIX_BYTES):
            return None
        try:
            secret = token.decode("ascii")
        except UnicodeDecodeError:
            return None
        return self.store.find(secret)

    def caller(self, token: bytes, record: KeyRecord | None = None) -> Caller:
        """The caller a /v1 key stands for, or a 401 that says only what the client may know;
        `record` is the store's for this token when the caller has already looked it up."""
        record = record if record is not None else self.record(token)
        if record is not None:
            if record.revoked_at is not None:
                raise unauthorized(f"API key {record.id} has been revoked")
            if not record.usable_at(self.clock()):
                raise unauthorized(f"API key {record.id} has expired")
            return record.caller()
        if token and _matches(token, self.api_keys):
            return DEFAULT_CALLER
        raise unauthorized("Incorrect or missing API key: send `Authorization: Bearer <key>` with a key "
                           "from `nowait keys create` or the gateway's configuration")

    def authenticate(self, path: str, header: bytes) -> Caller | None:
        """The caller of a request to `path`; None where no key is needed (health, metrics)."""
        scheme, _, token = header.partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        if is_admin_path(path):
            self.admin(token)
            return None
        if not needs_key(path):
            return None
        try:
            # A key the store holds means the server is not open: the common keyed request asks
            # the store once, not a second time for whether it holds any key.
            record = self.record(token)
            if record is None and self.open():
                return DEFAULT_CALLER
            return self.caller(token, record)
        except StoreUnavailable as error:  # a shared store down, this key not read before it went (keys.py)
            raise store_unavailable(str(error)) from None
