"""`nowait audit verify --store` and `nowait audit spend --store` on the real `nowait` app
(Typer's CliRunner), on SQLite and on the session's PostgreSQL, and with a config whose
store.url is PostgreSQL; a store that cannot be used is one line and exit 2."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from nowait.cli import app
from nowait.gateway.audit.store_log import StoreAuditLog
from nowait.store.database import open_database
from nowait.store.scratch_postgres import free_port

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), prog_name="nowait")


def fill(url: str) -> None:
    """Two replicas' chains: teamA's answered requests on r1, teamB's and an error on r2."""
    database = open_database(url)
    one, two = StoreAuditLog(database, "r1"), StoreAuditLog(database, "r2")
    for number in range(3):
        one.record({"request_id": f"a{number}", "tenant": "teamA", "status": 200, "cost_usd": 0.5, "time": 1000.0,
                    "engines_tried": [{"engine": "ar", "prompt_tokens": 3, "completion_tokens": 2, "cost_usd": 0.5}]})
    two.record({"request_id": "b0", "tenant": "teamB", "status": 200, "cost_usd": 0.25, "time": 2000.0})
    two.record({"request_id": "b1", "tenant": "teamB", "status": 500, "cost_usd": 0.0, "time": 2000.0})
    one.close()
    two.close()
    database.close()


def test_verify_store_checks_every_replica_and_names_a_break(store_url):
    fill(store_url)
    result = invoke("audit", "verify", "--store", store_url)
    assert result.exit_code == 0, result.output
    assert "5 entries checked" in result.output and "r1: 3 entries" in result.output and "r2: 2 entries" in \
        result.output
    verdict = json.loads(invoke("audit", "verify", "--store", store_url, "--json").stdout)
    assert verdict["ok"] and {n: s["entries"] for n, s in verdict["replicas"].items()} == {"r1": 3, "r2": 2}

    database = open_database(store_url)
    database.transaction(lambda s: s.execute("DELETE FROM audit_entries WHERE replica = 'r1' AND seq = 1"))
    database.close()
    result = invoke("audit", "verify", "--store", store_url)
    assert result.exit_code == 1 and "removed" in result.output and "entry 1 of replica 'r1'" in result.output
    broken = json.loads(invoke("audit", "verify", "--store", store_url, "--json").stdout)["broken"]
    assert (broken["kind"], broken["replica"], broken["seq"]) == ("removed", "r1", 1)


def test_spend_store_sums_every_replica(store_url):
    fill(store_url)
    rows = json.loads(invoke("audit", "spend", "--store", store_url, "--json").stdout)["rows"]
    assert rows["teamA"]["cost_usd"] == pytest.approx(1.5) and rows["teamA"]["requests"] == 3
    assert (rows["teamB"]["requests"], rows["teamB"]["errors"]) == (2, 1)
    since = json.loads(invoke("audit", "spend", "--store", store_url, "--since", "1970-01-01T00:20:00",
                              "--json").stdout)["rows"]
    assert list(since) == ["teamB"]  # teamA's entries are at 1000 s, before 1200 s
    table = invoke("audit", "spend", "--store", store_url)
    assert table.exit_code == 0 and "teamA" in table.output and "total" in table.output


def test_a_config_whose_store_is_postgresql_is_read(postgres_url, tmp_path):
    fill(postgres_url)
    config = tmp_path / "nowait.yaml"
    config.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), "store": {"url": postgres_url}}))
    result = invoke("audit", "verify", "--config", str(config))
    assert result.exit_code == 0 and "5 entries checked" in result.output
    assert "***" in result.output and postgres_url.split("@")[0].split(":")[-1] not in result.output
    rows = json.loads(invoke("audit", "spend", "--config", str(config), "--json").stdout)["rows"]
    assert set(rows) == {"teamA", "teamB"}


def test_a_store_that_cannot_be_used_is_one_line_and_exit_2(postgres_server, tmp_path):
    password = postgres_server.password
    for url in ("postgresql://nowhere", f"postgresql://nowait:{password}@127.0.0.1:{free_port()}/nowait",
                postgres_server.url_for("nowait", password="not-" + password)):
        for command in ("verify", "spend"):
            result = invoke("audit", command, "--store", url)
            assert result.exit_code == 2, (url, result.output)
            assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("error: ")
            assert password not in result.output
    both = invoke("audit", "verify", str(tmp_path / "audit.jsonl"), "--store", "sqlite:///x.sqlite")
    assert both.exit_code == 2 and "not both" in both.output
