"""bench load against the nowait gateway (tiny random checkpoints) and against the same engines in
process: routed answers say their engine, the Batch API workload completes, the profile holds
both AR and diffusion measurements."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from nowait.planner.profile import load_profile
from tests.gateway_support import API_KEY, free_port, live_server
from tests.load_support import cli_app, last_json, save_corpus_models

# Fixed diffusion steps keep a random model's template decoding short; threshold 0: no fallbacks.
FAST_DIFFUSION = {"policy": "fixed", "steps": 4, "template_block": 64}


def gateway_config(root, port: int, codec) -> dict:
    models = save_corpus_models(root / "models", codec, diffusion=True)
    return {"server": {"host": "127.0.0.1", "port": port, "request_timeout_s": 60},
            "auth": {"api_keys": [API_KEY], "api_keys_env": None}, "data_dir": str(root / "data"),
            "engines": {"ar": {"kind": "ar", "model": str(models / "ar"), "max_num_seqs": 8},
                        "diffusion": {"kind": "diffusion", "model": str(models / "diffusion"),
                                      "options": FAST_DIFFUSION}},
            "routing": {"confidence_threshold": 0.0}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("bench-load-gateway")
    config = gateway_config(root, free_port(), codec)
    (root / "nowait.yaml").write_text(yaml.safe_dump(config))
    with live_server(config) as live:
        yield live, root


def bench(*args: str):
    return CliRunner().invoke(cli_app(), ["bench", "load", *args])


def test_routed_and_pinned_models_through_the_gateway(setup, tmp_path):
    live, _ = setup
    result = bench("--base-url", live.base_url, "--api-key", API_KEY, "--model", "nowait,ar", "--max-requests", "2",
                   "--kinds", "kyc", "--json", "--profile-out", str(tmp_path / "bench.json"))
    assert result.exit_code == 0, result.output
    runs = {r["target"]: r for r in last_json(result.stdout)["runs"]}
    assert runs["nowait"]["engines"] == {"diffusion": 2} and runs["nowait"]["errors"] == 0
    assert runs["ar"]["engines"] == {"ar": 2} and runs["ar"]["itl_ms"] is not None
    profile = load_profile(tmp_path / "bench.json")
    assert {m.engine for m in profile.measurements} == {"ar", "diffusion"}
    assert profile.engine_parameters.diffusion.tokens_per_forward > 1  # a pass commits several tokens
    assert profile.engine_parameters.diffusion.fallback_rate == 0.0


def test_batch_workload_through_the_batch_api(setup):
    live, _ = setup
    result = bench("--base-url", live.base_url, "--api-key", API_KEY, "--workload", "batch", "--max-requests", "3",
                   "--kinds", "letter_of_credit", "--json")
    assert result.exit_code == 0, result.output
    batch = last_json(result.stdout)["batch"]
    assert batch["status"] == "completed" and batch["successful"] == 3 and batch["errors"] == 0
    assert batch["engines"] == {"ar": 3} and batch["output_tokens_per_s"] > 0 and batch["cost_usd"] > 0


def test_engines_in_process(setup):
    _, root = setup
    result = bench("--engine", "ar,diffusion", "--config", str(root / "nowait.yaml"), "--profile", "concurrent",
                   "--rate", "2", "--max-requests", "2", "--kinds", "kyc", "--json")
    assert result.exit_code == 0, result.output
    runs = last_json(result.stdout)["runs"]
    assert [(r["target"], r["kind"], r["successful"]) for r in runs] == [("ar", "ar", 2), ("diffusion", "diffusion", 2)]
    missing = bench("--engine", "frontier", "--config", str(root / "nowait.yaml"))
    assert missing.exit_code == 2 and "not configured" in missing.stderr


def test_a_system_prompt_file_goes_before_every_instruction_and_reaches_the_prefix_cache(setup, tmp_path):
    import httpx

    live, _ = setup
    policy = tmp_path / "policy.txt"
    policy.write_text("Follow the bank's extraction policy: copy every field exactly as the form writes it. " * 3)

    def hits() -> float:
        lines = httpx.get(f"{live.base_url}/metrics").text.splitlines()
        found = [line for line in lines if line.startswith('nowait:prefix_cache_hits_total{engine="ar"}')]
        return float(found[0].split()[-1]) if found else 0.0

    before = hits()
    result = bench("--base-url", live.base_url, "--api-key", API_KEY, "--model", "ar", "--max-requests", "3",
                   "--kinds", "kyc", "--system-prompt-file", str(policy), "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    assert report["workload"]["system_prefix_chars"] == len(policy.read_text().strip())
    assert report["runs"][0]["errors"] == 0
    assert hits() - before >= 16  # the shared policy text, stored at its second sighting, restored after
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for path, message in ((empty, "is empty"), (tmp_path / "missing.txt", "cannot read")):
        refused = bench("--base-url", live.base_url, "--system-prompt-file", str(path))
        assert refused.exit_code == 2 and message in refused.stderr


def test_the_system_prefix_comes_before_the_kinds_instruction():
    from nowait.bench.load_workload import LoadRequest
    from nowait.extraction.corpus import documents
    from nowait.tokenizer import instruction_for

    doc = documents("test", 1)[0]
    assert LoadRequest(doc).messages()[0]["content"] == instruction_for(doc.kind)
    system = LoadRequest(doc, system_prefix="Policy.").messages()[0]["content"]
    assert system == f"Policy.\n{instruction_for(doc.kind)}"
