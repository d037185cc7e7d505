"""`routing.low_confidence` over HTTP against tiny models: a floor of 1.0 makes every answer of a
random model low-confidence and a floor of 0 none, so each mode is seen for certain: `flag` (the
`x-nowait-low-confidence` header and `nowait.low_confidence`, on JSON, held and relayed streams
and batch lines), `reject` (422 `low_confidence` with the confidences) and `frontier` (a re-run
on the remote frontier for internal data; restricted data is flagged instead)."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest

from nowait.gateway.ledger import read_audit_log
from tests.gateway_support import API_KEY, FakeUpstream, base_config, free_port, live_server, save_tiny_models

MESSAGES = [{"role": "user", "content": "Extract the KYC fields as JSON."}]
HEADER = "x-nowait-low-confidence"


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec):
    return save_tiny_models(tmp_path_factory.mktemp("low-confidence") / "models", codec)


def server_for(models, tmp_path, mode: str, upstream=None):
    # Threshold 1.0: every diffusion answer falls back to AR, so both engines' confidences are seen.
    config = base_config(models, tmp_path / "data", free_port(),
                         routing={"low_confidence": mode, "confidence_threshold": 1.0})
    config["engines"]["ar"]["confidence_floor"] = 1.0  # a random model is never that sure
    config["engines"]["spec"]["confidence_floor"] = 0.0  # and always this sure
    config["engines"]["diffusion"]["confidence_floor"] = 1.0
    return live_server(config, upstream)


def post(server, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, **body},
                      headers={"authorization": f"Bearer {API_KEY}", **(headers or {})}, timeout=60)


def test_flag_sets_the_header_and_the_field(models, tmp_path):
    with server_for(models, tmp_path, "flag") as server:
        flagged = post(server, {"model": "ar"})
        assert flagged.status_code == 200 and flagged.headers[HEADER] == "true"
        assert flagged.json()["nowait"]["low_confidence"] is True
        routing = httpx.get(f"{server.base_url}/readyz", timeout=30).json()["routing"]
        assert routing["low_confidence"] == "flag"
        assert routing["confidence_floors"] == {"ar": 1.0, "spec": 0.0, "diffusion": 1.0, "frontier-api": 0.5}
        sure = post(server, {"model": "spec"})
        assert sure.status_code == 200 and HEADER not in sure.headers
        assert sure.json()["nowait"]["low_confidence"] is False

        # A held stream (the fast engine) knows before its first byte: header and final chunk.
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {API_KEY}"},
                          json={"model": "diffusion", "messages": MESSAGES, "max_tokens": 6, "stream": True}) as held:
            assert held.headers[HEADER] == "true"
            chunks = [json.loads(line[6:]) for line in held.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["nowait"]["low_confidence"] is True
        # A relayed stream (AR) is sent as it is made: only its final chunk can say it.
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {API_KEY}"},
                          json={"model": "ar", "messages": MESSAGES, "max_tokens": 6, "stream": True}) as relayed:
            assert HEADER not in relayed.headers
            chunks = [json.loads(line[6:]) for line in relayed.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["nowait"]["low_confidence"] is True

        # A batch line carries the flag in its body.
        client = server.client()
        lines = [{"custom_id": engine, "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": engine, "max_tokens": 6, "messages": MESSAGES}} for engine in ("ar", "spec")]
        uploaded = client.files.create(file=("lines.jsonl", io.BytesIO(
            "".join(json.dumps(line) + "\n" for line in lines).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch.errors
        output = {o["custom_id"]: o["response"]["body"]
                  for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
        assert output["ar"]["nowait"]["low_confidence"] is True and output["spec"]["nowait"]["low_confidence"] is False

        # Four answers of ar below its floor: JSON, the held stream's fallback, the relayed stream, the line.
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert 'nowait:low_confidence_total{action="flag",engine="ar"} 4.0' in metrics
        entries = read_audit_log(server.config.audit_log_path)
        assert entries[0]["low_confidence"][0]["action"] == "flag" and entries[1]["low_confidence"] == []


def test_reject_is_a_422_with_the_confidences(models, tmp_path):
    with server_for(models, tmp_path, "reject") as server:
        refused = post(server, {"model": "nowait"})  # routed to diffusion, re-run on AR
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["code"] == "low_confidence" and error["floor"] == 1.0
        assert [c["engine"] for c in error["confidences"]] == ["diffusion", "ar"]
        assert all(0 <= c["confidence"] < 1 for c in error["confidences"])
        assert "ar confidence" in error["message"] and "below its floor 1" in error["message"]
        assert post(server, {"model": "spec"}).status_code == 200


def test_frontier_reruns_internal_data_and_flags_restricted(models, tmp_path):
    upstream = FakeUpstream()
    with server_for(models, tmp_path, "frontier", upstream) as server:
        rerun = post(server, {"model": "ar"}, headers={"x-nowait-data-class": "internal"})
        assert rerun.status_code == 200 and rerun.headers["x-nowait-route"] == "frontier-api"
        assert HEADER not in rerun.headers and len(upstream.received) == 1
        assert [a["engine"] for a in rerun.json()["nowait"]["engines_tried"]] == ["ar", "frontier-api"]
        kept = post(server, {"model": "ar"}, headers={"x-nowait-data-class": "restricted"})
        assert kept.status_code == 200 and kept.headers[HEADER] == "true" and len(upstream.received) == 1
