"""How `bench load` shows its results: a console table, and an HTML report with PNG plots.

The JSON (`--json`, and `load.json` beside the report) is the source; the table and the report
only lay it out. Plots (matplotlib, Agg, so no display is needed):

    latency_vs_rate.png          e2e p50 (solid) and p99 (dashed) against achieved requests/s,
                                 one line per engine or model: where latency turns up is capacity
    tokens_vs_concurrency.png    output tokens/s against mean requests in flight, per engine:
                                 how far batching (AR) or parallel passes (diffusion) carry
    goodput_vs_rate.png          share of requests within the latency target against requests/s
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nowait.plots import finish_figure, pyplot


def _ms(values: dict | None, key: str) -> str:
    return "-" if not values or values.get(key) is None else f"{values[key]:.0f}"


def console_table(report: dict) -> Table:
    """One row per run (and one for a batch), the figures of docs/bench.md."""
    table = Table(title=f"nowait bench load ({report['workload']['name']}, target {report['target']['description']})")
    columns = ("target", "profile", "ok/err", "req/s", "out tok/s", "conc", "TTFT p50", "TTFT p99", "ITL p50",
               "e2e p50", "e2e p90", "e2e p99", "goodput", "field acc")
    for column in columns:
        table.add_column(column, justify="left" if column in ("target", "profile") else "right", no_wrap=True)
    for run in report["runs"]:
        accuracy = run.get("accuracy") or {}
        engines = run.get("engines") or {}
        target = run["target"] + (f" -> {', '.join(engines)}" if engines and list(engines) != [run["target"]] else "")
        table.add_row(target, run["label"] + (" (stopped)" if run.get("interrupted") else ""),
                      f"{run['successful']}/{run['errors']}", f"{run['requests_per_s']:.2f}",
                      f"{run['output_tokens_per_s']:.1f}", f"{run['mean_concurrency']:.1f}",
                      _ms(run["ttft_ms"], "p50"), _ms(run["ttft_ms"], "p99"), _ms(run["itl_ms"], "p50"),
                      _ms(run["e2e_ms"], "p50"), _ms(run["e2e_ms"], "p90"), _ms(run["e2e_ms"], "p99"),
                      f"{run['goodput']['fraction']:.0%}",
                      f"{accuracy['field_accuracy']:.3f}" if accuracy else "-")
    return table


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    if report["runs"]:
        console.print(console_table(report))
    batch = report.get("batch")
    if batch:
        accuracy = batch.get("accuracy") or {}
        console.print(f"batch {batch['batch_id']}: {batch['status']}, {batch['successful']}/{batch['requests']} lines "
                      f"answered ({batch['errors']} errors) in {batch['duration_s']:.1f} s: "
                      f"{batch['requests_per_s']:.2f} lines/s, {batch['output_tokens_per_s']:.1f} output tok/s"
                      + (f", field accuracy {accuracy['field_accuracy']:.3f}" if accuracy else ""), highlight=False)
    for note in report.get("notes", []):
        console.print(f"note: {note}", style="dim", highlight=False)


def _by_target(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs per line of a plot: one per target, named with the engines that answered it (the
    router's model shows where it sent the work: `nowait -> diffusion`)."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["target"], []).append(run)
    named = {}
    for target, group in groups.items():
        engines = sorted({e for run in group for e in (run.get("engines") or {})})
        named[target if engines in ([], [target]) else f"{target} -> {', '.join(engines)}"] = group
    return named


def _line_per_target(axis: Any, runs: list[dict], x: Callable[[dict], float], y: Callable[[dict], float]) -> None:
    """One line per target, its runs in order of `x`, so the plots compare targets at a glance."""
    for index, (name, group) in enumerate(_by_target(runs).items()):
        group = sorted(group, key=x)
        axis.plot([x(r) for r in group], [y(r) for r in group], "o-", color=f"C{index}", label=name)


def _plots(report: dict, directory: Path) -> list[tuple[str, str]]:
    plt = pyplot()
    runs = [r for r in report["runs"] if r["successful"]]
    written: list[tuple[str, str]] = []
    if not runs:
        return written
    target_ms = report["workload"].get("latency_target_ms")

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for index, (name, group) in enumerate(_by_target(runs).items()):
        group = sorted(group, key=lambda r: r["requests_per_s"])
        xs = [r["requests_per_s"] for r in group]
        color = f"C{index}"
        axis.plot(xs, [r["e2e_ms"]["p50"] for r in group], "o-", color=color, label=f"{name} p50")
        axis.plot(xs, [r["e2e_ms"]["p99"] for r in group], "s--", color=color, label=f"{name} p99")
    highest = max(r["e2e_ms"]["p99"] for r in runs)
    if target_ms and target_ms <= 2 * highest:  # a far-off target would flatten every line to the axis
        axis.axhline(target_ms, color="grey", linestyle=":", label=f"target {target_ms:g} ms")
    axis.set_ylim(bottom=0)
    finish_figure(figure, axis, directory / "latency_vs_rate.png", "achieved requests/s", "end-to-end latency (ms)",
                  "Latency vs request rate")
    written.append(("latency_vs_rate.png", "End-to-end latency (p50 solid, p99 dashed) against achieved requests/s"))

    figure, axis = plt.subplots(figsize=(7, 4.5))
    _line_per_target(axis, runs, lambda r: r["mean_concurrency"], lambda r: r["output_tokens_per_s"])
    finish_figure(figure, axis, directory / "tokens_vs_concurrency.png", "mean requests in flight", "output tokens/s",
                  "Throughput vs concurrency")
    written.append(("tokens_vs_concurrency.png", "Output tokens/s against mean requests in flight"))

    figure, axis = plt.subplots(figsize=(7, 4.5))
    _line_per_target(axis, runs, lambda r: r["requests_per_s"], lambda r: 100 * r["goodput"]["fraction"])
    axis.set_ylim(0, 105)
    finish_figure(figure, axis, directory / "goodput_vs_rate.png", "achieved requests/s",
                  "requests within the latency target (%)", "Goodput vs request rate")
    written.append(("goodput_vs_rate.png", "Share of requests answered within the latency target"))
    return written


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return html.escape(str(value))


def write_html_report(report: dict, directory: str | Path) -> Path:
    """`load.json`, the PNG plots and `report.html` in `directory`; returns the HTML path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "load.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plots = _plots(report, directory)
    header = ("target", "profile", "ok", "errors", "req/s", "out tok/s", "concurrency", "TTFT p50 ms", "TTFT p99 ms",
              "ITL p50 ms", "e2e p50 ms", "e2e p90 ms", "e2e p99 ms", "goodput", "field accuracy")
    rows = []
    for run in report["runs"]:
        cells = (run["target"], run["label"], run["successful"], run["errors"], run["requests_per_s"],
                 run["output_tokens_per_s"], run["mean_concurrency"], (run["ttft_ms"] or {}).get("p50"),
                 (run["ttft_ms"] or {}).get("p99"), (run["itl_ms"] or {}).get("p50"),
                 (run["e2e_ms"] or {}).get("p50"), (run["e2e_ms"] or {}).get("p90"),
                 (run["e2e_ms"] or {}).get("p99"), f"{run['goodput']['fraction']:.0%}",
                 (run["accuracy"] or {}).get("field_accuracy"))
        rows.append("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in cells) + "</tr>")
    batch = report.get("batch")
    batch_html = ""
    if batch:
        batch_html = (f"<h2>Batch</h2><p>{_cell(batch['batch_id'])}: {_cell(batch['status'])}, "
                      f"{batch['successful']}/{batch['requests']} lines answered, {batch['errors']} errors, "
                      f"{batch['duration_s']:.1f} s, {batch['requests_per_s']:.2f} lines/s, "
                      f"{batch['output_tokens_per_s']:.1f} output tokens/s, field accuracy "
                      f"{_cell((batch.get('accuracy') or {}).get('field_accuracy'))}</p>")
    settings = "".join(f"<li>{html.escape(k)}: {_cell(v)}</li>" for k, v in report["settings"].items())
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in report.get("notes", []))
    images = "".join(f"<figure><img src='{name}' alt='{html.escape(caption)}'><figcaption>{html.escape(caption)}"
                     f"</figcaption></figure>" for name, caption in plots)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>nowait bench load</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}img{{max-width:100%}}</style></head><body>
<h1>nowait bench load</h1>
<p>Target: {html.escape(report['target']['description'])}. Workload: {html.escape(report['workload']['name'])}
({html.escape(report['workload']['description'])}).</p>
<h2>Runs</h2><table><tr>{''.join(f'<th>{h}</th>' for h in header)}</tr>{''.join(rows)}</table>
{batch_html}
<h2>Plots</h2>{images}
<h2>Settings</h2><ul>{settings}</ul>
{'<h2>Notes</h2><ul>' + notes + '</ul>' if notes else ''}
<p>Definitions: TTFT = first content token - sent; e2e = last byte - sent; ITL = (e2e - TTFT) / (output tokens - 1);
goodput = requests answered within the latency target; concurrency = sum of e2e / run duration.
See docs/bench.md.</p>
</body></html>
"""
    path = directory / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
