"""Files and batches belong to their tenant: on every files and batches endpoint another tenant's
id answers exactly as an id that does not exist (404 `not_found`, never 403), lists are disjoint, a batch
names only its caller's input file, output and error files are the batch's tenant's, and batch
lines run with the batch's key's scopes. A store from before tenants opens with its objects in
the tenant `default`."""

from __future__ import annotations

import io
import json
import sqlite3
import time

import httpx
import openai
import pytest

from nowait.gateway.batches import BatchOwner, BatchStore
from tests.gateway_support import API_KEY
from tests.tenant_support import bearer, create_key, tenant_config, tenant_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("tenant-ownership")
    config, _ = tenant_config(root, codec, batches={"max_concurrent_lines": 2})
    with tenant_server(config) as live:
        yield live


@pytest.fixture(scope="module")
def teams(server):
    """Two tenants' keys: A may use `ar` only, B everything."""
    return create_key(server, "teamA", models=["ar"])["key"], create_key(server, "teamB")["key"]


def line(custom_id: str, model: str = "ar") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Name: {custom_id}"}]}}


def upload(client: openai.OpenAI, lines: list[dict]):
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not finish")


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["type"], error["code"]


def test_another_tenants_files_and_batches_answer_as_missing_ones(server, teams):
    key_a, key_b = teams
    a, b = server.client(api_key=key_a), server.client(api_key=key_b)
    file_a = upload(a, [line("one")])
    batch_a = a.batches.create(input_file_id=file_a.id, endpoint="/v1/chat/completions", completion_window="24h")
    url, hb = server.base_url, bearer(key_b)
    missing_file, missing_batch = "file-000000000000000000000000", "batch_000000000000000000000000"

    for method, path in (("GET", "/v1/files/{f}"), ("GET", "/v1/files/{f}/content"), ("DELETE", "/v1/files/{f}"),
                         ("GET", "/v1/batches/{b}"), ("POST", "/v1/batches/{b}/cancel")):
        theirs = httpx.request(method, url + path.format(f=file_a.id, b=batch_a.id), headers=hb, timeout=30)
        absent = httpx.request(method, url + path.format(f=missing_file, b=missing_batch), headers=hb, timeout=30)
        assert theirs.status_code == 404, (method, path, theirs.text)
        assert error_of(theirs) == error_of(absent) == (404, "invalid_request_error", "not_found")
        assert theirs.json()["error"]["message"].replace(file_a.id, "ID").replace(batch_a.id, "ID") == \
            absent.json()["error"]["message"].replace(missing_file, "ID").replace(missing_batch, "ID")

    # Through the openai client, as B's program sees it.
    for lookup in (lambda: b.files.retrieve(file_a.id), lambda: b.files.content(file_a.id),
                   lambda: b.files.delete(file_a.id), lambda: b.batches.retrieve(batch_a.id),
                   lambda: b.batches.cancel(batch_a.id)):
        with pytest.raises(openai.NotFoundError):
            lookup()

    # B may not name A's file as its batch's input: answered as a file that does not exist.
    named = httpx.post(f"{url}/v1/batches", headers=hb, timeout=30, json={
        "input_file_id": file_a.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    absent = httpx.post(f"{url}/v1/batches", headers=hb, timeout=30, json={
        "input_file_id": missing_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert named.status_code == 400 and error_of(named) == error_of(absent)

    # Nothing B did touched A's objects.
    assert a.files.retrieve(file_a.id).id == file_a.id
    assert json.loads(a.files.content(file_a.id).text.splitlines()[0])["custom_id"] == "one"
    done = finished(a, batch_a.id)
    assert done.status == "completed" and done.request_counts.completed == 1


def test_lists_are_disjoint_and_output_files_are_the_batch_tenants(server, teams):
    key_a, key_b = teams
    a, b = server.client(api_key=key_a), server.client(api_key=key_b)
    file_a, file_b = upload(a, [line("a1")]), upload(b, [line("b1"), line("b2", model="no-such-model")])
    batch_a = a.batches.create(input_file_id=file_a.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch_b = b.batches.create(input_file_id=file_b.id, endpoint="/v1/chat/completions", completion_window="24h")
    done_a, done_b = finished(a, batch_a.id), finished(b, batch_b.id)
    assert done_b.output_file_id and done_b.error_file_id

    files_a = {f.id for f in a.files.list()}
    files_b = {f.id for f in b.files.list()}
    assert not files_a & files_b
    assert {file_a.id, done_a.output_file_id} <= files_a
    assert {file_b.id, done_b.output_file_id, done_b.error_file_id} <= files_b
    batches_a, batches_b = {x.id for x in a.batches.list()}, {x.id for x in b.batches.list()}
    assert batch_a.id in batches_a and batch_b.id in batches_b and not batches_a & batches_b

    for file_id in (done_b.output_file_id, done_b.error_file_id):
        assert b.files.content(file_id).text
        with pytest.raises(openai.NotFoundError):
            a.files.content(file_id)
    # The tenant default (a configured key) sees neither.
    mine = {f.id for f in server.client(api_key=API_KEY).files.list()}
    assert not mine & (files_a | files_b)


def test_batch_lines_run_with_the_batch_keys_model_scope(server, teams):
    key_a, _ = teams
    a = server.client(api_key=key_a)
    uploaded = upload(a, [line("allowed", "ar"), line("not-allowed", "diffusion")])
    batch = finished(a, a.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    assert batch.request_counts.completed == 1 and batch.request_counts.failed == 1
    [output] = [json.loads(x) for x in a.files.content(batch.output_file_id).text.splitlines()]
    [error] = [json.loads(x) for x in a.files.content(batch.error_file_id).text.splitlines()]
    assert output["custom_id"] == "allowed"
    assert error["custom_id"] == "not-allowed" and error["response"]["status_code"] == 403
    assert error["response"]["body"]["error"]["code"] == "model_not_allowed"


def test_a_revoked_keys_batch_lines_are_refused(server):
    made = create_key(server, "teamRevoked")
    client = server.client(api_key=made["key"])
    uploaded = upload(client, [line(f"r{i}") for i in range(3)])
    server.gateway.keys.revoke(made["id"])
    # The batch as POST /v1/batches would have stored it just before the revoke.
    owner_batch = server.gateway.store.create_batch(uploaded.id, "/v1/chat/completions", "24h", None,
                                                    BatchOwner("teamRevoked", made["id"]))
    server.gateway.runner.wake()
    deadline = time.monotonic() + 60
    while server.gateway.store.status(owner_batch.id) != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    batch = server.gateway.store.get_batch(owner_batch.id)
    assert batch.request_counts.failed == 3 and batch.output_file_id is None
    errors = [json.loads(x) for x in server.gateway.store.file_content(batch.error_file_id).decode().splitlines()]
    assert {e["response"]["status_code"] for e in errors} == {401}


OLD_SCHEMA = """
CREATE TABLE files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE batches (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
    expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, errors TEXT);
CREATE TABLE batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status_code INTEGER, response TEXT, request_id TEXT, answered_at INTEGER,
    PRIMARY KEY (batch_id, line));
INSERT INTO files VALUES ('file-old', 'batch', 'old.jsonl', 3, 1, X'7B7D0A');
INSERT INTO batches (id, status, endpoint, input_file_id, completion_window, created_at)
    VALUES ('batch_old', 'completed', '/v1/chat/completions', 'file-old', '24h', 1);
"""


def test_a_store_from_before_tenants_opens_with_its_objects_in_the_default_tenant(tmp_path):
    path = tmp_path / "batches.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SCHEMA)
    store = BatchStore(path)
    assert store.get_file("file-old", "default").filename == "old.jsonl"
    assert store.file_content("file-old", "default") == b"{}\n"
    assert store.get_file("file-old", "teamA") is None
    assert [b.id for b in store.list_batches(tenant="default")] == ["batch_old"]
    assert store.list_batches(tenant="teamA") == [] and store.list_files(tenant="teamA") == []
    new = store.create_file("new.jsonl", "batch", b"{}\n", tenant="teamA")
    assert [f.id for f in store.list_files(tenant="teamA")] == [new.id]
    store.close()
    BatchStore(path).close()  # and opens again, migrated
