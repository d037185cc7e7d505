"""The demo's hard-tier share: `hard_fraction` in the plan and `--hard-fraction` on the command,
the forms it draws, and the per-tier figures of the live view and the report."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nowait.bench.load_workload import corpus_documents
from nowait.demo.plan import COMPARISON, PAIRED, REALTIME, DemoPlan, schedule
from nowait.demo.scoreboard import Scoreboard
from tests.load_support import cli_app


def realtime_tiers(plan: DemoPlan) -> list[str]:
    arrivals, _ = schedule(plan, "nowait", "ar")
    return [a.request.doc.tier for a in arrivals if a.route == REALTIME]


@pytest.mark.parametrize("fraction", [0.3, 0.5, 1.0])
def test_the_plan_draws_its_hard_share_of_the_real_time_forms(fraction):
    plan = DemoPlan(duration_s=30, realtime_rate=2, seed=11, hard_fraction=fraction)
    drawn = realtime_tiers(plan)
    assert drawn.count("hard") == round(fraction * len(drawn)) and len(drawn) > 40
    assert drawn == realtime_tiers(plan)  # the same places every run
    arrivals, _ = schedule(plan, "nowait", "ar")
    # A form pinned to AR is the very form the router got: the tiers compare like with like.
    routed = {a.at_s: a.request.doc for a in arrivals if a.route == REALTIME and a.paired}
    assert all(routed[a.at_s] == a.request.doc for a in arrivals if a.route == COMPARISON)


def test_no_hard_share_sends_the_forms_of_every_earlier_demo():
    plan = DemoPlan(duration_s=20, realtime_rate=2, seed=7, hard_fraction=0.0)
    arrivals, _ = schedule(plan, "nowait", "ar")
    forms = [a.request.doc for a in arrivals if a.route == REALTIME]
    assert forms == corpus_documents(len(forms), ("kyc",), None, 7)


def test_the_command_passes_hard_fraction_to_the_plan(monkeypatch, tmp_path):
    import nowait.demo.runner as runner

    seen = {}

    def capture(settings):
        seen["plan"] = settings.plan
        return runner.DemoResult(exit_code=0, report=None, verdict=["ok"], summary_board=Scoreboard())

    monkeypatch.setattr(runner, "run_demo", capture)
    result = CliRunner().invoke(cli_app(), ["demo", "--hard-fraction", "0.5", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen["plan"].hard_fraction == 0.5
    assert DemoPlan().hard_fraction == 0.3  # the default share
    bad = CliRunner().invoke(cli_app(), ["demo", "--hard-fraction", "1.5"])
    assert bad.exit_code == 2 and "--hard-fraction must be in [0, 1]" in bad.stderr


def test_per_tier_figures_and_their_table_on_hand_made_answers():
    from rich.console import Console

    from nowait.bench.load_metrics import EngineRun, RequestRecord
    from nowait.demo.gauges import EngineGauges, Snapshot
    from nowait.demo.view import live_view

    def answer(route, engine, cost, fallback=False, flagged=False):
        attempts = (EngineRun("diffusion", 0.1, 10, 10),) if route == REALTIME else ()
        attempts += (EngineRun("ar", 0.3, 10, 10),) if fallback else ()
        return RequestRecord(route, 0.0, 0.2, engine=engine, fallback=fallback, cost_usd=cost, attempts=attempts,
                             low_confidence=flagged, label=route + (PAIRED if route == REALTIME else ""))

    board = Scoreboard()
    board.snapshots.append(Snapshot(1.0, {"ar": EngineGauges("ar", kind="ar"),
                                          "diffusion": EngineGauges("diffusion", kind="diffusion")}))
    board.add(REALTIME, answer(REALTIME, "diffusion", 1e-3), "clean")
    board.add(REALTIME, answer(REALTIME, "diffusion", 1e-3), "clean")
    board.add(REALTIME, answer(REALTIME, "ar", 5e-3, fallback=True, flagged=True), "hard")
    board.add(REALTIME, answer(REALTIME, "diffusion", 1e-3), "hard")
    board.add(COMPARISON, answer(COMPARISON, "ar", 4e-3), "hard")
    by_tier = {t.tier: t.as_dict() for t in board.tier_stats()}
    assert list(by_tier) == ["clean", "hard"]
    assert by_tier["clean"]["fallback_rate"] == 0.0 and by_tier["clean"]["ar_forms"] == 0
    hard = by_tier["hard"]
    assert hard["forms"] == 2 and hard["fallback_rate"] == 0.5 and hard["low_confidence_flags"] == 1
    assert hard["routed_usd_per_request"] == pytest.approx(3e-3)  # the fallback's AR run folded in
    assert hard["ar_usd_per_request"] == pytest.approx(4e-3) and hard["ar_forms"] == 1
    console = Console(record=True, width=200)
    console.print(live_view(board, DemoPlan(duration_s=10)))
    screen = console.export_text()
    assert "real-time KYC per corpus tier" in screen and "50%" in screen
