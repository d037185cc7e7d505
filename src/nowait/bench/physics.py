"""`nowait bench physics`: the mission's core claim measured on the machine at hand.

An AR decode step at batch 1 streams every weight for one token (arithmetic intensity near 1
FLOP per byte at 16-bit, so the chip waits on memory); batching 64 sequences reuses each weight
64 times; a diffusion pass works on a whole block at batch 1, so it is compute-bound without any
batching. Each case below is timed with the real Transformer and costed with the one cost model
(`ModelConfig.forward_cost`), then placed under this machine's measured roofline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import typer

from nowait.bench.app import bench_app
from nowait.model import KVCache, ModelConfig, Transformer
from nowait.planner.hardware import time_best
from nowait.plots import finish_figure, pyplot

PROMPT_TOKENS = 170  # a typical extraction prompt of the demo corpus
ANSWER_WINDOW = 160
DIFFUSION_BLOCK = 32


@dataclass(frozen=True)
class PhysicsCase:
    name: str
    batch: int
    new_tokens: int  # per sequence
    cached_tokens: int  # per sequence
    causal: bool
    what: str


def standard_cases(prompt: int = PROMPT_TOKENS, window: int = ANSWER_WINDOW,
                   block: int = DIFFUSION_BLOCK) -> list[PhysicsCase]:
    """The four cases the issue names; AR decode sits halfway through an answer."""
    context = prompt + window // 2
    return [
        PhysicsCase("ar-decode-b1", 1, 1, context, True, "one AR decode step, batch 1, KV cache"),
        PhysicsCase("ar-decode-b64", 64, 1, context, True, "one AR decode step, 64 sequences batched"),
        PhysicsCase("diffusion-b1", 1, prompt + window, 0, False,
                    f"one diffusion pass, batch 1, no cache (prompt + {window}-token window)"),
        PhysicsCase("diffusion-b1-cache", 1, block, prompt, False,
                    f"one diffusion pass, batch 1, block {block} over the cached prompt"),
    ]


def _time_best(run, budget_s: float, repeats: int = 50) -> float:
    """Fastest run within `budget_s`, after one warm-up run (allocation, kernel selection)."""
    run()
    return time_best(run, repeats, budget_s)


@torch.no_grad()
def time_case(config: ModelConfig, case: PhysicsCase, budget_s: float = 1.0, device: str = "cpu") -> float:
    """Seconds of one forward of `case` on a model of `config`'s shape (weights do not matter)."""
    shape = ModelConfig.from_dict({**config.to_dict(), "causal": case.causal})
    with torch.device(device):
        model = Transformer(shape).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (case.batch, case.new_tokens), generator=generator).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(run) -> float:
        def run_synced() -> None:  # a CUDA forward returns before it ends: wait for it inside the timing
            run()
            sync()
        return _time_best(run_synced, budget_s)

    if not case.cached_tokens:
        return timed(lambda: model(ids))
    cache = KVCache(shape, case.batch, case.cached_tokens + case.new_tokens, device=device)
    model(torch.randint(0, shape.vocab_size, (case.batch, case.cached_tokens), generator=generator).to(device), cache)
    filled = cache.lengths.clone()

    def step() -> None:
        model(ids, cache, write_cache=case.causal)
        cache.lengths = filled.clone()  # every repetition decodes at the same context length

    return timed(step)


def measure(config: ModelConfig, peak_flops: float, bandwidth: float, cases: list[PhysicsCase] | None = None,
            budget_s: float = 1.0, dtype_bytes: int = 4, device: str = "cpu") -> dict:
    """The JSON of `nowait bench physics`: achieved FLOP/s, intensity and utilization per case."""
    results = []
    for case in cases or standard_cases():
        seconds = time_case(config, case, budget_s, device)
        cost = config.forward_cost(case.new_tokens, case.cached_tokens, case.batch, dtype_bytes)
        achieved = cost.flops / seconds
        # Roofline (Williams et al. 2009): attainable = min(peak, intensity x bandwidth).
        attainable = min(peak_flops, cost.intensity * bandwidth)
        results.append({
            "name": case.name, "what": case.what, "batch": case.batch, "new_tokens": case.new_tokens,
            "cached_tokens": case.cached_tokens, "seconds": seconds, "flops": cost.flops, "bytes": cost.bytes,
            "achieved_flops": achieved, "intensity": cost.intensity, "utilization": achieved / peak_flops,
            "roofline_flops": attainable,
            "bound": "memory" if cost.intensity * bandwidth < peak_flops else "compute",
            # Positions computed per second: for AR decode one per row, each a token; a diffusion
            # pass computes every position of its span but commits only some (policy-dependent).
            "positions_per_s": case.batch * case.new_tokens / seconds,
            "tokens_per_s": case.batch / seconds if case.causal else None,
        })
    return {"peak_flops": peak_flops, "bandwidth": bandwidth, "ridge_intensity": peak_flops / bandwidth,
            "dtype_bytes": dtype_bytes, "cases": results}


