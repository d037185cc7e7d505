"""bench load --stores: the Batch API through gateways the bench starts on SQLite and on
PostgreSQL (one and two replicas), with the store's cost per line measured beside them."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from nowait.bench.load_stores import StoreRun, parse_stores, store_cost_ms
from nowait.gateway.batch_store import BatchStore
from nowait.store.database import open_database
from tests.gateway_support import base_config, free_port, save_tiny_models
from tests.load_support import cli_app, last_json


def bench(*args: str):
    return CliRunner().invoke(cli_app(), ["bench", "load", *args])


def test_stores_are_a_kind_and_a_replica_count():
    assert parse_stores("sqlite, postgresql,postgresql:2") == [StoreRun("sqlite", 1), StoreRun("postgresql", 1),
                                                                StoreRun("postgresql", 2)]
    assert [r.label for r in parse_stores("postgresql:1,postgresql:3")] == ["postgresql", "postgresql:3"]
    for text, message in (("sqlite:2", "one process's store"), ("mysql", "unknown store"),
                          ("postgresql:x", "whole number"), ("postgresql:0", "at least one"), (" , ", "at least one")):
        with pytest.raises(ValueError, match=message):
            parse_stores(text)


@pytest.mark.parametrize(("args", "message"), [
    (["--stores", "sqlite"], "--workload batch"),
    (["--stores", "sqlite", "--workload", "batch", "--base-url", "http://127.0.0.1:9"], "leave out --base-url"),
    (["--stores", "sqlite:2", "--workload", "batch"], "one process's store"),
    (["--stores", "postgresql", "--workload", "batch", "--store", "sqlite:///x.sqlite"], "not a postgresql://"),
    (["--base-url", "http://127.0.0.1:9", "--store", "postgresql://u:p@h/d"], "--store names"),
])
def test_argument_errors_are_one_line_and_exit_2(args, message):
    result = bench(*args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_store_cost_loop_answers_a_whole_batch_once(kind, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'cost.sqlite'}" if kind == "sqlite" else request.getfixturevalue("postgres_url")
    cost = store_cost_ms(url, 25, 4)
    assert cost > 0
    database = open_database(url)
    store = BatchStore(database)
    try:
        [batch] = store.list_batches()
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed) == (25, 25)
        ids = [json.loads(row)["custom_id"] for row in store.file_content(batch.output_file_id).splitlines()]
        assert sorted(ids) == sorted(f"doc-{n}" for n in range(1, 26))
    finally:
        store.close()
        database.close()


def test_a_short_run_on_sqlite_and_two_replicas_on_postgresql(tmp_path, codec, postgres_url):
    models = save_tiny_models(tmp_path / "models", codec)
    config = base_config(models, tmp_path / "unused", free_port(), defaults={"max_tokens": 2, "data_class": "internal"})
    config["engines"] = {"ar": config["engines"]["ar"]}
    config["routing"] = {"fast_engine": None}
    config["server"]["torch_threads"] = 1
    (tmp_path / "nowait.yaml").write_text(yaml.safe_dump(config))
    result = bench("--workload", "batch", "--stores", "sqlite,postgresql:2", "--store", postgres_url,
                   "--config", str(tmp_path / "nowait.yaml"), "--model", "ar", "--max-requests", "4",
                   "--max-tokens", "2", "--no-schema", "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    assert [(r["store"], r["replicas"], r["status"], r["successful"]) for r in report["runs"]] == [
        ("sqlite", 1, "completed", 4), ("postgresql:2", 2, "completed", 4)]
    assert all(r["lines_per_s"] > 0 and r["store_ms_per_line"] > 0 for r in report["runs"])
    sqlite, postgres = (r["store_ms_per_line"] for r in report["runs"])
    assert report["postgresql_extra_ms_per_line"] == pytest.approx(postgres - sqlite, abs=0.002)
