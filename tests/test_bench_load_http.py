"""bench load against any OpenAI-compatible server: a small fake one on loopback (what vLLM or SGLang
look like to the bench: no engine kinds, no nowait fields), and the bad arguments."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nowait.planner.profile import fit_profile, load_profile
from tests.gateway_support import free_port
from tests.load_support import cli_app, fake_openai_app, last_json, serve

FIRST_TOKEN_S, TOKEN_GAP_S = 0.01, 0.004


@pytest.fixture(scope="module")
def fake():
    app = fake_openai_app(first_token_s=FIRST_TOKEN_S, token_gap_s=TOKEN_GAP_S, tokens=6)
    with serve(app) as url:
        yield url, app


def bench(*args: str):
    return CliRunner().invoke(cli_app(), ["bench", "load", *args])


def test_concurrent_runs_with_report_and_planner_profile(fake, tmp_path):
    url, app = fake
    result = bench("--base-url", url, "--profile", "concurrent", "--rate", "1,3", "--max-requests", "6",
                   "--json", "--report", str(tmp_path / "report"), "--profile-out", str(tmp_path / "bench.json"))
    assert result.exit_code == 0, result.output
    report = last_json(result.stdout)
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["concurrent@1", "concurrent@3"]
    for run in runs:
        assert run["target"] == "fake-model" and run["successful"] == 6 and run["errors"] == 0
        assert run["mean_output_tokens"] == 6  # the usage chunk, not the chunk count
        assert run["ttft_ms"]["p50"] >= FIRST_TOKEN_S * 1000
        assert run["itl_ms"]["p50"] >= TOKEN_GAP_S * 1000 * 0.9
        assert run["e2e_ms"]["p99"] >= run["e2e_ms"]["p90"] >= run["e2e_ms"]["p50"]
        assert run["goodput"]["fraction"] == 1.0 and run["accuracy"]["field_accuracy"] == 0.0
    assert runs[1]["mean_concurrency"] > runs[0]["mean_concurrency"]
    for name in ("report.html", "load.json", "latency_vs_rate.png", "tokens_vs_concurrency.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    # Metadata travels as headers; the body is plain OpenAI (with the kind's JSON Schema).
    sent = app.state.received[-1]
    assert sent["headers"]["x-nowait-latency-budget-ms"] == "1000"
    assert sent["body"]["response_format"]["type"] == "json_schema" and "nowait" not in sent["body"]
    profile = load_profile(tmp_path / "bench.json")  # a server that says nothing is taken as AR
    assert {m.engine for m in profile.measurements} == {"ar"}
    assert sorted(m.batch for m in profile.measurements) == [1, 3]
    assert "ar" in fit_profile(profile)


def test_sweep_runs_synchronous_throughput_then_rates_between(fake):
    url, _ = fake
    result = bench("--base-url", f"{url}/v1", "--model", "fake-model", "--profile", "sweep", "--rate", "3",
                   "--max-requests", "4", "--max-concurrency", "4", "--no-warmup", "--json")
    assert result.exit_code == 0, result.output
    runs = last_json(result.stdout)["runs"]
    assert [r["profile"] for r in runs] == ["synchronous", "concurrent", "poisson"]
    low, high = runs[0]["requests_per_s"], runs[1]["requests_per_s"]
    assert min(low, high) <= runs[2]["rate"] <= max(low, high)


def test_streamed_requests_reuse_one_connection(fake):
    # A stream left unread after `[DONE]` is closed with its connection: each request would then
    # pay a new connection's set-up, inside its TTFT, which a pooling client (guidellm, the
    # OpenAI SDK) does not.
    url, app = fake
    before = len(app.state.received)
    result = bench("--base-url", url, "--max-requests", "4", "--no-warmup", "--no-schema", "--json")
    assert result.exit_code == 0, result.output
    assert last_json(result.stdout)["runs"][0]["successful"] == 4
    sent = app.state.received[before:]
    assert len(sent) == 4 and len({r["client_port"] for r in sent}) == 1


def test_poisson_bounded_by_seconds_without_streaming(fake):
    url, _ = fake
    result = bench("--base-url", url, "--profile", "poisson", "--rate", "50", "--max-seconds", "0.3",
                   "--no-stream", "--no-warmup", "--kinds", "kyc")
    assert result.exit_code == 0, result.output
    assert "poisson@50/s" in result.stdout and "fake-model" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--profile", "poisson", "--rate", "0"], "--rate must be greater than 0"),
    (["--profile", "concurrent", "--rate", "two"], "--rate takes numbers"),
    (["--max-requests", "0"], "--max-requests must be at least 1"),
    (["--engine", "ar"], "exactly one target"),
    (["--workload", "nightly"], "unknown workload"),
    (["--kinds", "passport"], "unknown document kind"),
])
def test_bad_arguments_are_one_clear_line(args, message):
    result = bench("--base-url", "http://127.0.0.1:9", *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in result.output


def test_unreachable_server_and_unknown_model_are_one_clear_line(fake):
    result = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--max-requests", "1")
    assert result.exit_code == 2 and "cannot reach" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    url, _ = fake
    result = bench("--base-url", url, "--model", "gpt-9", "--max-requests", "1")
    assert result.exit_code == 2 and "model gpt-9 is not served" in result.stderr
