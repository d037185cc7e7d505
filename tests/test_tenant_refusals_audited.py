"""A request refused before routing (over its key's rate limit, past its tenant's budget; a batch
line whose key was revoked) still says who asked: it has an audit entry with its tenant, key id
and code (never the secret), and it counts in nowait:tenant_requests_total{tenant,code} and
nowait:request_errors_total, over HTTP and as a batch line. The chain stays whole."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest

from nowait.gateway.audit import read_audit_log, verify_audit_log
from nowait.gateway.batches import BatchOwner
from tests.tenant_support import ManualClock, chat, create_key, tenant_config, tenant_server
from tests.test_tenant_metrics import samples


@pytest.fixture(scope="module")
def run(tmp_path_factory, codec):
    """Team busy: one request admitted, one over its rpm. Team frugal: the request that spends its
    budget, one refused over HTTP and one batch line refused. What /metrics and the log say."""
    root = tmp_path_factory.mktemp("tenant-refusals")
    config, _ = tenant_config(root, codec)
    with tenant_server(config, ManualClock()) as server:
        busy = create_key(server, "teamBusy", requests_per_minute=1)
        frugal = create_key(server, "teamFrugal", budget_usd_per_day=1e-9)
        assert chat(server, busy["key"]).status_code == 200
        over_rpm = chat(server, busy["key"])
        assert over_rpm.status_code == 429, over_rpm.text
        assert chat(server, frugal["key"]).status_code == 200  # crosses the line
        over_budget = chat(server, frugal["key"])
        assert over_budget.status_code == 429 and over_budget.json()["error"]["code"] == "insufficient_quota"

        client = server.client(api_key=frugal["key"])
        line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "ar", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, batch.status
            time.sleep(0.05)
        assert batch.request_counts.failed == 1

        # A batch whose key is revoked before its lines run: each line refused 401, for its owner.
        revoked = create_key(server, "teamRevoked")
        owned = server.client(api_key=revoked["key"]).files.create(
            file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
        server.gateway.keys.revoke(revoked["id"])
        stored = server.gateway.store.create_batch(owned.id, "/v1/chat/completions", "24h", None,
                                                   BatchOwner("teamRevoked", revoked["id"]))
        server.gateway.runner.wake()
        while server.gateway.store.status(stored.id) != "completed":
            assert time.monotonic() < deadline + 60
            time.sleep(0.05)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        audit_path = server.config.audit_log_path
    return {"busy": busy, "frugal": frugal, "revoked": revoked, "metrics": metrics, "audit_path": audit_path}


def test_refusals_before_routing_count_for_their_tenant(run):
    requests = samples(run["metrics"], "nowait:tenant_requests_total")
    assert requests[(("code", "200"), ("tenant", "teamBusy"))] == 1.0
    assert requests[(("code", "429"), ("tenant", "teamBusy"))] == 1.0
    assert requests[(("code", "200"), ("tenant", "teamFrugal"))] == 1.0
    assert requests[(("code", "429"), ("tenant", "teamFrugal"))] == 2.0  # over HTTP and the batch line
    assert requests[(("code", "401"), ("tenant", "teamRevoked"))] == 1.0  # its batch line
    errors = samples(run["metrics"], "nowait:request_errors_total")
    assert errors[(("code", "rate_limit_exceeded"), ("status", "429"))] == 1.0
    assert errors[(("code", "insufficient_quota"), ("status", "429"))] == 2.0  # each counted once


def test_refusals_before_routing_are_audited_with_tenant_and_key_id_never_the_secret(run):
    entries = read_audit_log(run["audit_path"])
    refused = [e for e in entries if e["status"] == 429]
    by_tenant = {(e["tenant"], e["key_id"], e["code"], e["endpoint"]) for e in refused}
    assert by_tenant == {("teamBusy", run["busy"]["id"], "rate_limit_exceeded", "chat"),
                         ("teamFrugal", run["frugal"]["id"], "insufficient_quota", "chat")}
    assert len(refused) == 3
    assert all(e["cost_usd"] == 0 and e["engines_tried"] == [] and e["route"] is None for e in refused)
    [line_refused] = [e for e in entries if e["tenant"] == "teamRevoked"]
    assert (line_refused["status"], line_refused["code"], line_refused["key_id"]) == (
        401, "invalid_api_key", run["revoked"]["id"])
    text = run["audit_path"].read_text()
    assert all(run[who]["key"] not in text for who in ("busy", "frugal", "revoked"))
    verdict = verify_audit_log(run["audit_path"])
    assert verdict.ok and verdict.entries == len(entries)