def plot_roofline(report: dict, path: Path) -> Path:
    """Log-log roofline of this machine with each case's measured operating point."""
    peak, bandwidth = report["peak_flops"], report["bandwidth"]
    intensities = [c["intensity"] for c in report["cases"]]
    low, high = min(*intensities, 1.0) / 4, max(*intensities, report["ridge_intensity"]) * 4
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    figure, axis = pyplot().subplots(figsize=(7, 4.5))
    axis.loglog(xs, [min(peak, x * bandwidth) / 1e9 for x in xs], color="black", label="roofline (measured)")
    for case in report["cases"]:
        axis.scatter(case["intensity"], case["achieved_flops"] / 1e9, s=40, zorder=3)
        axis.annotate(case["name"], (case["intensity"], case["achieved_flops"] / 1e9), textcoords="offset points",
                      xytext=(5, -12))
    path.parent.mkdir(parents=True, exist_ok=True)
    finish_figure(figure, axis, path, "arithmetic intensity (FLOP / byte)", "GFLOP/s",
                  "Where each engine's forward sits on this machine's roofline", grid_which="both", legend_size=None,
                  legend_loc="lower right", dpi=120)
    return path


@bench_app.command("physics")
def physics(
    model: str = typer.Option("ar", help="model whose shape is timed (bundled name or checkpoint directory)"),
    budget: float = typer.Option(1.0, help="seconds of timing per case (best run kept)"),
    host_budget: float = typer.Option(3.0, help="seconds to measure the matmul peak and memory bandwidth"),
    report: Path = typer.Option(None, help="directory for roofline.png and physics.json"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    shape: str = typer.Option(None, help="a real model shape with random weights instead of --model: "
                                         "qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b, llada-8b, dream-7b, "
                                         "diffusiongemma-26b-a4b (its denoiser step)"),
    dtype: str = typer.Option("fp32", help="with --shape: fp32 or bf16"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Achieved FLOP/s and arithmetic intensity of AR decode (batch 1 and 64) and of a diffusion
    pass at batch 1 (with and without the prompt cache), against this machine's measured peak.
    With --shape: AR decode at batch 1/16/64 and a diffusion block of 32 over a cached prompt at
    batch 1 and 8, each beside the planner's predicted step time."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from nowait import paths
    from nowait.checkpoints import CheckpointError, load_pretrained
    from nowait.cli_errors import fail
    from nowait.planner.hardware import measure_host

    if budget <= 0 or host_budget <= 0:
        fail("--budget and --host-budget must be positive")
    if threads:
        torch.set_num_threads(threads)
    if shape:
        from nowait.bench.shape_command import run_shape_command
        from nowait.bench.shapes import shape_cases

        run_shape_command(shape, shape_cases(), dtype, device, budget, as_json, host_budget)
        return
    from nowait.checkpoints import check_device

    try:
        check_device(device)
    except ValueError as error:
        fail(str(error))
    try:
        config = load_pretrained(paths.model_dir(model)).model.config
    except CheckpointError as error:
        fail(str(error))
    err = Console(stderr=True)
    cases = standard_cases()
    with Progress(console=err, transient=as_json) as progress:
        task = progress.add_task("bench physics", total=len(cases) + 1)
        if device.startswith("cuda"):
            from nowait.bench.shapes import device_accelerator

            host = device_accelerator(device, host_budget)
        else:
            host = measure_host(budget_s=host_budget, threads=threads or torch.get_num_threads())
        progress.advance(task)
        peak, bandwidth = host.peak_flops("fp32"), host.memory_bandwidth
        results = []
        for case in cases:
            results.append(measure(config, peak, bandwidth, [case], budget, device=device)["cases"][0])
            progress.advance(task)
    result = {"peak_flops": peak, "bandwidth": bandwidth, "ridge_intensity": peak / bandwidth, "dtype_bytes": 4,
              "threads": torch.get_num_threads(), "model": str(paths.model_dir(model)), "device": device,
              "cases": results}
    if report:
        report.mkdir(parents=True, exist_ok=True)
        (report / "physics.json").write_text(json.dumps(result, indent=2) + "\n")
        result["plot"] = str(plot_roofline(result, report / "roofline.png"))
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"bench physics: peak {peak / 1e9:.1f} GFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s, "
                        f"ridge {peak / bandwidth:.1f} FLOP/byte")
    for column in ("case", "intensity", "achieved GFLOP/s", "utilization", "bound", "ms", "positions/s"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for c in results:
        table.add_row(c["name"], f"{c['intensity']:.1f}", f"{c['achieved_flops'] / 1e9:.2f}",
                      f"{c['utilization']:.1%}", c["bound"], f"{c['seconds'] * 1000:.2f}",
                      f"{c['positions_per_s']:.0f}")
    Console().print(table)
    if report:
        Console().print(f"roofline plot: {result['plot']}")
