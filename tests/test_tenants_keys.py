"""Keys as records: the secret shown once and stored only as its hash; the keys commands through
the real `nowait` app; /admin/keys for admin keys only; 401 for revoked, expired, malformed and
unknown keys, a revoke honoured on the next request; the configured keys as the tenant `default`;
a server without any key open, until a key exists."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from nowait.cli import app as nowait_app
from nowait.gateway.keys import KeySettings, SqliteKeyStore, secret_hash
from nowait.router import DataClass
from tests.gateway_support import API_KEY
from tests.tenant_support import ADMIN_KEY, ManualClock, bearer, chat, create_key, tenant_config, tenant_server

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("tenant-keys")
    config, path = tenant_config(root, codec)
    clock = ManualClock()
    with tenant_server(config, clock) as live:
        yield live, path, clock


def store_bytes(database: Path) -> bytes:
    """Everything SQLite wrote for a store: the file and its write-ahead log."""
    return b"".join(p.read_bytes() for p in (database, Path(f"{database}-wal")) if p.exists())


def models_status(server, key: str | None) -> httpx.Response:
    return httpx.get(f"{server.base_url}/v1/models", headers=bearer(key), timeout=30)


# --- the record and its secret ---

def test_a_new_key_is_a_long_random_secret_stored_only_as_its_hash(tmp_path):
    store = SqliteKeyStore(tmp_path / "keys.sqlite")
    secret, record = store.create(KeySettings(tenant="teamA", models=("ar",),
                                              data_class_floor=DataClass.restricted))
    other, _ = store.create(KeySettings(tenant="teamA"))
    assert secret.startswith("nw-") and secret != other
    assert len(secret.removeprefix("nw-")) * 6 >= 128  # url-safe base64: 6 bits a character
    assert record.id.startswith("key_") and record.tenant == "teamA"
    assert store.find(secret) == record and store.find(secret + "x") is None
    store.close()
    written = store_bytes(tmp_path / "keys.sqlite")
    assert secret.encode() not in written and secret.removeprefix("nw-").encode() not in written
    assert hashlib.sha256(secret.encode()).hexdigest().encode() in written  # the right bytes were read


def test_the_server_store_never_holds_a_secret_in_clear(setup):
    server, _, _ = setup
    created = create_key(server, "teamA")
    assert chat(server, created["key"]).status_code == 200
    written = store_bytes(server.gateway.config.key_database)
    assert created["key"].encode() not in written
    assert secret_hash(created["key"]).encode() in written


# --- the commands ---

def test_keys_commands_create_list_and_revoke_and_show_the_secret_once(setup):
    server, path, _ = setup
    made = runner.invoke(nowait_app, ["keys", "create", "--tenant", "teamCli", "--models", "ar,spec",
                                      "--data-class-floor", "internal", "--rpm", "30", "--tpm", "5000",
                                      "--budget-usd-per-day", "2.5", "--expires-in-days", "7", "--config",
                                      str(path), "--json"])
    assert made.exit_code == 0, made.output
    created = json.loads(made.stdout)
    assert created["key"].startswith("nw-") and created["id"].startswith("key_") and created["tenant"] == "teamCli"
    assert created["models"] == ["ar", "spec"] and created["data_class_floor"] == "internal"
    assert created["requests_per_minute"] == 30 and created["tokens_per_minute"] == 5000
    assert created["budget_usd_per_day"] == 2.5 and created["expires_at"] - created["created_at"] == 7 * 86400

    plain = runner.invoke(nowait_app, ["keys", "create", "--tenant", "teamCli", "--config", str(path)])
    assert plain.exit_code == 0, plain.output
    plain_secret = [line for line in plain.stdout.splitlines() if line.startswith("nw-")]
    assert len(plain_secret) == 1 and plain.stdout.count(plain_secret[0]) == 1

    # The running server takes the new key at once (no restart).
    assert chat(server, created["key"]).status_code == 200

    for args in (["keys", "list", "--config", str(path)], ["keys", "list", "--tenant", "teamCli", "--config",
                                                           str(path), "--json"]):
        listed = runner.invoke(nowait_app, args)
        assert listed.exit_code == 0, listed.output
        assert created["id"] in listed.stdout
        assert created["key"] not in listed.stdout and plain_secret[0] not in listed.stdout
        assert "nw-" not in listed.stdout
    records = json.loads(runner.invoke(nowait_app, ["keys", "list", "--tenant", "teamCli", "--config", str(path),
                                                    "--json"]).stdout)
    assert {r["tenant"] for r in records} == {"teamCli"} and len(records) == 2

    revoked = runner.invoke(nowait_app, ["keys", "revoke", created["id"], "--config", str(path)])
    assert revoked.exit_code == 0 and created["id"] in revoked.stdout
    after = json.loads(runner.invoke(nowait_app, ["keys", "list", "--tenant", "teamCli", "--config", str(path),
                                                  "--json"]).stdout)
    assert [r["revoked_at"] is not None for r in after if r["id"] == created["id"]] == [True]
    # Honoured by the running server on the next request.
    refused = chat(server, created["key"])
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"

    unknown = runner.invoke(nowait_app, ["keys", "revoke", "key_nosuchkey", "--config", str(path)])
    assert unknown.exit_code == 2 and "key_nosuchkey" in unknown.output
    bad_floor = runner.invoke(nowait_app, ["keys", "create", "--tenant", "x", "--data-class-floor", "secret",
                                           "--config", str(path)])
    assert bad_floor.exit_code == 2 and "--data-class-floor" in bad_floor.output


# --- who gets in ---

@pytest.mark.parametrize("header", [
    "Bearer nw-this-key-was-never-issued-by-this-gateway-000",   # unknown
    "Bearer nw-",                                                # malformed: nothing after the prefix
    "Bearer not-a-key",                                          # malformed: not a key of any kind
    "Basic " + API_KEY,                                          # a good key in the wrong scheme
    "Bearer",                                                    # no key
    "",                                                          # no header
])
def test_unknown_and_malformed_keys_get_401(setup, header):
    server, _, _ = setup
    headers = {"Authorization": header} if header else {}
    for response in (httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=30),
                     httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, timeout=30,
                                json={"model": "ar", "messages": [{"role": "user", "content": "hi"}]})):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_revoked_and_expired_keys_get_401(setup):
    server, _, clock = setup
    revoked = create_key(server, "teamR")
    expiring = create_key(server, "teamR", expires_in_days=1)
    assert models_status(server, revoked["key"]).status_code == 200
    assert models_status(server, expiring["key"]).status_code == 200

    gone = httpx.delete(f"{server.base_url}/admin/keys/{revoked['id']}", headers=bearer(ADMIN_KEY), timeout=30)
    assert gone.status_code == 200 and gone.json()["revoked_at"] is not None
    response = models_status(server, revoked["key"])
    assert response.status_code == 401 and "revoked" in response.json()["error"]["message"]

    clock.advance(86400 - 5)
    assert models_status(server, expiring["key"]).status_code == 200
    clock.advance(10)
    response = chat(server, expiring["key"])
    assert response.status_code == 401 and "expired" in response.json()["error"]["message"]


def test_a_configured_key_is_the_tenant_default_without_limits(setup):
    server, _, _ = setup
    assert chat(server, API_KEY).status_code == 200
    uploaded = httpx.post(f"{server.base_url}/v1/files", headers=bearer(API_KEY), timeout=30,
                          files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"}).json()
    assert server.gateway.store.get_file(uploaded["id"], "default") is not None
    assert server.gateway.store.get_file(uploaded["id"], "teamA") is None


# --- /admin/keys ---

def test_admin_keys_needs_an_admin_key(setup):
    server, _, _ = setup
    tenant = create_key(server, "teamAdm")
    url = f"{server.base_url}/admin/keys"
    for key in (tenant["key"], API_KEY, None, "wrong"):
        for response in (httpx.post(url, json={"tenant": "x"}, headers=bearer(key), timeout=30),
                         httpx.get(url, headers=bearer(key), timeout=30),
                         httpx.delete(f"{url}/{tenant['id']}", headers=bearer(key), timeout=30)):
            assert response.status_code == 401, (key, response.text)
    assert models_status(server, tenant["key"]).status_code == 200  # the failed DELETEs revoked nothing

    listed = httpx.get(url, params={"tenant": "teamAdm"}, headers=bearer(ADMIN_KEY), timeout=30)
    assert listed.status_code == 200
    records = listed.json()["data"]
    assert [r["id"] for r in records] == [tenant["id"]]
    assert "key" not in records[0] and tenant["key"] not in listed.text
    # An admin key opens /admin only: it is no tenant's key.
    assert models_status(server, ADMIN_KEY).status_code == 401
    missing = httpx.delete(f"{url}/key_nosuchkey", headers=bearer(ADMIN_KEY), timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
    bad = httpx.post(url, json={"tenant": "x", "requests_per_minute": 0}, headers=bearer(ADMIN_KEY), timeout=30)
    assert bad.status_code == 400


# --- an open server ---

def test_a_server_without_keys_is_open_until_a_key_exists(tmp_path, codec):
    config, path = tenant_config(tmp_path, codec, auth={"api_keys": [], "admin_keys": []})
    with tenant_server(config) as server:
        assert models_status(server, None).status_code == 200
        assert chat(server, None).status_code == 200
        made = runner.invoke(nowait_app, ["keys", "create", "--tenant", "teamA", "--config", str(path), "--json"])
        secret = json.loads(made.stdout)["key"]
        assert models_status(server, None).status_code == 401
        assert models_status(server, secret).status_code == 200
        assert httpx.get(f"{server.base_url}/admin/keys", timeout=30).status_code == 401  # no admin key exists


def test_a_looked_up_key_is_reused_only_while_the_store_is_unchanged_and_at_most_a_second(tmp_path, monkeypatch):
    import nowait.gateway.keys as keys

    server_side = SqliteKeyStore(tmp_path / "keys.sqlite")
    command_side = SqliteKeyStore(tmp_path / "keys.sqlite")  # another connection, as `nowait keys` opens
    secret, record = server_side.create(KeySettings(tenant="teamCache"))
    other, other_record = server_side.create(KeySettings(tenant="teamCache"))
    assert server_side.find(secret) == record and server_side.find(other) == other_record
    # A revoke by another connection holds from the next lookup, the cache notwithstanding.
    command_side.revoke(record.id)
    assert server_side.find(secret).revoked_at is not None
    # One by this store too.
    server_side.revoke(other_record.id)
    assert server_side.find(other).revoked_at is not None

    # Reused: a row removed behind the store's back (its own connection: no version change) is
    # still found for up to FIND_CACHE_S, then read again.
    fresh, fresh_record = server_side.create(KeySettings(tenant="teamCache"))
    assert server_side.find(fresh) == fresh_record
    server_side.database.transaction(lambda session: session.execute("DELETE FROM api_keys WHERE id = ?",
                                                                     (fresh_record.id,)))
    assert server_side.find(fresh) == fresh_record
    now = keys.time.monotonic()
    monkeypatch.setattr(keys.time, "monotonic", lambda: now + keys.FIND_CACHE_S + 0.01)
    assert server_side.find(fresh) is None
    server_side.close()
    command_side.close()
