"""`nowait bench gateway --tenant-keys`: keys on and keys off timed side by side in one run, on
the real app, with what the audit chain adds timed on the run's own entries."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from nowait.cli import app
from tests.load_support import last_json, save_corpus_models

runner = CliRunner()


def test_bench_gateway_times_keys_on_against_keys_off(tmp_path, codec):
    models = save_corpus_models(tmp_path / "models", codec, diffusion=False)
    config = {"server": {"torch_threads": 1}, "auth": {"api_keys": [], "api_keys_env": None},
              "data_dir": str(tmp_path / "data"), "routing": {"fast_engine": None},
              "engines": {"ar": {"kind": "ar", "model": str(models / "ar"), "max_num_seqs": 2}}}
    path = tmp_path / "nowait.yaml"
    path.write_text(yaml.safe_dump(config))
    requests = 2
    result = runner.invoke(app, ["bench", "gateway", "--config", str(path), "--requests", str(requests),
                                 "--clients", "1", "--max-tokens", "1", "--tenant-keys", "--json"], prog_name="nowait")
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    keys = report["latency"]["tenant_keys"]
    assert keys["keys_on_ms"]["p50"] > 0 and keys["keys_off_ms"] == report["latency"]["gateway_ms"]
    assert keys["added_ms"]["p50"] == round(keys["keys_on_ms"]["p50"] - keys["keys_off_ms"]["p50"], 3)
    # Both sides went through the router, warm-up rounds included: two entries per round.
    chain = keys["audit_chain_us"]
    assert chain["entries"] == 2 * (requests + 2) and chain["chained_us"]["p50"] > 0
    assert chain["added_us"]["p50"] == round(chain["chained_us"]["p50"] - chain["unchained_us"]["p50"], 2)
    steps = keys["key_path_us"]
    assert steps["store_key_us"]["p50"] > 0 and steps["limits_us"]["p50"] > 0
    assert steps["added_p50_us"] == round(steps["store_key_us"]["p50"] - steps["configured_key_us"]["p50"]
                                          + steps["limits_us"]["p50"], 2)
    # The serving thread's CPU per request, each side, and keys on less keys off round by round.
    used = keys["server_cpu_ms"]
    assert used["keys_on"]["p50"] > 0 and used["keys_off"]["p50"] > 0
    assert used["keys_on"]["p50"] < keys["keys_on_ms"]["p99"] * requests  # CPU seconds, not a clock's reading
    goals = report["goals"]
    assert goals["tenant_keys_server_cpu_p50_ms"] == round(used["pairwise_added"]["p50"]
                                                           + chain["added_us"]["p50"] / 1000, 3)
    assert goals["tenant_keys_p50_met"] == (goals["tenant_keys_p50_ms"] <= goals["tenant_keys_p50_ms_at_most"])
    assert goals["tenant_keys_in_process_p50_ms"] == round((steps["added_p50_us"] + chain["added_us"]["p50"]) / 1000, 3)
    plain = runner.invoke(app, ["bench", "gateway", "--config", str(path), "--requests", "1", "--clients", "1",
                                "--max-tokens", "1", "--tenant-keys"], prog_name="nowait")
    assert plain.exit_code == 0, plain.output
    assert "keys on" in plain.output and "audit chain adds" in plain.output and "key lookup" in plain.output
    assert "server CPU" in plain.output
