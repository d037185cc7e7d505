"""An accepted batch is never lost: SIGKILL the server mid-batch, start it again, and every line
is answered exactly once (lines answered before the kill are kept as they were, not re-run)."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import yaml

from tests.gateway_support import API_KEY, free_port, save_tiny_models

LINES = 48


def start_server(config_path: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "nowait.gateway", "--config", str(config_path),
                                "--port", str(port), "--log-level", "warning"],
                               stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"server did not start: {log.read_text()[-2000:]}")


def answered_rows(database: Path, batch_id: str) -> dict[int, str]:
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT line, response FROM batch_lines WHERE batch_id = ? AND status_code IS NOT NULL",
                          (batch_id,)).fetchall()
    return dict(rows)


def test_kill_minus_nine_mid_batch_then_resume(tmp_path, codec):
    models = save_tiny_models(tmp_path / "models", codec)
    config = {"server": {"torch_threads": 1, "request_timeout_s": 60},
              "auth": {"api_keys": [API_KEY], "api_keys_env": None},
              "data_dir": "data",  # relative: resolved against the config file's folder
              "engines": {"ar": {"kind": "ar", "model": models["ar"], "max_num_seqs": 2,
                                 "max_num_batched_tokens": 256, "structured": False}},
              "routing": {"fast_engine": None},
              "batches": {"max_concurrent_lines": 1}}
    config_path = tmp_path / "nowait.yaml"
    config_path.write_text(yaml.safe_dump(config))
    database = tmp_path / "data" / "batches.sqlite"
    log = tmp_path / "server.log"

    port = free_port()
    server = start_server(config_path, port, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        lines = [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "nowait", "max_tokens": 160,
                           "messages": [{"role": "user", "content": f"Name: Person {i}"}]}} for i in range(LINES)]
        content = io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())
        uploaded = client.files.create(file=("night.jsonl", content), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            progress = client.batches.retrieve(batch.id)
            if progress.request_counts.completed >= 3:
                break
            time.sleep(0.02)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert progress.status == "in_progress" and 3 <= progress.request_counts.completed < LINES, progress
    before = answered_rows(database, batch.id)
    assert 3 <= len(before) < LINES

    port = free_port()
    server = start_server(config_path, port, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = client.batches.retrieve(batch.id)
            if done.status in ("completed", "failed"):
                break
            time.sleep(0.1)
        assert done.status == "completed", done
        assert done.request_counts.total == LINES and done.request_counts.completed == LINES
        output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    ids = [entry["custom_id"] for entry in output]
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(LINES))  # each line exactly once
    assert len(set(ids)) == LINES and done.error_file_id is None
    after = answered_rows(database, batch.id)
    assert all(after[line] == response for line, response in before.items())  # not re-run
