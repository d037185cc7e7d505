"""The gateway's config (defaults, YAML, errors naming the field), its CLI commands, the cost and
metrics arithmetic, and a smoke run of `nowait bench gateway` with tiny counts."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from nowait.bench.gateway import register as register_bench
from nowait.engines.speculative import SPEC_SETTINGS
from nowait.gateway.cli import register as register_serve
from nowait.gateway.config import ConfigError, default_config, load_config, parse_config
from nowait.gateway.engine_stats import EngineStats
from nowait.gateway.ledger import owned_cost_usd, remote_cost_usd
from nowait.planner.cost import cost_per_mtok
from nowait.router import DataClass, pin, restrict_to_available

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nowait.yaml"


def test_defaults_serve_the_demo_engines_behind_the_router_model():
    config = default_config()
    assert list(config.engines) == ["ar", "spec", "diffusion"]
    assert config.server.router_model == "nowait" and config.server.host == "127.0.0.1"
    assert config.defaults.data_class is DataClass.restricted  # data leaves only when the caller says so
    policy = config.routing_policy()
    assert (policy.batch_engine, policy.fast_engine, policy.fallback_engine) == ("ar", "diffusion", "ar")


def test_the_default_spec_engine_takes_the_best_method_with_its_tuned_settings():
    spec = default_config().engines["spec"]
    assert spec.method == "hybrid" and spec.speculative_config() == SPEC_SETTINGS["hybrid"]
    assert SPEC_SETTINGS["hybrid"].draft_confidence > 0 and SPEC_SETTINGS["hybrid"].lookup_gamma is not None
    # Another method starts from its own tuned settings; what the file sets wins.
    draft = parse_config({"engines": {"s": {"kind": "spec", "method": "draft", "gamma": 6}},
                          "routing": {"fast_engine": None, "batch_engine": "s", "fallback_engine": "s",
                                      "owned_frontier_engine": "s"}}).engines["s"]
    assert draft.speculative_config() == replace(SPEC_SETTINGS["draft"], gamma=6)
    example = load_config(EXAMPLE).engines["spec"]
    assert example.method == "hybrid" and example.speculative_config() == SPEC_SETTINGS["hybrid"]


def test_spec_engines_load_their_draft_and_refuse_one_with_another_tokenizer(tmp_path, codec):
    """hybrid and draft load the draft with its tokenizer; a draft trained with another tokenizer
    of the same size, or a missing one, leaves that engine unavailable with the reason, while
    ngram needs no draft at all."""
    from nowait.checkpoints import save_pretrained
    from nowait.engines.base import GenerationRequest, SamplingParams
    from nowait.gateway.engines import build_backends
    from tests.conftest import build_model, swapped_codec
    from tests.gateway_support import save_tiny_models

    models = save_tiny_models(tmp_path / "models", codec)
    alien = save_pretrained(build_model(1, vocab_size=codec.vocab_size, num_layers=1), swapped_codec(codec),
                            tmp_path / "alien-draft")
    ar = {"kind": "spec", "model": models["ar"], "max_num_seqs": 2}
    config = parse_config({"engines": {
        "ar": {"kind": "ar", "model": models["ar"], "max_num_seqs": 2},
        "spec": {**ar, "draft": models["draft"]},
        "spec-draft": {**ar, "draft": models["draft"], "method": "draft"},
        "alien": {**ar, "draft": str(alien)},
        "no-draft": {**ar, "draft": str(tmp_path / "missing"), "method": "draft"},
        "lookup": {**ar, "draft": str(tmp_path / "missing"), "method": "ngram"},
        "diffusion-drafted": {**ar, "draft": models["diffusion"], "method": "diffusion", "drafter_tau": 0.9},
        "causal-drafter": {**ar, "draft": models["draft"], "method": "diffusion"},
    }, "routing": {"fast_engine": None}})
    backends = build_backends(config)
    assert backends["ar"].worker.engine.prefix_cache is not None  # on by default
    assert backends["spec"].worker.engine.prefix_cache is not None
    off = build_backends(parse_config({"engines": {"ar": {"kind": "ar", "model": models["ar"], "max_num_seqs": 2,
                                                          "prefix_cache_tokens": 0}},
                                       "routing": {"fast_engine": None}}))
    assert off["ar"].worker.engine.prefix_cache is None
    for name in ("spec", "spec-draft", "lookup"):
        assert backends[name].available, backends[name].unavailable_reason
    hybrid = backends["spec"].worker.engine
    assert hybrid.speculative == SPEC_SETTINGS["hybrid"] and hybrid.draft is not None
    assert backends["spec-draft"].worker.engine.speculative == SPEC_SETTINGS["draft"]
    assert backends["lookup"].worker.engine.draft is None
    [completion] = hybrid.generate([GenerationRequest(codec.encode("Name: Ann Name:"), SamplingParams(max_tokens=8))])
    assert completion.draft_tokens_proposed > 0
    reason = backends["alien"].unavailable_reason
    assert not backends["alien"].available
    assert "tokenizer" in reason and str(alien) in reason and "method: ngram" in reason, reason
    assert not backends["no-draft"].available and "draft model" in backends["no-draft"].unavailable_reason
    assert backends["ar"].available  # the others still serve
    drafted = backends["diffusion-drafted"].worker.engine
    assert drafted.drafter is not None and drafted.speculative.drafter_tau == 0.9
    [completion] = drafted.generate([GenerationRequest(codec.encode("Name: Ann"), SamplingParams(max_tokens=8))])
    assert completion.draft_forwards > 0
    assert not backends["causal-drafter"].available
    assert "diffusion model" in backends["causal-drafter"].unavailable_reason


def test_absolute_paths_in_a_file_are_kept(tmp_path):
    data = tmp_path / "elsewhere" / "data"
    path = tmp_path / "nowait.yaml"
    path.write_text(f"engines:\n  ar: {{kind: ar}}\nrouting: {{fast_engine: null}}\ndata_dir: {data}\n"
                    f"batches: {{database: {data / 'jobs.sqlite'}}}\n")
    config = load_config(path)
    assert config.data_dir == data and config.audit_log_path == data / "audit.jsonl"
    assert config.batch_database == data / "jobs.sqlite"


def test_a_spec_engine_without_a_draft_key_takes_its_methods_bundled_draft(tmp_path):
    path = tmp_path / "nowait.yaml"
    path.write_text("engines:\n  ar: {kind: ar}\n  s: {kind: spec, method: diffusion}\n  h: {kind: spec}\n"
                    "routing: {fast_engine: null}\n")
    config = load_config(path)
    assert config.engines["s"].draft is None and config.engines["s"].draft_model == "diffusion"
    assert config.engines["h"].draft_model == "draft"


def test_the_example_config_is_valid_and_resolves_paths_next_to_it():
    config = load_config(EXAMPLE)
    assert "frontier-api" in config.engines and config.routing_policy().remote_frontier_engines
    assert config.data_dir.is_absolute() and config.data_dir.parent == EXAMPLE.parent


@pytest.mark.parametrize("data, message", [
    ({"engines": {"ar": {"kind": "ar", "max_num_seqs": 0}}}, "engines.ar.max_num_seqs: Input should be greater"),
    ({"engines": {"ar": {"kind": "ar", "speed": 3}}}, "engines.ar.speed: Extra inputs are not permitted"),
    ({"engines": {"ar": {"kind": "ar", "prefix_cache_tokens": -1}}}, "engines.ar.prefix_cache_tokens: Input should"),
    ({"engines": {"ar": {"kind": "gpu"}}}, "engines.ar: Input tag 'gpu'"),
    ({"engines": {"ar": {"kind": "ar"}, "api": {"kind": "remote", "base_url": "https://x/v1", "model": "m",
                                                 "input_usd_per_mtok": 1, "output_usd_per_mtok": 2,
                                                 "data_classes": ["restricted"]}}},
     "engines.api: restricted data never leaves"),
    ({"engines": {"ar": {"kind": "ar"}}, "routing": {"fast_engine": "diffusion"}},
     "routing.fast_engine: 'diffusion' is not a configured engine"),
    ({"engines": {"ar": {"kind": "ar"}, "api": {"kind": "remote", "base_url": "https://x/v1", "model": "m",
                                                 "input_usd_per_mtok": 1, "output_usd_per_mtok": 2}},
      "routing": {"fast_engine": None, "batch_engine": "api"}}, "routing.batch_engine: 'api' is an external"),
    ({"engines": {"d": {"kind": "diffusion", "options": {"tau": 2}}}, "routing": {"fast_engine": "d"}},
     "engines.d.options: tau must be in (0, 1]"),
    ({"engines": {}}, "engines: "),
    ({"engines": {"ar": {"kind": "ar"}, "s": {"kind": "spec", "method": "tree"}}},
     "engines.s.method: Input should be 'hybrid', 'draft', 'ngram' or 'diffusion'"),
    ({"engines": {"ar": {"kind": "ar"}, "s": {"kind": "spec", "draft_confidence": 1.0}}},
     "engines.s.draft_confidence: Input should be less than 1"),
    ({"engines": {"ar": {"kind": "ar"}, "s": {"kind": "spec", "lookup_gamma": 0}}},
     "engines.s.lookup_gamma: Input should be greater than or equal to 1"),
])
def test_a_bad_field_is_named(data, message):
    with pytest.raises(ConfigError) as error:
        parse_config(data, "nowait.yaml")
    assert str(error.value).startswith("nowait.yaml: ") and message in str(error.value), str(error.value)


def test_a_bad_file_is_one_clear_line(tmp_path):
    path = tmp_path / "nowait.yaml"
    path.write_text("engines: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


def test_serve_and_bench_gateway_register_and_refuse_bad_configs(tmp_path):
    app = typer.Typer()
    register_serve(app)
    bench = typer.Typer()
    register_bench(bench)
    app.add_typer(bench, name="bench")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"engines": {"ar": {"kind": "ar", "max_queue": -1}}}))
    for args in (["serve", "--config", str(bad)], ["bench", "gateway", "--config", str(bad)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "engines.ar.max_queue" in result.output, result.output


def test_costs_follow_the_cost_identity():
    assert owned_cost_usd(3600, 36.0) == pytest.approx(36.0)
    assert remote_cost_usd(1_000_000, 500_000, 2.0, 10.0) == pytest.approx(7.0)
    now = [0.0]
    stats = EngineStats(window_s=60, node_usd_per_hour=36.0, clock=lambda: now[0])
    assert math.isnan(stats.effective_usd_per_mtok())
    now[0] = 60.0
    stats.record(busy_s=30.0, tokens=3000)  # 100 tokens per busy second, busy half the window
    assert stats.utilization() == pytest.approx(0.5) and stats.throughput() == pytest.approx(100)
    assert stats.effective_usd_per_mtok() == pytest.approx(cost_per_mtok(36.0, 100, 0.5))


def test_router_extensions():
    policy = default_config().routing_policy()
    decision = pin("diffusion", policy)
    assert decision.rule == "pinned" and decision.fallback_engine == "ar"
    assert pin("spec", policy).fallback_engine is None
    assert restrict_to_available(policy, {"ar", "spec"}).fast_engine is None


def test_bench_gateway_smoke(tmp_path, codec):
    from nowait.bench.gateway import run_gateway_bench
    from tests.gateway_support import base_config, free_port, save_tiny_models

    models = save_tiny_models(tmp_path / "models", codec)
    config = parse_config(base_config(models, tmp_path / "data", free_port()))
    result = run_gateway_bench(config, "ar", requests=3, clients=4, max_tokens=4)
    assert result["concurrency"]["errors"] == 0 and result["concurrency"]["output_tokens"] == 16
    assert set(result["latency"]["added_ms"]) == {"p50", "p99"}
    json.dumps(result)


def test_serve_overrides_are_validated_as_a_files_values_are(tmp_path):
    app = typer.Typer()
    register_serve(app)
    app.command("noop")(lambda: None)  # a second command keeps "serve" a subcommand
    for args, field in ((["--port", "70000"], "--port"), (["--threads", "-1"], "--threads")):
        result = CliRunner().invoke(app, ["serve", *args])
        assert result.exit_code == 2 and field in result.output, result.output


def test_a_file_without_engines_serves_the_bundled_ones(tmp_path):
    path = tmp_path / "two-lines.yaml"
    path.write_text("routing:\n  fallback_engine: spec\n")
    config = load_config(path)
    assert set(config.engines) == {"ar", "spec", "diffusion"} and config.routing.fallback_engine == "spec"


def test_engine_threads_share_the_cores_among_the_in_process_engines():
    config = default_config()  # ar, spec and diffusion in process
    assert config.in_process_engine_names() == ["ar", "spec", "diffusion"]
    assert [config.engine_threads(cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 5]  # one core reserved
    one = config.model_copy(update={"engines": {"diffusion": config.engines["diffusion"]}})
    assert [one.engine_threads(cores) for cores in (1, 2, 16)] == [1, 1, 15]  # alone, every core but one
    unreserved = one.model_copy(update={"server": one.server.model_copy(update={"reserved_cores": 0})})
    assert unreserved.engine_threads(2) == 2
    pinned = config.model_copy(update={"server": config.server.model_copy(update={"torch_threads": 4})})
    assert pinned.engine_threads(2) == 4  # the config's number wins


def test_the_server_sets_torch_threads_when_it_starts(tmp_path, codec, monkeypatch):
    import torch

    from tests.gateway_support import base_config, free_port, live_server, save_tiny_models

    models = save_tiny_models(tmp_path / "models", codec)
    config = base_config(models, tmp_path / "data", free_port())  # 3 engines in process, 1 remote
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(7)))
    torch.set_num_threads(4)
    seen = []
    try:
        with live_server(config):
            # Read on a new thread, as an engine's: a thread takes torch's setting at its first
            # use, so one that ran before (this test's) keeps its own.
            reader = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            reader.start()
            reader.join()
    finally:
        torch.set_num_threads(1)  # the suite's setting (tests/conftest.py)
    assert seen == [2]  # 7 cores // 3 engines
