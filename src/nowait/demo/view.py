"""The demo's screens: the live view while traffic runs, the summary at the end (Rich).

Both are built from the scoreboard in the event loop's thread and handed to Rich as finished
renderables, so the refresh thread never reads state that is being written.
"""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from nowait.calibration import CALIBRATION_FILE
from nowait.demo.economics import EngineTotals
from nowait.demo.gauges import EngineGauges
from nowait.demo.plan import BATCH, ROUTE_TITLES, DemoPlan
from nowait.demo.scoreboard import Scoreboard


def _num(value: float | None, fmt: str = "{:.0f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _usd(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}" if value >= 1e-4 else f"${value:.2e}"


def availability(board: Scoreboard) -> Text:
    """One line naming every engine, and for an unavailable one why and where its work goes."""
    snapshot = board.latest
    text = Text("engines: ")
    if snapshot is None:
        return text + Text("(waiting for the first scrape)", style="dim")
    parts = []
    for name, g in snapshot.engines.items():
        if g.available:
            parts.append(Text(f"{name} ({g.kind}) up", style="green"))
        else:
            parts.append(Text(f"{name} ({g.kind}) NOT AVAILABLE", style="bold yellow"))
    text += Text(", ").join(parts)
    threshold = snapshot.routing.get("confidence_threshold")
    if threshold is not None:
        source = str(snapshot.routing.get("confidence_threshold_source", ""))
        origin = "calibrated by `nowait calibrate`" if source.endswith(CALIBRATION_FILE) else source
        text += Text(f"; diffusion answers below confidence {threshold:.3g} ({origin}) re-run on "
                     f"{snapshot.routing.get('fallback_engine', 'ar')}", style="dim")
    for name, g in snapshot.engines.items():
        if not g.available and g.kind == "diffusion":
            text += Text(f"\n  {name}: {g.reason or 'unavailable'}\n  -> latency-bound real-time work is routed to "
                         "AR instead, and the diffusion-vs-AR comparison below is AR against AR. Train the model "
                         "(`nowait train diffusion`) to see the full rule.", style="yellow")
    return text


def routes_table(board: Scoreboard, title: str = "requests per route") -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("route", "sent", "answered", "errors", "engine", "rule", "p50 ms", "p99 ms", "fallback",
                   "field acc", "$/request"):
        table.add_column(column, justify="left" if column in ("route", "engine", "rule") else "right")
    for stats in board.all_stats():
        batch = stats.route == BATCH
        table.add_row(
            ROUTE_TITLES[stats.route], str(stats.sent), str(stats.answered),
            Text(str(stats.errors), style="bold red" if stats.errors else ""), stats.engine_text,
            ", ".join(stats.rules) if stats.rules else "-",
            "-" if batch else _num(stats.p50_ms), "-" if batch else _num(stats.p99_ms),
            _num(stats.fallback_rate, "{:.0%}"), _num(stats.field_accuracy, "{:.3f}"), _usd(stats.usd_per_request))
    return table


def tiers_table(board: Scoreboard, title: str = "real-time KYC per corpus tier (AR: the same tier's forms "
                                                  "pinned to AR)") -> Table | Text:
    """Routed against pinned AR per tier: accuracy, fallback, $ per request with the fallbacks'
    AR runs folded in, latency and the low-confidence flags."""
    stats = board.tier_stats()
    if not stats:
        return Text("real-time KYC per corpus tier: waiting for answers", style="dim")
    table = Table(title=title, title_justify="left")
    for column in ("tier", "forms", "routed acc", "AR acc", "fallback", "routed $/req", "AR $/req", "routed p50",
                   "AR p50", "low-conf flags"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for t in stats:
        r, p = t.routed, t.pinned
        table.add_row(t.tier, str(r.answered), _num(r.field_accuracy, "{:.3f}"), _num(p.field_accuracy, "{:.3f}"),
                      _num(r.fallback_rate, "{:.0%}"), _usd(r.usd_per_request), _usd(p.usd_per_request),
                      _num(r.p50_ms), _num(p.p50_ms),
                      Text(f"{t.low_confidence}", style="bold yellow" if t.low_confidence else ""))
    return table


def engines_table(engines: dict[str, EngineGauges], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("engine", "kind", "running", "waiting", "tok/s busy", "utilization", "$/Mtok",
                   "$/Mtok w/ fallback", "fallback rate"):
        table.add_column(column, justify="left" if column in ("engine", "kind") else "right")
    for name, g in engines.items():
        if not g.available:
            table.add_row(name, g.kind, Text("not available", style="yellow"), "", "", "", "", "", "")
            continue
        table.add_row(name, g.kind, _num(g.running), _num(g.waiting), _num(g.tokens_per_s),
                      _num(g.utilization, "{:.0%}"), _usd(g.usd_per_mtok), _usd(g.usd_per_mtok_with_fallback),
                      _num(g.fallback_rate, "{:.0%}"))
    return table


def comparison_sentence(c: dict | None) -> tuple[str, str]:
    """(sentence, style) comparing the real-time route with the same forms pinned to AR."""
    if c is None:
        return "real-time route vs the same forms pinned to AR: waiting for answers", "dim"
    cost = (f"; ${c['routed_usd_per_request']:.2e} vs ${c['ar_usd_per_request']:.2e} per request"
            if c["routed_usd_per_request"] and c["ar_usd_per_request"] else "")
    if not c["fast_available"]:
        return (f"no diffusion engine: real-time KYC ran on {c['answered_by']} (p50 {c['routed_p50_ms']:.0f} ms); "
                f"the same forms pinned to {c['ar_engine']}: p50 {c['ar_p50_ms']:.0f} ms{cost}", "yellow")
    fell_back = c["fallback_rate"] or 0.0
    served = f"routed to {c['routed_to']}"
    if fell_back:
        kept = f", p50 {c['kept_p50_ms']:.0f} ms for the answers it kept" if c.get("kept_p50_ms") is not None else ""
        served += f"; {fell_back:.0%} re-ran on AR{kept}"
    speedup = c["speedup"] or 0.0
    forms = f" on the {c['forms']} forms sent both ways" if c.get("forms") else ""
    return (f"real-time KYC p50{forms}: {c['routed_p50_ms']:.0f} ms ({served}) vs {c['ar_p50_ms']:.0f} ms pinned "
            f"to {c['ar_engine']}: {speedup:.1f}x{cost}", "bold green" if speedup > 1 else "bold red")


def comparison_text(board: Scoreboard) -> Text:
    sentence, style = comparison_sentence(board.comparison())
    return Text(sentence, style=style)


def batch_text(board: Scoreboard) -> Text:
    b = board.batch
    if b.batch_id is None:
        return Text(f"batch: {b.status}" + (f" ({b.error})" if b.error else ""), style="dim")
    wall = f" in {b.wall_s:.1f} s" if b.wall_s is not None else ""
    style = "green" if b.status == "completed" and not b.failed else "yellow" if b.status != "completed" else "red"
    return Text(f"batch {b.batch_id}: {b.status}, {b.completed}/{b.lines} lines answered, {b.failed} failed{wall}",
                style=style)


def live_view(board: Scoreboard, plan: DemoPlan) -> Group:
    elapsed = min(board.elapsed_s, plan.duration_s)
    header = Table.grid(padding=(0, 1))
    header.add_row(Text("nowait demo", style="bold"), ProgressBar(total=plan.duration_s, completed=elapsed, width=40),
                   Text(f"{board.elapsed_s:4.0f}/{plan.duration_s:.0f} s  {board.phase}"))
    snapshot = board.latest
    engines = engines_table(snapshot.engines if snapshot else {}, "engines (live, last metrics window)")
    tokens = Text(f"output: {board.output_tokens_per_s():.0f} tok/s across routes", style="dim")
    return Group(header, availability(board), routes_table(board), batch_text(board), comparison_text(board),
                 tiers_table(board), engines, tokens)


def totals_table(totals: list[EngineTotals], wall_s: float) -> Table:
    table = Table(title=f"engines over the whole run ({wall_s:.0f} s, from the ledger)", title_justify="left")
    for column in ("engine", "answers", "output tokens", "busy s", "tok/s busy", "utilization", "node $/h",
                   "spent", "$/Mtok"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for t in totals:
        table.add_row(t.engine, str(t.answers), str(t.output_tokens), f"{t.busy_s:.1f}", _num(t.tokens_per_busy_s),
                      f"{t.utilization:.0%}", _num(t.node_usd_per_hour, "{:.2f}"), _usd(t.spent_usd),
                      _usd(t.usd_per_mtok))
    return table


def summary_view(board: Scoreboard, totals: list[EngineTotals], verdict: list[str], report: str | None) -> Group:
    parts = [availability(board), routes_table(board, f"summary: requests per route ({board.elapsed_s:.0f} s)"),
             batch_text(board), comparison_text(board), tiers_table(board, "summary: real-time KYC per corpus tier "
                                                                           "(AR: the same tier's forms pinned to AR)"),
             totals_table(totals, board.elapsed_s)]
    parts += [Text(line, style="bold green" if line.startswith("ok") else "bold red") for line in verdict]
    if report:
        parts.append(Text(f"report: {report}", style="bold"))
    return Group(*parts)


def status_line(board: Scoreboard, plan: DemoPlan) -> str:
    """A one-line progress report, for output that is not a terminal."""
    answered = sum(s.answered for s in board.all_stats())
    return (f"demo {board.elapsed_s:.0f}/{plan.duration_s:.0f} s ({board.phase}): {answered} answered, "
            f"{board.errors()} errors, batch {board.batch.status} {board.batch.completed}/{board.batch.lines}")
