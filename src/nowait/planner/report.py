"""The plan as a Markdown report with PNG plots (matplotlib, Agg backend: no display needed).

Four plots: cost per Mtok against utilization, nodes against arrival rate, latency against batch
size, and the roofline with each engine's operating points. docs/planner.md explains how to read
each one.
"""

from __future__ import annotations

import math
from datetime import date
from pathlib import Path

import numpy as np

from nowait.planner import cost
from nowait.planner.engine_plan import batch_ladder
from nowait.planner.engines import ENGINES, request_seconds
from nowait.planner.plan import Plan, WorkloadPlan, nodes_at_rates
from nowait.planner.roofline import forward_time, ridge_intensity
from nowait.plots import finish_figure, label_axis, pyplot, save_figure

ENGINE_LABELS = {"ar": "AR", "spec": "AR + speculative", "diffusion": "diffusion"}
ENGINE_COLORS = {"ar": "#1f77b4", "spec": "#2ca02c", "diffusion": "#d62728"}
RATE_MULTIPLIERS = [0.25, 0.5, 1.0, 2.0, 4.0]


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for a table: significant digits, thousands separators, '-' for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def money(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"${value:,.2f}" if value >= 0.1 else f"${value:.4f}"


# --- findings: the sentences a reader should take away -------------------------------------------------


def findings(plan: Plan) -> list[str]:
    s = plan.scenario
    lines = []
    first = plan.workloads[0].engines["ar"]
    lines.append(
        f"A single stream of {s.model.spec.name} ({s.model.spec.parameters() / 1e9:.1f}B parameters, {s.dtype}, "
        f"tensor parallel {s.tensor_parallel} on {s.node.name}) decodes at **{fmt(first.single_stream_tokens_per_s)} "
        f"tok/s**; the roofline ceiling (every weight byte streamed once per token at full bandwidth) is "
        f"{fmt(first.roofline_ceiling_tokens_per_s)} tok/s.")
    for w in plan.workloads:
        e = w.engines
        name = w.workload.name
        routed = e.get(w.decision.engine)
        target = f"{w.workload.p99_latency_s:g} s p99"
        infeasible = [n for n in ENGINES if not e[n].feasible]
        if infeasible:
            what = "; ".join(f"{ENGINE_LABELS[n]} cannot hold the {target} target at all (a request alone takes "
                             f"{fmt(e[n].min_p99_target_s)} s at p99)" for n in infeasible)
            lines.append(f"`{name}`: {what}.")
        if e["ar"].feasible and e["diffusion"].feasible:
            ratio = e["diffusion"].nodes / e["ar"].nodes
            lines.append(f"`{name}`: diffusion needs {e['diffusion'].nodes} node(s), AR {e['ar'].nodes} (diffusion "
                         f"fleet = {ratio:.2g} x AR's" + ("; AR wins when batches are large)." if ratio > 1 else ")."))
        elif e["diffusion"].feasible and not e["ar"].feasible:
            d = e["diffusion"]
            caveat = ""
            if d.fallback_rate > 0.01 and d.fallback_latency_s and d.fallback_latency_s > w.workload.p99_latency_s:
                caveat = (f" (for the {1 - d.fallback_rate:.0%} of answers diffusion keeps: the {d.fallback_rate:.0%} "
                          f"{'verified' if d.fallback_mode == 'verify' else 're-run'} on AR take about "
                          f"{fmt(d.fallback_latency_s)} s)")
            lines.append(f"`{name}`: diffusion holds the target on {d.nodes} node(s){caveat} at "
                         f"{money(d.cost_per_mtok_usd)}/Mtok, fallback included.")
        if routed is not None and routed.feasible:
            lines.append(f"`{name}` is routed to {ENGINE_LABELS.get(w.decision.engine, w.decision.engine)}: "
                         f"{routed.nodes} node(s), batch {routed.batch}, {fmt(routed.tokens_per_s_per_node)} tok/s "
                         f"per node, {routed.utilization:.0%} utilized, {money(routed.cost_per_mtok_usd)} per "
                         "million output tokens.")
    return lines


# --- plots -----------------------------------------------------------------------------------------------


def _plain_log_ticks(axis) -> None:
    """Log-scaled axis labelled 2, 5, 10 rather than 2x10^0, 5x10^0, 10^1."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())


def _subplots(count: int, title: str):
    figure, axes = pyplot().subplots(1, count, figsize=(5.2 * count, 4.2), squeeze=False)
    figure.suptitle(title)
    return figure, list(axes[0])


def plot_cost_vs_utilization(plan: Plan, path: Path) -> None:
    figure, axes = _subplots(len(plan.workloads), "Cost per million output tokens vs utilization")
    utilization = np.linspace(0.02, 1.0, 100)
    for axis, w in zip(axes, plan.workloads, strict=True):
        for name, e in w.engines.items():
            if not e.feasible:
                continue
            surcharge = e.cost_per_mtok_usd - e.own_cost_per_mtok_usd  # the fallback's share, diffusion only
            curve = [cost.cost_per_mtok(plan.node_usd_per_hour, e.tokens_per_s_per_node, u) + surcharge
                     for u in utilization]
            axis.plot(utilization, curve, color=ENGINE_COLORS[name], label=f"{ENGINE_LABELS[name]} (batch {e.batch})")
            axis.plot([e.utilization], [e.cost_per_mtok_usd], "o", color=ENGINE_COLORS[name])
        for quote in w.apis:
            style = "--" if quote.allowed else ":"
            label = f"{quote.name} {money(quote.usd_per_mtok)}" + ("" if quote.allowed else " (not for this data)")
            axis.axhline(quote.usd_per_mtok, linestyle=style, color="gray", linewidth=1)
            axis.annotate(label, (1.0, quote.usd_per_mtok), fontsize=7, ha="right", va="bottom", color="dimgray")
        axis.set_yscale("log")
        label_axis(axis, "utilization", "$ per million output tokens", w.workload.name, title_size=10,
                   grid_which="both", legend_size=7, legend_loc="upper right")
    save_figure(figure, path)


def plot_nodes_vs_rate(plan: Plan, path: Path, sweeps: dict[str, dict[str, list[int | None]]]) -> None:
    figure, axes = _subplots(len(plan.workloads), "Nodes to hold the p99 target vs arrival rate")
    for axis, w in zip(axes, plan.workloads, strict=True):
        rates = [w.workload.rate_per_s * m for m in RATE_MULTIPLIERS]
        for name, nodes in sweeps[w.workload.name].items():
            points = [(r, n) for r, n in zip(rates, nodes, strict=True) if n is not None]
            if points:
                axis.plot(*zip(*points, strict=True), "o-", color=ENGINE_COLORS[name], label=ENGINE_LABELS[name])
            else:
                axis.plot([], [], color=ENGINE_COLORS[name], label=f"{ENGINE_LABELS[name]}: infeasible")
        axis.axvline(w.workload.rate_per_s, color="gray", linestyle=":", linewidth=1)
        axis.set_xscale("log")
        _plain_log_ticks(axis.xaxis)
        axis.set_ylim(bottom=0)
        axis.yaxis.get_major_locator().set_params(integer=True)
        label_axis(axis, "arrivals per second", "nodes", f"{w.workload.name} (p99 <= {w.workload.p99_latency_s:g} s)",
                   title_size=10, grid_which="both", legend_size=7)
    save_figure(figure, path)


def plot_latency_vs_batch(plan: Plan, path: Path) -> None:
    figure, axes = _subplots(len(plan.workloads), "Latency of a mean request in a full batch vs batch size")
    for axis, w in zip(axes, plan.workloads, strict=True):
        for name in ENGINES:
            fleet = w.fleets[name]
            batches = batch_ladder(fleet.max_batch, fleet.max_batch)
            latency = [request_seconds(fleet.make(b), b, w.mean_input_tokens, w.mean_output_tokens) for b in batches]
            axis.plot(batches, latency, "o-", color=ENGINE_COLORS[name], label=ENGINE_LABELS[name], markersize=3)
        axis.axhline(w.workload.p99_latency_s, color="gray", linestyle="--", linewidth=1)
        axis.annotate("p99 target", (1, w.workload.p99_latency_s), fontsize=7, va="bottom", color="dimgray")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        _plain_log_ticks(axis.xaxis)
        label_axis(axis, "batch size", "seconds, arrival to last token (no queueing)", w.workload.name,
                   title_size=10, grid_which="both", legend_size=7)
    save_figure(figure, path)


def operating_points(plan: Plan, w: WorkloadPlan) -> list[tuple[str, str, float, float]]:
    """(engine, label, intensity FLOP/byte, achieved FLOP/s per accelerator) of each engine's main forward."""
    s = plan.scenario
    context = w.mean_input_tokens + w.mean_output_tokens / 2
    points = []
    for name in ENGINES:
        fleet = plan.fleets[name]
        e = w.engines[name]
        new_tokens = {"ar": 1, "spec": s.engines.spec.gamma + 1, "diffusion": s.engines.diffusion.block_width}[name]
        for batch, label in ((1, "batch 1"), (e.batch, f"batch {e.batch}")):
            t = forward_time(fleet.deployment, new_tokens, context, batch)
            points.append((name, label, t.intensity, t.flops / t.seconds / fleet.deployment.tensor_parallel))
            if e.batch == 1:
                break
    prefill = forward_time(plan.fleets["ar"].deployment, w.mean_input_tokens, 0, 1)
    points.append(("prefill", "prefill", prefill.intensity, prefill.flops / prefill.seconds / s.tensor_parallel))
    return points


def plot_roofline(plan: Plan, path: Path) -> None:
    s = plan.scenario
    peak = s.accelerator.peak_flops(s.dtype)
    bandwidth = s.accelerator.memory_bandwidth
    figure, axis = pyplot().subplots(figsize=(7.5, 5))
    intensity = np.logspace(-0.5, 4, 200)
    axis.plot(intensity, np.minimum(peak, bandwidth * intensity) / 1e12, color="black", label="roofline (datasheet)")
    e = s.efficiency
    axis.plot(intensity, np.minimum(peak * e.compute, bandwidth * e.memory * intensity) / 1e12, color="black",
              linestyle="--", linewidth=1, label=f"with efficiencies ({e.compute:.0%} / {e.memory:.0%})")
    ridge = ridge_intensity(peak, bandwidth)
    axis.axvline(ridge, color="gray", linestyle=":", linewidth=1)
    axis.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak / 1e12 / 30), fontsize=7, rotation=90, ha="right")
    focus = next((w for w in plan.workloads if not w.workload.batchable), plan.workloads[0])
    markers = {"batch 1": "o"}
    for name, label, x, y in operating_points(plan, focus):
        color = ENGINE_COLORS.get(name, "gray")
        marker = markers.get(label, "s" if name != "prefill" else "^")
        axis.plot([x], [y / 1e12], marker, color=color, markersize=7)
        axis.annotate(f"{ENGINE_LABELS.get(name, name)} {label if name != 'prefill' else ''}".strip(), (x, y / 1e12),
                      fontsize=7, xytext=(4, -10), textcoords="offset points")
    axis.set_xscale("log")
    axis.set_yscale("log")
    finish_figure(figure, axis, path, "arithmetic intensity (FLOP per byte moved)",
                  f"TFLOP/s per {s.accelerator.name} ({s.dtype})",
                  f"Roofline of {s.accelerator.name}: each engine's forward for {focus.workload.name}", title_size=10,
                  grid_which="both", legend_loc="lower right")


