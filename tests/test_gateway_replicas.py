"""Several `nowait serve` processes on one PostgreSQL database: a replica killed with SIGKILL
mid-batch leaves its lines to the other, and the output holds every line once; the database
restarted mid-batch, the replicas reconnect and the batch completes; the database stopped while
serving, the store's endpoints answer 503 with Retry-After and chat still answers; a store that
cannot be used at start (a wrong password, no server, a bad URL, a newer schema) is one line and
exit 2."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
import yaml

from nowait.store.scratch_postgres import ScratchPostgres
from tests.gateway_support import API_KEY, free_port, save_tiny_models

NOWAIT = str(Path(sys.executable).parent / "nowait")
LINES = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec) -> dict[str, str]:
    return save_tiny_models(tmp_path_factory.mktemp("replica-models"), codec)


def write_config(directory: Path, models: dict[str, str], store_url: str, lease_s: float = 2.0) -> Path:
    config = {"server": {"torch_threads": 1, "request_timeout_s": 60},
              "auth": {"api_keys": [API_KEY], "api_keys_env": None},
              "data_dir": str(directory / "data"),
              "engines": {"ar": {"kind": "ar", "model": models["ar"], "max_num_seqs": 4,
                                 "max_num_batched_tokens": 256, "structured": False}},
              "routing": {"fast_engine": None},
              "batches": {"max_concurrent_lines": 4},
              "store": {"url": store_url, "lease_s": lease_s}}
    path = directory / "nowait.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Replica:
    """One `nowait serve` process on the shared store, and an openai client on it."""

    def __init__(self, config: Path, name: str, log: Path) -> None:
        self.name, self.port, self.log = name, free_port(), log
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([NOWAIT, "serve", "--config", str(config), "--port", str(self.port),
                                         "--replica", name, "--log-level", "warning"],
                                        stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"replica {name} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"replica {name} did not start: {log.read_text()[-2000:]}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def create_batch(client: openai.OpenAI, lines: int, max_tokens: int) -> str:
    requests = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "ar", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": f"Name: Person {i}"}]}} for i in range(lines)]
    content = io.BytesIO("".join(json.dumps(r) + "\n" for r in requests).encode())
    uploaded = client.files.create(file=("night.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except (openai.APIError, httpx.HTTPError, psycopg.Error):
            pass  # a replica or the database is on its way back
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 240):
    def done():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None
    return wait_until(done, timeout, f"batch {batch_id} to finish")


def output_ids(client: openai.OpenAI, file_id: str) -> list[str]:
    return [json.loads(line)["custom_id"] for line in client.files.content(file_id).text.splitlines()]


def leased_to(url: str, batch_id: str, replica: str) -> int:
    with psycopg.connect(url) as db:
        [(count,)] = db.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = %s AND status_code IS NULL "
                                "AND lease_owner LIKE %s", (batch_id, f"{replica}/%")).fetchall()
    return count


@pytest.fixture(scope="module")
def pair(tmp_path_factory, models, postgres_server):
    """Two replicas, `a` and `b`, on a fresh database of the session's server; its URL."""
    work = tmp_path_factory.mktemp("replica-pair")
    url = postgres_server.create_database(f"replicas_{uuid.uuid4().hex[:8]}")
    config = write_config(work, models, url)
    replicas = [Replica(config, "a", work / "a.log")]
    try:
        replicas.append(Replica(config, "b", work / "b.log"))
        yield url, replicas
    finally:
        for replica in replicas:
            replica.stop()


def test_creates_and_cancels_on_two_replicas_leave_consistent_counts(pair):
    _, replicas = pair
    created, cancelled = [], set()
    for k in range(6):  # created on one replica, every second one cancelled on the other
        # The ones to cancel run longer, so the cancel usually finds them running.
        batch_id = create_batch(replicas[k % 2].client(), 6, max_tokens=24 if k % 2 else 3)
        created.append(batch_id)
        if k % 2:
            try:
                replicas[(k + 1) % 2].client().batches.cancel(batch_id)
                cancelled.add(batch_id)
            except openai.ConflictError as error:  # it finished first (a loaded machine): the 409 says so
                assert "is completed" in str(error), error
    assert cancelled, "no cancel found its batch still running"
    for k, batch_id in enumerate(created):
        batch = finished(replicas[k % 2].client(), batch_id)
        again = replicas[(k + 1) % 2].client().batches.retrieve(batch_id)
        assert again.status == batch.status and again.request_counts == batch.request_counts
        assert batch.status == ("cancelled" if batch_id in cancelled else "completed"), (k, batch.status)
        counts = batch.request_counts
        answered = output_ids(replicas[0].client(), batch.output_file_id) if batch.output_file_id else []
        skipped = output_ids(replicas[0].client(), batch.error_file_id) if batch.error_file_id else []
        assert counts.completed == len(answered) == len(set(answered)) and counts.failed == 0
        if counts.total == 0:  # cancelled before it was validated: no line was taken in
            assert batch.status == "cancelled" and answered == skipped == []
        else:
            assert counts.total == 6 and sorted(answered + skipped) == sorted(f"doc-{i}" for i in range(6))


