"""Files and batches through the official client: JSONL in, output and error files out, the
status sequence, validation failures and cancellation; on the SQLite store and on PostgreSQL."""

from __future__ import annotations

import io
import json
import time
import uuid

import openai
import pytest

from nowait.gateway.batches import BatchInputError, parse_input
from tests.gateway_support import base_config, free_port, live_server, save_tiny_models


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tmp_path_factory, codec):
    """One gateway per store: the embedded SQLite one, and a fresh database on the session's
    PostgreSQL server."""
    root = tmp_path_factory.mktemp(f"gateway-batches-{request.param}")
    models = save_tiny_models(root / "models", codec)
    store = {}
    if request.param == "postgresql":
        store = {"url": request.getfixturevalue("postgres_server").create_database(f"batches_{uuid.uuid4().hex[:8]}")}
    config = base_config(models, root / "data", free_port(), batches={"max_concurrent_lines": 2}, store=store)
    with live_server(config) as live:
        assert live.gateway.store.db.dialect == request.param
        yield live


def jsonl(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def chat_line(custom_id: str, model: str = "nowait", max_tokens: int = 6) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": f"Name: {custom_id}"}]}}


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 60):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in statuses:
            return batch, seen
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} stuck in {seen}")


def read_jsonl(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_files_upload_list_retrieve_read_and_delete(server):
    client = server.client()
    content = jsonl([chat_line("f-1"), chat_line("f-2")]).getvalue()
    first = client.files.create(file=("one.jsonl", io.BytesIO(content)), purpose="batch")
    second = client.files.create(file=("two.txt", io.BytesIO(b"\x00binary\xff")), purpose="user_data")
    assert (first.filename, first.bytes, second.bytes) == ("one.jsonl", len(content), 8)
    listed = [f.id for f in client.files.list()]
    assert listed.index(second.id) < listed.index(first.id)  # newest first
    user_data = [f.id for f in client.files.list(purpose="user_data")]
    assert second.id in user_data and first.id not in user_data
    assert client.files.retrieve(first.id).filename == "one.jsonl"
    assert client.files.content(first.id).content == content
    assert client.files.content(second.id).content == b"\x00binary\xff"  # bytes kept as they were
    assert client.files.delete(second.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(second.id)


def test_a_batch_runs_to_completion_with_output_and_error_files(server):
    client = server.client()
    lines = [chat_line(f"doc-{i}") for i in range(6)] + [chat_line("bad", model="no-such-model")]
    uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "kyc-nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "kyc-nightly"}
    batch, seen = wait_for(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch.errors
    assert set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert batch.request_counts.total == 7 and batch.request_counts.completed == 6
    assert batch.request_counts.failed == 1
    output = read_jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"doc-{i}" for i in range(6))
    for entry in output:
        body = entry["response"]["body"]
        assert entry["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["nowait"]["rule"] == "batch" and body["nowait"]["route"] == "ar"  # batch lines are batchable
    [error] = read_jsonl(client, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]


def test_completions_batches_work_too(server):
    client = server.client()
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "ar", "prompt": "Name:", "max_tokens": 3}} for i in range(3)]
    uploaded = client.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    batch, _ = wait_for(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed" and batch.request_counts.completed == 3
    assert all(o["response"]["body"]["object"] == "text_completion" for o in read_jsonl(client, batch.output_file_id))
    with pytest.raises(openai.ConflictError):  # a finished batch cannot be cancelled
        client.batches.cancel(batch.id)


def test_an_invalid_input_file_fails_the_batch_with_line_errors(server):
    client = server.client()
    lines = [chat_line("a"), chat_line("a"), {**chat_line("b"), "url": "/v1/embeddings"}]
    uploaded = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch, _ = wait_for(client, batch.id, {"failed", "completed"})
    assert batch.status == "failed" and batch.failed_at is not None
    codes = {(e.code, e.line) for e in batch.errors.data}
    assert codes == {("duplicate_custom_id", 2), ("mismatched_endpoint", 3)}


def test_batch_creation_is_checked_up_front(server):
    client = server.client()
    uploaded = client.files.create(file=("x.jsonl", jsonl([chat_line("a")])), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_a_cancelled_batch_keeps_what_it_answered(server):
    client = server.client()
    lines = [chat_line(f"slow-{i}", model="ar", max_tokens=200) for i in range(40)]
    uploaded = client.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(client, batch.id, {"in_progress"})
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch, _ = wait_for(client, batch.id, {"cancelled"})
    answered = read_jsonl(client, batch.output_file_id) if batch.output_file_id else []
    skipped = read_jsonl(client, batch.error_file_id)
    assert len(answered) + len(skipped) == 40 and skipped
    assert all(e["error"]["code"] == "batch_cancelled" for e in skipped)
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling twice changes nothing


def test_parse_input_reports_each_bad_line():
    with pytest.raises(BatchInputError) as error:
        parse_input(b'{"custom_id": "a"\nnot json\n[1]\n', "/v1/chat/completions")
    assert [e.line for e in error.value.errors] == [1, 2, 3]
    with pytest.raises(BatchInputError, match="no request lines"):
        parse_input(b"\n\n", "/v1/chat/completions")


def test_a_line_nested_past_the_parser_is_a_line_error():
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(BatchInputError) as error:
        parse_input(deep + b"\n", "/v1/chat/completions")
    assert [(e.line, e.code) for e in error.value.errors] == [(1, "invalid_json_line")]


def test_a_batch_that_fails_in_processing_holds_up_no_other(server, monkeypatch):
    """A batch whose processing raises is retried, then marked failed with the error; the
    batch created after it completes meanwhile."""
    import nowait.gateway.batches as batches

    real = batches.parse_input

    def exploding(content: bytes, endpoint: str):
        if b"explode" in content:
            raise RuntimeError("simulated failure")
        return real(content, endpoint)

    monkeypatch.setattr(batches, "parse_input", exploding)
    monkeypatch.setattr(batches, "MAX_PROCESS_FAILURES", 2)
    client = server.client()
    created = []
    for name in ("explode", "fine"):
        uploaded = client.files.create(file=(f"{name}.jsonl", jsonl([chat_line(name)])), purpose="batch")
        created.append(client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                             completion_window="24h"))
    wait_for(client, created[1].id, {"completed"})
    failed, _ = wait_for(client, created[0].id, {"failed"})
    [error] = failed.errors.data
    assert error.code == "internal_error" and "simulated failure" in error.message
