"""`nowait demo` on tiny random checkpoints: every route served through the HTTP API, the batch
completed, the report written, exit 0; without a diffusion model the real-time route goes to AR
and the demo says so; bad arguments are one line."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from nowait.demo.plan import BATCH, COMPARISON, LOANS, PAIRED, REALTIME, ROUTES, DemoPlan, poisson_times, schedule
from nowait.demo.runner import judge
from nowait.demo.scoreboard import Scoreboard
from tests.load_support import cli_app, save_corpus_models

SHORT = ["--duration", "2.5", "--rate", "2", "--batch-size", "3", "--loans", "1", "--compare-every", "2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, codec):
    return save_corpus_models(tmp_path_factory.mktemp("demo-models"), codec, diffusion=True)


def demo(*args: str):
    return CliRunner().invoke(cli_app(), ["demo", *args])


def test_demo_serves_every_route_and_writes_the_report(models, tmp_path):
    config = {"engines": {
        "ar": {"kind": "ar", "model": str(models / "ar")},
        "spec": {"kind": "spec", "model": str(models / "ar"), "draft": str(models / "draft")},
        # Fixed steps keep a random model's decoding short; threshold 0: a random model is never sure.
        "diffusion": {"kind": "diffusion", "model": str(models / "diffusion"),
                      "options": {"policy": "fixed", "steps": 4, "template_block": 64}}},
        "routing": {"confidence_threshold": 0.0, "owned_frontier_engine": "spec"}}
    (tmp_path / "nowait.yaml").write_text(yaml.safe_dump(config))
    result = demo("--config", str(tmp_path / "nowait.yaml"), "--out", str(tmp_path / "out"), *SHORT)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    routes = summary["routes"]
    assert set(routes) == set(ROUTES)
    for route in routes.values():
        assert route["answered"] > 0 and route["errors"] == 0
    assert routes[REALTIME]["engines"] == {"diffusion": routes[REALTIME]["answered"]}
    assert routes[COMPARISON]["engines"] == {"ar": routes[COMPARISON]["answered"]}
    assert routes[LOANS]["rules"] == {"frontier": 1} and routes[LOANS]["engines"] == {"spec": 1}
    assert routes[BATCH]["rules"] == {"batch": 3}
    assert summary["batch"]["status"] == "completed" and summary["batch"]["completed"] == 3
    assert summary["comparison"]["fast_available"] and summary["comparison"]["routed_to"] == "diffusion"
    assert {t["engine"] for t in summary["engine_totals"]} == {"ar", "spec", "diffusion"}
    # The default share of hard-tier forms, each form counted in its tier's row.
    assert summary["plan"]["hard_fraction"] == 0.3
    assert sum(t["forms"] for t in summary["tiers"].values()) == routes[REALTIME]["answered"]
    assert summary["tiers"]["hard"]["forms"] == round(0.3 * routes[REALTIME]["sent"]) > 0
    assert all(t["usd_per_mtok"] > 0 for t in summary["engine_totals"])
    for name in ("report.html", "latency_over_time.png", "latency_by_route.png", "engines_over_time.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "ok: " in result.stdout and f"report: {tmp_path / 'out' / 'report.html'}" in result.stdout


def test_without_a_diffusion_model_real_time_work_goes_to_ar_and_the_demo_says_so(models, tmp_path):
    partial = tmp_path / "models"
    for name in ("ar", "draft"):
        shutil.copytree(models / name, partial / name)
    result = demo("--models", str(partial), "--out", str(tmp_path / "out"), *SHORT)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["engines"]["diffusion"]["available"] is False
    assert list(summary["routes"][REALTIME]["engines"]) == ["ar"]
    assert summary["comparison"]["fast_available"] is False
    assert "NOT AVAILABLE" in result.stdout and "no diffusion engine" in result.stdout
    assert "Train the diffusion model" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--duration", "0"], "--duration must be greater than 0"),
    (["--config", "x.yaml", "--models", "."], "not both"),
    (["--config", "/no/such/nowait.yaml"], "no such file"),
    (["--models", "/no/such/dir"], "no such directory"),
])
def test_bad_arguments_are_one_clear_line(args, message):
    result = demo(*args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output


def test_the_plan_is_reproducible_and_covers_every_route():
    plan = DemoPlan(duration_s=20, realtime_rate=2, compare_every=3, loans=2, seed=7)
    arrivals, batch = schedule(plan, "nowait", "ar")
    assert arrivals == schedule(plan, "nowait", "ar")[0]
    assert {a.route for a in arrivals} == {REALTIME, COMPARISON, LOANS}
    assert all(a.request.doc.kind == "kyc" for a in arrivals if a.route in (REALTIME, COMPARISON))
    assert [a.model for a in arrivals if a.route == COMPARISON][:1] == ["ar"]
    assert len(batch) == plan.batch_lines == 10 and {r.doc.kind for r in batch} == {"letter_of_credit"}
    times = poisson_times(2.0, 500.0, seed=1)
    assert times == sorted(times) and 900 < len(times) < 1100  # about rate x duration


def test_judge_names_what_went_wrong():
    board = Scoreboard()
    assert judge(board, interrupted=False)[0].startswith("ok")
    board.batch.lines, board.batch.status, board.batch.completed = 4, "cancelled", 2
    problems = judge(board, interrupted=True)
    assert problems[0].startswith("stopped early") and "the batch did not complete" in problems[1]


def test_a_demo_without_its_batch_engine_stops_with_one_line(tmp_path):
    (tmp_path / "models").mkdir()
    result = demo("--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"), "--duration", "1")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert "the batch engine 'ar' is not available" in lines[-1] and "Traceback" not in result.output


def test_scoreboard_comparison_and_live_view_on_hand_made_answers():
    from rich.console import Console

    from nowait.bench.load_metrics import EngineRun, RequestRecord
    from nowait.demo.gauges import EngineGauges, Snapshot, parse_metrics
    from nowait.demo.view import live_view

    def answer(route, engine, e2e, fallback=False, paired=True):
        attempts = (EngineRun("diffusion", 0.1, 10, 10, forwards=4),) if route == REALTIME else ()
        if fallback:
            attempts += (EngineRun("ar", 0.3, 10, 10, forwards=10),)
        label = route + (PAIRED if route == REALTIME and paired else "")
        return RequestRecord(route, 0.0, e2e, engine=engine, fallback=fallback, cost_usd=1e-3, output_tokens=10,
                             attempts=attempts, rule="fast" if route == REALTIME else "pinned", label=label)

    board = Scoreboard()
    engines = {"ar": EngineGauges("ar", kind="ar"), "diffusion": EngineGauges("diffusion", kind="diffusion")}
    parse_metrics('nowait:engine_utilization{engine="ar"} 0.25\n'
                  'nowait:effective_cost_usd_per_mtok{engine="ar"} NaN\n'
                  'nowait:generation_tokens_total{engine="diffusion"} 40.0\n', engines)
    assert engines["ar"].utilization == 0.25 and engines["ar"].usd_per_mtok is None
    assert engines["diffusion"].output_tokens == 40
    board.snapshots.append(Snapshot(1.0, engines, routing={
        "confidence_threshold": 0.277, "confidence_threshold_source": "/m/diffusion/calibration.json",
        "fallback_engine": "ar"}))
    for e2e in (0.1, 0.12, 0.14):
        board.add(REALTIME, answer(REALTIME, "diffusion", e2e))
    board.add(REALTIME, answer(REALTIME, "ar", 0.5, fallback=True))
    for e2e in (0.4, 0.45):
        board.add(COMPARISON, answer(COMPARISON, "ar", e2e))
    board.add(REALTIME, answer(REALTIME, "diffusion", 0.9, paired=False))  # not pinned: not in the comparison
    stats = board.route_stats(REALTIME)
    assert stats.fallback_rate == 0.2 and stats.engines == {"diffusion": 4, "ar": 1}
    c = board.comparison()
    assert c["fast_available"] and c["routed_to"] == "diffusion" and c["kept_p50_ms"] == pytest.approx(120)
    assert c["speedup"] == pytest.approx(425 / 130) and c["forms"] == 2
    console = Console(record=True, width=160)
    console.print(live_view(board, DemoPlan(duration_s=10)))
    screen = console.export_text()
    assert "25% re-ran on AR" in screen and "p50 120 ms for the answers it kept" in screen and "3.3x" in screen
    assert "below confidence 0.277 (calibrated by `nowait calibrate`) re-run on ar" in screen
