"""The store's faults, injected: a database another writer holds locked, and a disk that fills
at commit. Each is a 503 `store_unavailable` with Retry-After, nothing half-accepted, and the
store serves again once the fault is gone."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "ar", "prompt": "x"}}\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("store-faults")
    with live_server(base_config(save_tiny_models(root / "models", codec), root / "data", free_port())) as live:
        yield live


def upload(server, filename: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/files", headers=AUTH, data={"purpose": "batch"},
                      files={"file": (filename, LINE, "application/jsonl")}, timeout=60)


def stored_names(server) -> list[str]:
    files = httpx.get(f"{server.base_url}/v1/files", headers=AUTH).json()["data"]
    return [f["filename"] for f in files]


def assert_store_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "store_unavailable"
    assert int(response.headers["retry-after"]) >= 1


def test_a_database_locked_by_another_writer_is_503_and_the_retry_is_stored_once(server):
    other = sqlite3.connect(str(server.gateway.store.path), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # holds the write lock past the store's busy timeout
    try:
        assert_store_unavailable(upload(server, "locked.jsonl"))
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert "locked.jsonl" not in stored_names(server)
    assert upload(server, "locked.jsonl").status_code == 200
    assert stored_names(server).count("locked.jsonl") == 1


class DiskFullAtCommit:
    """The store's connection, except that every COMMIT fails as a full disk does."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args):
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def test_a_full_disk_at_commit_is_503_accepts_nothing_and_the_store_serves_again(server, monkeypatch):
    file_id = upload(server, "input.jsonl").json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    store = server.gateway.store
    monkeypatch.setattr(store.db, "_db", DiskFullAtCommit(store.db._db))
    assert_store_unavailable(httpx.post(f"{server.base_url}/v1/batches", json=body, headers=AUTH))
    monkeypatch.undo()
    assert httpx.get(f"{server.base_url}/v1/batches", headers=AUTH).json()["data"] == []
    # The failed commit left no transaction open: the next write is accepted, once.
    created = httpx.post(f"{server.base_url}/v1/batches", json=body, headers=AUTH)
    assert created.status_code == 200, created.text
    assert [b["id"] for b in httpx.get(f"{server.base_url}/v1/batches", headers=AUTH).json()["data"]] == [
        created.json()["id"]]
