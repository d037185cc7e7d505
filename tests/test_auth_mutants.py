"""Who may call (gateway/auth.py), on a stand-in key store: which paths need a key, what a key of
the store, of the configuration or of the admins stands for, and the 401 each wrong key gets.
Written against mutmut's survivors (docs/testing.md)."""

from __future__ import annotations

import pytest

from nowait.gateway.auth import Authenticator, _matches, is_admin_path, needs_key
from nowait.gateway.errors import APIError
from nowait.gateway.keys import KeyRecord
from nowait.gateway.tenants import DEFAULT_CALLER
from nowait.router import DataClass
from nowait.store.database import StoreUnavailable

SECRET = "nw-live-secret"
NOW = 1_000_000.0


class FakeKeyStore:
    def __init__(self, records: dict[str, KeyRecord] | None = None) -> None:
        self.records = records or {}
        self.asked: list[str] = []
        self.asked_any = 0

    def find(self, secret: str) -> KeyRecord | None:
        self.asked.append(secret)
        return self.records.get(secret)

    def any_keys(self) -> bool:
        self.asked_any += 1
        return bool(self.records)


def record(**fields) -> KeyRecord:
    return KeyRecord(**{"id": "key_1", "tenant": "team-a", "created_at": 0, **fields})


def authenticator(api_keys=(), admin_keys=(), records=None) -> tuple[Authenticator, FakeKeyStore]:
    store = FakeKeyStore(records)
    return Authenticator(set(api_keys), set(admin_keys), store, clock=lambda: NOW), store