def test_a_replica_killed_mid_batch_leaves_every_line_answered_once(pair):
    """Runs after the test above on the same pair (and kills `a`)."""
    url, (a, b) = pair
    # Lines long enough that the batch outlasts the wait below on a quiet machine too (with 4
    # tokens a line, all 200 could be answered between the check and the kill).
    batch_id = create_batch(b.client(), LINES, max_tokens=16)  # on b; a's runner finds it in the store
    # Killed while it holds leases on lines it is answering, after both have answered some: the
    # leases are read last, just before the kill.
    wait_until(lambda: a.client().batches.retrieve(batch_id).request_counts.completed >= 20
               and leased_to(url, batch_id, "b") and leased_to(url, batch_id, "a"), 120,
               "both replicas to hold leases")
    a.kill()
    orphaned = leased_to(url, batch_id, "a")  # unanswered lines the dead replica still holds
    assert orphaned > 0
    batch = finished(b.client(), batch_id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (LINES, LINES)
    assert batch.error_file_id is None
    ids = output_ids(b.client(), batch.output_file_id)
    assert len(ids) == LINES and sorted(ids) == sorted(f"doc-{i}" for i in range(LINES))  # none twice or missing


@pytest.fixture(scope="module")
def own_postgres():
    """A private server: these tests restart and stop it."""
    with ScratchPostgres() as server:
        yield server


def test_the_database_restarted_mid_batch_then_stopped_while_serving(tmp_path, models, own_postgres):
    config = write_config(tmp_path, models, own_postgres.url)
    replicas = [Replica(config, "a", tmp_path / "a.log"), Replica(config, "b", tmp_path / "b.log")]
    try:
        client = replicas[0].client()
        batch_id = create_batch(client, 30, max_tokens=4)
        wait_until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 5, 120, "the first lines")
        own_postgres.restart()  # every replica's connections are cut mid-batch
        batch = finished(replicas[1].client(), batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == 30
        ids = output_ids(client, batch.output_file_id)
        assert sorted(ids) == sorted(f"doc-{i}" for i in range(30))

        own_postgres.stop()  # and now away while the replicas serve
        auth = {"Authorization": f"Bearer {API_KEY}"}
        for path in ("/v1/batches", f"/v1/batches/{batch_id}", "/v1/files"):
            response = httpx.get(f"{replicas[0].base_url}{path}", headers=auth, timeout=30)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"]["code"] == "store_unavailable"
            assert int(response.headers["Retry-After"]) > 0
        chat = replicas[1].client().chat.completions.create(
            model="ar", max_tokens=4, messages=[{"role": "user", "content": "Name: still here"}])
        assert chat.choices[0].message.content is not None
        for replica in replicas:  # a graceful stop would wait for the database to flush the audit
            replica.kill()
    finally:
        for replica in replicas:
            replica.stop()


def test_a_store_that_cannot_be_used_at_start_is_one_line_and_exit_2(tmp_path, models, postgres_server):
    config = write_config(tmp_path, models, "sqlite:///unused.sqlite")
    wrong_password = postgres_server.url_for("nowait", password="not-the-password")
    unreachable = f"postgresql://nowait:secret-pw@127.0.0.1:{free_port()}/nowait"
    newer = postgres_server.create_database(f"newer_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(newer, autocommit=True) as db:  # as a later nowait would leave it
        db.execute("CREATE TABLE nowait_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)")
        db.execute("INSERT INTO nowait_schema VALUES ('batches', 99)")
    cases = ((wrong_password, "password authentication failed"), (unreachable, "127.0.0.1"),
             ("mysql://user:secret-pw@host/db", "expected sqlite:///PATH or postgresql://"),
             (newer, "its batches schema is at version 99, newer than this nowait's"))
    started = [subprocess.Popen([NOWAIT, "serve", "--config", str(config), "--port", str(free_port()),
                                 "--store", store], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for store, _ in cases]  # side by side: each pays the CLI's start-up
    for process, (store, expected) in zip(started, cases, strict=True):
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (store, stderr[-2000:])
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (store, stderr)
        assert "not-the-password" not in stderr and "secret-pw" not in stderr
        assert postgres_server.password not in stderr
