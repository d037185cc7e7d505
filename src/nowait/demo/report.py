"""The demo's HTML report: the summary as tables, four PNG plots (matplotlib, Agg), summary.json.

    latency_over_time.png   every answered request: e2e latency against when it was sent, per
                            route, with the real-time latency budget
    latency_by_route.png    p50 and p99 per route: the real-time route beside the same forms on AR
    accuracy_by_route.png   field accuracy against the ground truth per route
    engines_over_time.png   per engine, scraped every second: utilization and effective $/Mtok
                            (the cost identity over the metrics window, log scale)
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from nowait.demo.economics import EngineTotals
from nowait.demo.plan import BATCH, ROUTE_TITLES, ROUTES, DemoPlan
from nowait.demo.scoreboard import Scoreboard
from nowait.demo.view import comparison_sentence
from nowait.plots import finish_figure, pyplot, save_figure


def summary_dict(board: Scoreboard, totals: list[EngineTotals], plan: DemoPlan, verdict: list[str],
                 interrupted: bool) -> dict:
    latest = board.latest
    return {
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__} | {"batch_lines": plan.batch_lines},
        "elapsed_s": round(board.elapsed_s, 3), "interrupted": interrupted, "verdict": verdict,
        "engines": {name: {"kind": g.kind, "available": g.available, "reason": g.reason}
                    for name, g in (latest.engines.items() if latest else [])},
        "routes": {s.route: {"title": ROUTE_TITLES[s.route], "sent": s.sent, "answered": s.answered,
                             "errors": s.errors, "engines": s.engines, "rules": s.rules, "p50_ms": s.p50_ms,
                             "p99_ms": s.p99_ms, "fallback_rate": s.fallback_rate,
                             "field_accuracy": s.field_accuracy, "usd_per_request": s.usd_per_request,
                             "output_tokens": s.output_tokens} for s in board.all_stats()},
        "batch": {"batch_id": board.batch.batch_id, "status": board.batch.status, "lines": board.batch.lines,
                  "completed": board.batch.completed, "failed": board.batch.failed, "wall_s": board.batch.wall_s,
                  "error": board.batch.error},
        "comparison": board.comparison(),
        "tiers": {t.tier: t.as_dict() for t in board.tier_stats()},
        "engine_totals": [t.as_dict() for t in totals],
        "output_tokens_per_s": board.output_tokens_per_s(),
    }


def _plots(board: Scoreboard, plan: DemoPlan, directory: Path) -> list[tuple[str, str]]:
    plt = pyplot()
    written = []
    colors = {route: f"C{i}" for i, route in enumerate(ROUTES)}

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for route in ROUTES:
        ok = [r for r in board.records[route] if r.ok and route != BATCH]
        if ok:
            axis.scatter([r.sent_s for r in ok], [r.e2e_s * 1000 for r in ok], s=14, color=colors[route],
                         label=ROUTE_TITLES[route], alpha=0.8)
    axis.axhline(plan.latency_budget_ms, color="grey", linestyle=":", label=f"budget {plan.latency_budget_ms:g} ms")
    finish_figure(figure, axis, directory / "latency_over_time.png", "sent at (s)", "end-to-end latency (ms)",
                  "Every interactive request")
    written.append(("latency_over_time.png", "End-to-end latency of every interactive request, by route"))

    stats = [s for s in board.all_stats() if s.route != BATCH and s.p50_ms is not None]
    if stats:
        figure, axis = plt.subplots(figsize=(8, 4.5))
        names = [f"{ROUTE_TITLES[s.route]}\n({s.engine_text})" for s in stats]
        positions = range(len(stats))
        axis.bar([p - 0.2 for p in positions], [s.p50_ms for s in stats], width=0.4, label="p50")
        axis.bar([p + 0.2 for p in positions], [s.p99_ms for s in stats], width=0.4, label="p99")
        axis.axhline(plan.latency_budget_ms, color="grey", linestyle=":", label="real-time budget")
        axis.set_xticks(list(positions), names, fontsize=8)
        axis.set_ylabel("ms")
        axis.set_title("Latency per route (the real-time forms routed, and pinned to AR)")
        axis.legend(fontsize=8)
        save_figure(figure, directory / "latency_by_route.png")
        written.append(("latency_by_route.png", "p50 and p99 latency per route"))

    scored = [s for s in board.all_stats() if s.field_accuracy is not None]
    if scored:
        figure, axis = plt.subplots(figsize=(8, 4))
        axis.bar([ROUTE_TITLES[s.route] for s in scored], [s.field_accuracy for s in scored],
                 color=[colors[s.route] for s in scored])
        axis.set_ylim(0, 1)
        axis.set_ylabel("field accuracy")
        axis.set_title("Accuracy against the ground truth (held-out documents)")
        axis.tick_params(axis="x", labelsize=8)
        save_figure(figure, directory / "accuracy_by_route.png")
        written.append(("accuracy_by_route.png", "Field accuracy per route"))

    if board.snapshots:
        figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        names = sorted({n for s in board.snapshots for n, g in s.engines.items() if g.available})
        for index, name in enumerate(names):
            points = [(s.at_s, s.engines[name]) for s in board.snapshots if name in s.engines]
            top.plot([t for t, _ in points], [100 * (g.utilization or 0) for _, g in points], color=f"C{index}",
                     label=name)
            costs = [(t, g.usd_per_mtok) for t, g in points if g.usd_per_mtok]
            if costs:
                bottom.plot([t for t, _ in costs], [c for _, c in costs], color=f"C{index}", label=name)
        top.set_ylabel("utilization (%)")
        top.set_title("Engines, live (metrics window)")
        top.grid(True, alpha=0.3)
        top.legend(fontsize=8)
        bottom.set_yscale("log")
        bottom.set_ylabel("effective $ / Mtok")
        bottom.set_xlabel("demo time (s)")
        bottom.grid(True, which="both", alpha=0.3)
        save_figure(figure, directory / "engines_over_time.png")
        written.append(("engines_over_time.png", "Utilization and effective cost per million tokens, per engine"))
    return written


def _cell(value, fmt: str = "{:.3g}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return fmt.format(value)
    return html.escape(str(value))


def write_report(board: Scoreboard, totals: list[EngineTotals], plan: DemoPlan, verdict: list[str],
                 interrupted: bool, directory: str | Path) -> Path:
    """summary.json, the plots and report.html in `directory`; returns the HTML's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    summary = summary_dict(board, totals, plan, verdict, interrupted)
    (directory / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    plots = _plots(board, plan, directory)
    engines = "".join(
        f"<li>{html.escape(n)} ({html.escape(e['kind'])}): "
        + ("up" if e["available"] else f"<b>not available</b>: {html.escape(e['reason'] or '')}") + "</li>"
        for n, e in summary["engines"].items())
    route_rows = "".join(
        "<tr>" + "".join(f"<td>{c}</td>" for c in (
            html.escape(r["title"]), r["sent"], r["answered"], r["errors"],
            html.escape(", ".join(r["engines"]) or "-"), html.escape(", ".join(r["rules"]) or "-"),
            "-" if key == BATCH else _cell(r["p50_ms"], "{:.0f}"),
            "-" if key == BATCH else _cell(r["p99_ms"], "{:.0f}"),
            _cell(r["fallback_rate"], "{:.0%}"), _cell(r["field_accuracy"], "{:.3f}"),
            _cell(r["usd_per_request"], "{:.2e}"))) + "</tr>"
        for key, r in summary["routes"].items())
    total_rows = "".join(
        "<tr>" + "".join(f"<td>{c}</td>" for c in (
            html.escape(t["engine"]), t["answers"], t["output_tokens"], _cell(t["busy_s"], "{:.1f}"),
            _cell(t["tokens_per_busy_s"], "{:.0f}"), _cell(t["utilization"], "{:.0%}"),
            _cell(t["node_usd_per_hour"], "{:.2f}"), _cell(t["spent_usd"], "{:.2e}"),
            _cell(t["usd_per_mtok"], "{:.2f}"))) + "</tr>"
        for t in summary["engine_totals"])
    tier_rows = "".join(
        "<tr>" + "".join(f"<td>{c}</td>" for c in (
            html.escape(name), t["forms"], _cell(t["routed_field_accuracy"], "{:.3f}"),
            _cell(t["ar_field_accuracy"], "{:.3f}"), t["ar_forms"], _cell(t["fallback_rate"], "{:.0%}"),
            _cell(t["routed_usd_per_request"], "{:.2e}"), _cell(t["ar_usd_per_request"], "{:.2e}"),
            _cell(t["routed_p50_ms"], "{:.0f}"), _cell(t["ar_p50_ms"], "{:.0f}"), t["low_confidence_flags"]))
        + "</tr>" for name, t in summary["tiers"].items())
    comparison = html.escape(comparison_sentence(summary["comparison"])[0])
    if summary["comparison"] and not summary["comparison"]["fast_available"]:
        comparison += " Train the diffusion model (<code>nowait train diffusion</code>) to see the full rule."
    b = summary["batch"]
    images = "".join(f"<figure><img src='{n}' alt='{html.escape(t)}'><figcaption>{html.escape(t)}</figcaption>"
                     f"</figure>" for n, t in plots)
    verdict_html = "".join(f"<li>{html.escape(v)}</li>" for v in verdict)
    settings = "".join(f"<li>{html.escape(k)}: {_cell(v, '{:g}')}</li>" for k, v in summary["plan"].items())
    stopped = " (stopped early)" if interrupted else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>nowait demo report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style></head><body>
<h1>nowait demo</h1>
<p>{summary['elapsed_s']:.0f} s of mixed traffic through the gateway's HTTP API{stopped}.</p><ul>{verdict_html}</ul>
<h2>Engines</h2><ul>{engines}</ul>
<h2>Requests per route</h2>
<table><tr><th>route</th><th>sent</th><th>answered</th><th>errors</th><th>engine</th><th>rule</th><th>p50 ms</th>
<th>p99 ms</th><th>fallback</th><th>field accuracy</th><th>$ / request</th></tr>{route_rows}</table>
<p>{comparison}</p>
<h2>Real-time KYC per corpus tier</h2>
<p>{plan.hard_fraction:.0%} of the real-time forms are hard-tier documents (<code>--hard-fraction</code>). Routed:
every form of the tier; AR: the same tier's forms also sent pinned to AR. $ / request folds in the fallbacks' AR
runs (the ledger charges both); low-confidence flags: answers the gateway returned with
<code>nowait.low_confidence</code>.</p>
<table><tr><th>tier</th><th>forms</th><th>routed field acc</th><th>AR field acc</th><th>AR forms</th>
<th>fallback</th><th>routed $ / request</th><th>AR $ / request</th><th>routed p50 ms</th><th>AR p50 ms</th>
<th>low-confidence flags</th></tr>{tier_rows}</table>
<p>Batch {_cell(b['batch_id'])}: {_cell(b['status'])}, {b['completed']}/{b['lines']} lines answered,
{b['failed']} failed, wall time {_cell(b['wall_s'], '{:.1f}')} s.</p>
<h2>Engines over the whole run (from the ledger)</h2>
<table><tr><th>engine</th><th>answers</th><th>output tokens</th><th>busy s</th><th>tok/s busy</th><th>utilization</th>
<th>node $/h</th><th>spent</th><th>$ / Mtok</th></tr>{total_rows}</table>
<p>$ / Mtok is the cost identity over the run: node $/h / (tokens per busy second x utilization), the node paid
for the whole run. See docs/demo.md for how to read it.</p>
<h2>Plots</h2>{images}
<h2>Settings</h2><ul>{settings}</ul>
</body></html>
"""
    path = directory / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