def rejected(call, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    return caught.value


@pytest.mark.parametrize(("path", "admin", "key"), [
    ("/admin/keys", True, True), ("/admin", True, True), ("/administrator", False, False),
    ("/v1/chat/completions", False, True), ("/v1", False, False), ("/healthz", False, False),
    ("/metrics", False, False), ("/x/admin/", False, False)])
def test_which_paths_need_which_key(path, admin, key):
    assert is_admin_path(path) is admin and needs_key(path) is key


def test_every_key_is_compared():
    assert _matches(b"b", [b"a", b"b", b"c"]) and _matches(b"c", [b"a", b"b", b"c"])
    assert not _matches(b"d", [b"a", b"b"]) and not _matches(b"a", [])


def test_a_store_key_is_its_tenant_with_what_it_allows():
    stored = record(models=("ar",), data_class_floor=DataClass.restricted, requests_per_minute=5)
    auth, store = authenticator(api_keys={"sk-config"}, records={SECRET: stored})
    caller = auth.authenticate("/v1/chat/completions", f"Bearer {SECRET}".encode())
    assert caller == stored.caller() and caller.tenant == "team-a" and caller.key_id == "key_1"
    assert store.asked == [SECRET]
    assert auth.authenticate("/v1/models", b"bearer   " + SECRET.encode() + b"  ") == stored.caller()


def test_a_found_store_key_is_looked_up_once_and_the_store_not_asked_whether_it_holds_any():
    auth, store = authenticator(records={SECRET: record(), "nw-revoked": record(id="key_2", revoked_at=5)})
    assert auth.authenticate("/v1/models", f"Bearer {SECRET}".encode()).key_id == "key_1"
    assert store.asked == [SECRET] and store.asked_any == 0  # found: the server cannot be open
    error = rejected(auth.authenticate, "/v1/models", b"Bearer nw-revoked")
    assert error.message == "API key key_2 has been revoked" and store.asked == [SECRET, "nw-revoked"]
    rejected(auth.authenticate, "/v1/models", b"Bearer nw-unknown")  # not found: is the server open?
    assert store.asked_any == 1
    open_server, empty = authenticator()
    assert open_server.authenticate("/v1/models", b"Bearer nw-anything") is DEFAULT_CALLER
    assert empty.asked == ["nw-anything"] and empty.asked_any == 1


def test_revoked_and_expired_store_keys_are_401_naming_the_key():
    auth, _ = authenticator(records={SECRET: record(revoked_at=5)})
    assert rejected(auth.caller, SECRET.encode()).message == "API key key_1 has been revoked"
    auth, _ = authenticator(records={SECRET: record(expires_at=int(NOW))})
    assert rejected(auth.caller, SECRET.encode()).message == "API key key_1 has expired"
    auth, _ = authenticator(records={SECRET: record(expires_at=int(NOW) + 1)})
    assert auth.caller(SECRET.encode()).key_id == "key_1"


def test_a_configured_key_is_the_default_tenant():
    auth, store = authenticator(api_keys={"sk-one", "nw-configured"})
    assert auth.caller(b"sk-one") is DEFAULT_CALLER
    assert auth.caller(b"nw-configured") is DEFAULT_CALLER  # looked up in the store first, then here
    assert store.asked == ["nw-configured"]


@pytest.mark.parametrize(("token", "looked_up"), [
    (b"", []), (b"sk-wrong", []), (b"nw-unknown", ["nw-unknown"]), (b"nw-\xff\xfe", [])])
def test_an_unknown_key_is_401(token, looked_up):
    auth, store = authenticator(api_keys={"sk-one"}, records={SECRET: record()})
    error = rejected(auth.caller, token)
    assert error.message == ("Incorrect or missing API key: send `Authorization: Bearer <key>` with a key from "
                             "`nowait keys create` or the gateway's configuration")
    assert store.asked == looked_up  # only a key that looks like the store's, and decodes, is looked up


def test_an_empty_token_never_matches_even_an_empty_configured_key():
    auth, _ = authenticator(api_keys={""})
    rejected(auth.caller, b"")


def test_the_scheme_must_be_bearer():
    auth, _ = authenticator(api_keys={"sk-one"})
    assert auth.authenticate("/v1/models", b"Bearer sk-one") is DEFAULT_CALLER
    rejected(auth.authenticate, "/v1/models", b"Basic sk-one")
    rejected(auth.authenticate, "/v1/models", b"sk-one")


def test_admin_paths_need_an_admin_key_and_nothing_else():
    auth, _ = authenticator(api_keys={"sk-one"}, admin_keys={"adm-1", "adm-2"}, records={SECRET: record()})
    assert auth.authenticate("/admin/keys", b"Bearer adm-2") is None
    for token in (b"sk-one", SECRET.encode(), b""):
        error = rejected(auth.authenticate, "/admin/keys", b"Bearer " + token)
        assert error.message == ("Incorrect or missing admin key: /admin needs `Authorization: Bearer <admin key>` "
                                 "with a key of NOWAIT_ADMIN_KEYS / auth.admin_keys")
    none, _ = authenticator(api_keys={"sk-one"})
    error = rejected(none.authenticate, "/admin", b"Bearer sk-one")
    assert error.message == ("/admin needs an admin key, and this server has none: set NOWAIT_ADMIN_KEYS "
                             "(or auth.admin_keys), or use `nowait keys` on the server")


def test_paths_without_a_key_are_let_through_and_an_open_server_is_the_default_tenant():
    auth, _ = authenticator(api_keys={"sk-one"})
    assert auth.authenticate("/healthz", b"") is None and auth.authenticate("/metrics", b"Bearer nope") is None
    open_server, _ = authenticator()
    assert open_server.open() and open_server.authenticate("/v1/models", b"") is DEFAULT_CALLER
    for closed in (authenticator(api_keys={"k"})[0], authenticator(admin_keys={"a"})[0],
                   authenticator(records={SECRET: record()})[0]):
        assert not closed.open()
        rejected(closed.authenticate, "/v1/models", b"")


def test_the_clock_decides_expiry():
    store = FakeKeyStore({SECRET: record(expires_at=100)})
    times = iter([99.0, 100.0])
    auth = Authenticator(set(), set(), store, clock=lambda: next(times))
    assert auth.caller(SECRET.encode()).tenant == "team-a"
    rejected(auth.caller, SECRET.encode())


class UnreachableStore(FakeKeyStore):
    def find(self, secret: str) -> KeyRecord | None:
        raise StoreUnavailable("the store postgresql://db/nowait is unavailable")


def test_a_store_that_cannot_be_reached_is_a_503_naming_it():
    auth = Authenticator({"sk-one"}, set(), UnreachableStore({SECRET: record()}), clock=lambda: NOW)
    with pytest.raises(APIError) as caught:
        auth.authenticate("/v1/models", f"Bearer {SECRET}".encode())
    assert (caught.value.status, caught.value.code) == (503, "store_unavailable")
    assert "the store postgresql://db/nowait is unavailable" in caught.value.message
    assert auth.authenticate("/v1/models", b"Bearer sk-one") is DEFAULT_CALLER  # a configured key needs no store
