"""Attribution on a live server with two tenants' real keys: every audit entry names its tenant
and key id, `nowait audit spend` equals what each tenant's answers cost, the tenant counters
follow, and no secret (tenant keys, the configured key, the admin key) reaches the server log
or the audit log."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from typer.testing import CliRunner

from nowait.cli import app
from nowait.gateway.audit import read_audit_log, verify_audit_log
from tests.gateway_support import API_KEY
from tests.tenant_support import ADMIN_KEY, chat, create_key, tenant_config, tenant_server
from tests.test_tenant_metrics import samples

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory, codec):
    """Two tenants' keys, each asking a few times, one refused model (404) for team-b; what
    every answer said it cost, the server's log and /metrics, and the secrets involved."""
    root = tmp_path_factory.mktemp("audit-tenants")
    config, _ = tenant_config(root, codec)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.DEBUG)
    logger = logging.getLogger()
    previous = logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    try:
        with tenant_server(config) as server:
            keys = {tenant: create_key(server, tenant) for tenant in ("team-a", "team-b")}
            paid: dict[str, list[float]] = {"team-a": [], "team-b": [], "default": []}
            for tenant, times in (("team-a", 3), ("team-b", 2)):
                for _ in range(times):
                    reply = chat(server, keys[tenant]["key"], max_tokens=3)
                    assert reply.status_code == 200, reply.text
                    paid[tenant].append(reply.json()["nowait"]["cost_usd"])
            assert chat(server, keys["team-b"]["key"], model="gpt-imaginary").status_code == 404
            paid["team-b"].append(0.0)
            reply = chat(server, API_KEY, max_tokens=2)  # a configured key: the tenant default
            paid["default"].append(reply.json()["nowait"]["cost_usd"])
            metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
            audit_path = server.config.audit_log_path
    finally:
        logger.removeHandler(keep)
        logger.setLevel(previous)
    log_text = "\n".join(f"{r.name} {r.getMessage()} {r.args!r}" for r in records)
    secrets = [keys["team-a"]["key"], keys["team-b"]["key"], API_KEY, ADMIN_KEY]
    return {"keys": keys, "paid": paid, "metrics": metrics, "audit": audit_path, "log": log_text,
            "secrets": secrets}


def test_every_entry_names_its_tenant_and_key_id(run):
    entries = read_audit_log(run["audit"])
    by_tenant = {}
    for entry in entries:
        by_tenant.setdefault(entry["tenant"], set()).add(entry["key_id"])
    assert by_tenant == {"team-a": {run["keys"]["team-a"]["id"]}, "team-b": {run["keys"]["team-b"]["id"]},
                         "default": {None}}
    assert [e["status"] for e in entries if e["tenant"] == "team-b"] == [200, 200, 404]
    assert verify_audit_log(run["audit"]).ok


def test_spend_equals_what_each_tenants_answers_cost(run):
    result = runner.invoke(app, ["audit", "spend", str(run["audit"]), "--json"], prog_name="nowait")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert set(rows) == {"team-a", "team-b", "default"}
    for tenant, costs in run["paid"].items():
        assert rows[tenant]["requests"] == len(costs)
        assert rows[tenant]["cost_usd"] == pytest.approx(sum(costs))
    assert rows["team-a"]["cost_usd"] > 0 and rows["team-b"]["errors"] == 1


def test_the_tenant_counters_follow_the_keys(run):
    requests = samples(run["metrics"], "nowait:tenant_requests_total")
    assert requests == {(("code", "200"), ("tenant", "team-a")): 3.0, (("code", "200"), ("tenant", "team-b")): 2.0,
                        (("code", "404"), ("tenant", "team-b")): 1.0, (("code", "200"), ("tenant", "default")): 1.0}
    cost = samples(run["metrics"], "nowait:tenant_cost_usd_total")
    for tenant, costs in run["paid"].items():
        assert cost[(("tenant", tenant),)] == pytest.approx(sum(costs))


def test_no_secret_reaches_the_server_log_or_the_audit_log(run):
    audit = run["audit"].read_text(encoding="utf-8")
    assert run["log"], "the server logged nothing: the search below would prove nothing"
    assert run["keys"]["team-a"]["id"] in audit  # ids are what the log names instead
    for secret in run["secrets"]:
        assert secret not in audit
        assert secret not in run["log"]