# --- markdown --------------------------------------------------------------------------------------------


def _engine_table(w: WorkloadPlan) -> list[str]:
    rows = ["| engine | single stream tok/s | roofline ceiling tok/s | batch | tok/s per node | nodes | p50 s | p99 s "
            "| utilization | $ / Mtok | $ / request |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in w.engines.items():
        nodes = str(e.nodes) if e.feasible else "infeasible"
        p99 = fmt(e.p99_latency_s) if e.feasible else f"(>= {fmt(e.min_p99_target_s)})"
        routed = " (route)" if name == w.decision.engine else ""
        rows.append(f"| {ENGINE_LABELS[name]}{routed} | {fmt(e.single_stream_tokens_per_s)} | "
                    f"{fmt(e.roofline_ceiling_tokens_per_s)} | {e.batch} | {fmt(e.tokens_per_s_per_node)} | {nodes} | "
                    f"{fmt(e.p50_latency_s)} | {p99} | {fmt(e.utilization, 2) if e.utilization else '-'} | "
                    f"{money(e.cost_per_mtok_usd)} | {money(e.cost_per_request_usd)} |")
    return rows


def _workload_section(plan: Plan, w: WorkloadPlan) -> list[str]:
    wl = w.workload
    lines = [f"### {wl.name}", ""]
    if wl.description:
        lines += [wl.description[0].upper() + wl.description[1:] + ".", ""]
    rate = (f"{wl.requests:,} requests over {wl.window_hours:g} h ({fmt(wl.rate_per_s)}/s)" if wl.requests
            else f"{fmt(wl.rate_per_s)} requests/s")
    lines += [f"{rate}; about {fmt(w.mean_input_tokens)} input and {fmt(w.mean_output_tokens)} output tokens per "
              f"request; p99 target {wl.p99_latency_s:g} s; tokens worth ${wl.token_value_usd_per_mtok:g}/Mtok; "
              f"data class **{wl.data_class.value}**; {'batchable' if wl.batchable else 'latency-bound'}.", "",
              f"**Route: {w.decision.engine}**: {w.decision.reason}.", ""]
    lines += _engine_table(w)
    lines.append("")
    for name, e in w.engines.items():
        if e.note:
            lines.append(f"- {ENGINE_LABELS[name]}: {e.note}.")
    d = w.engines["diffusion"]
    if d.feasible and d.fallback_rate:
        how = "AR verifying its answer as a draft" if d.fallback_mode == "verify" else "AR alone"
        lines.append(f"- Diffusion fallback: {d.fallback_rate:.0%} of answers re-run on AR, priced in "
                     f"({money(d.own_cost_per_mtok_usd)} -> {money(d.cost_per_mtok_usd)} per Mtok). A re-run answer "
                     f"arrives after about {fmt(d.fallback_latency_s)} s (diffusion, then {how}); the p99 above is "
                     "over diffusion answers. " + (
                         f"With more than 1% falling back, the p99 over all answers is about "
                         f"{fmt(d.fallback_latency_s)} s"
                         + (": the target holds for the answers diffusion keeps, not for the re-runs; keep the "
                            "fallback rate under 1% (measure it) to hold it for all."
                            if d.fallback_latency_s > wl.p99_latency_s else ", still within the target.")
                         if d.fallback_rate > 0.01 else "Under 1% falling back, the p99 over all answers is the same."))
    if w.apis:
        lines += ["", "| API | $ / Mtok for these requests | may receive this data | "
                  f"break-even utilization of {w.sensitivity_engine or 'owned'} |", "|---|---:|---|---:|"]
        for quote in w.apis:
            row = next((r for r in w.sensitivity if r.node_usd_per_hour == plan.node_usd_per_hour), None)
            even = row.break_even.get(round(quote.usd_per_mtok, 2)) if row else None
            shown = "never (> 100%)" if even is not None and even > 1 else (f"{even:.0%}" if even is not None else "-")
            lines.append(f"| {quote.name} | {money(quote.usd_per_mtok)} | {'yes' if quote.allowed else 'no'} | "
                         f"{shown} |")
    if w.sensitivity:
        apis = sorted(w.sensitivity[0].break_even)
        lines += ["", f"Sensitivity of {ENGINE_LABELS.get(w.sensitivity_engine, w.sensitivity_engine)} at the planned "
                  "utilization to the node price, and break-even utilization against each API price:", "",
                  "| node $/h | $ / Mtok | " + " | ".join(f"break-even vs {money(a)}" for a in apis) + " |",
                  "|---:|---:|" + "---:|" * len(apis)]
        for row in w.sensitivity:
            cells = " | ".join("never" if row.break_even[a] > 1 else f"{row.break_even[a]:.0%}" for a in apis)
            lines.append(f"| {money(row.node_usd_per_hour)} | {money(row.cost_per_mtok_usd)} | {cells} |")
    lines.append("")
    return lines


def markdown(plan: Plan, figures: dict[str, str], command: str) -> str:
    s = plan.scenario
    a, n, spec = s.accelerator, s.node, s.model.spec
    target = plan.fleets["ar"].deployment
    lines = [f"# Plan: {s.name}", "",
             f"Generated by `{command}` on {date.today().isoformat()}. How to read it: docs/planner.md.", ""]
    if s.description:
        lines += [s.description.strip(), ""]
    lines += ["## Findings", ""] + [f"- {line}" for line in findings(plan)] + [""]
    lines += ["## Summary", "",
              "| workload | arrivals/s | p99 target | route | AR nodes | spec nodes | diffusion nodes "
              "| routed $ / Mtok |",
              "|---|---:|---:|---|---:|---:|---:|---:|"]
    for w in plan.workloads:
        e = w.engines
        routed = e.get(w.decision.engine)
        cells = " | ".join(str(e[k].nodes) if e[k].feasible else "infeasible" for k in ENGINES)
        lines.append(f"| {w.workload.name} | {fmt(w.workload.rate_per_s)} | {w.workload.p99_latency_s:g} s | "
                     f"{w.decision.engine} | {cells} | {money(routed.cost_per_mtok_usd) if routed else '(API)'} |")
    price_kind = "given in the scenario" if s.hardware.price_usd_per_hour is not None else s.hardware.price
    lines += ["", "## Hardware and model", "",
              f"- Node **{n.name}**: {n.accelerators} x {a.name} ({fmt(a.peak_tflops[s.dtype])} TFLOP/s "
              f"{s.dtype} dense, "
              f"{a.memory_bandwidth_tb_s:g} TB/s, {a.memory_gb:g} GB each; {a.source}, {a.date}); interconnect "
              f"{n.interconnect_gb_s:g} GB/s per accelerator per direction.",
              f"- Price: **{money(plan.node_usd_per_hour)}/h** ({price_kind}; {n.price_source}"
              + (f", {n.price_date}" if n.price_date else "") + ").",
              f"- Model **{spec.name}**: {spec.parameters() / 1e9:.1f}B parameters"
              + (f" ({spec.active_parameters() / 1e9:.1f}B active)" if spec.is_moe else "")
              + f", {spec.weight_bytes(target.dtype_bytes) / 1e9:.0f} GB of weights in {s.dtype}, "
              f"{spec.kv_bytes_per_token(target.dtype_bytes) / 1e3:.0f} kB of KV cache per token; tensor parallel "
              f"{s.tensor_parallel}, {target.replicas_per_node} replica(s) per node, "
              f"{fmt(target.kv_token_budget())} tokens of KV cache per replica.",
              f"- Ridge point: {ridge_intensity(a.peak_flops(s.dtype), a.memory_bandwidth):.0f} FLOP/byte: a forward "
              "over fewer tokens than this (per weight read) is memory-bound.", ""]
    if plan.fitted:
        lines += ["Measured step times replace the roofline for: " + ", ".join(
            f"{k} ({f.measurements} measurements, worst fit error {f.worst_relative_error:.0%})"
            for k, f in plan.fitted.items()) + ".", ""]
    lines += ["## Workloads", ""]
    for w in plan.workloads:
        lines += _workload_section(plan, w)
    lines += ["## Plots", ""]
    captions = {
        "cost": "Cost per million output tokens against utilization (dots: the plan; lines: APIs, dotted when the "
                "data class may not go there).",
        "nodes": "Nodes needed to hold each workload's p99 target as its arrival rate scales (dotted: the scenario's "
                 "rate).",
        "latency": "Latency of a mean request riding in a full batch, no queueing: why latency-bound work keeps "
                   "batches small.",
        "roofline": "The roofline, with each engine's main forward at batch 1 (circles) and at the plan's batch "
                    "(squares); triangles: prefill.",
    }
    for key, caption in captions.items():
        if key in figures:
            lines += [f"![{key}]({figures[key]})", "", caption, ""]
    lines += ["## Assumptions", ""] + [f"- {line}" for line in plan.assumptions]
    lines += [f"- API prices: {api.name} ${api.input_usd_per_mtok:g} in / ${api.output_usd_per_mtok:g} out per Mtok"
              + (f" ({api.source})" if api.source else "") + "." for api in s.apis]
    lines.append("")
    return "\n".join(lines)


def write_report(plan: Plan, directory: str | Path, command: str = "nowait plan") -> Path:
    """Write `<scenario>-report.md` and its PNG plots into `directory`; return the Markdown path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = plan.scenario.name
    figures = {key: f"{stem}-{suffix}.png" for key, suffix in (
        ("cost", "cost-vs-utilization"), ("nodes", "nodes-vs-rate"), ("latency", "latency-vs-batch"),
        ("roofline", "roofline"))}
    sweeps = {w.workload.name: nodes_at_rates(plan, w, RATE_MULTIPLIERS) for w in plan.workloads}
    plot_cost_vs_utilization(plan, directory / figures["cost"])
    plot_nodes_vs_rate(plan, directory / figures["nodes"], sweeps)
    plot_latency_vs_batch(plan, directory / figures["latency"])
    plot_roofline(plan, directory / figures["roofline"])
    path = directory / f"{stem}-report.md"
    path.write_text(markdown(plan, figures, command), encoding="utf-8")
    return path
