"""`nowait bench batching`: continuous batching against one-at-a-time decoding, same requests.

For each concurrency C the first C test documents are decoded twice by the same engine: all C
submitted at once, then one after another. Output tokens per second of each, and whether the
greedy outputs are identical, are printed from one run. The engine is the checkpoint's kind: AR
(continuous batching) or diffusion (requests decoded together, joining at block boundaries; the
engine's fast default, free-form, or schema templates with `--structured`). The numbers are
measurements, never assertions.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import typer

from nowait.bench.app import bench_app

if TYPE_CHECKING:  # torch and the engines load when the command runs, not with the CLI
    from nowait.extraction.corpus import Document
    from nowait.model import Transformer
    from nowait.tokenizer import TextCodec

DEFAULT_CONCURRENCY = (1, 4, 16, 64)
ANSWER_TOKENS = 160  # nowait.evaluation.ANSWER_WINDOW, the eval's answer budget


def _requests(prompts: list[list[int]], max_tokens: int, schemas: list[dict | None] | None = None) -> list:
    from nowait.engines.base import GenerationRequest, SamplingParams

    schemas = schemas or [None] * len(prompts)
    return [GenerationRequest(p, SamplingParams(max_tokens=max_tokens), schema=schema)
            for p, schema in zip(prompts, schemas, strict=True)]


def _engine(model: Transformer, codec: TextCodec, prompts: list[list[int]], concurrency: tuple[int, ...],
            max_tokens: int, max_num_batched_tokens: int, cuda_graphs: bool | None = None):
    """The checkpoint's kind of engine, sized for these requests, from the engine factory."""
    from nowait.engines.config import ArEngineConfig, DiffusionEngineConfig
    from nowait.engines.factory import EngineModel, engine_from

    if not model.config.causal:
        return engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=max(concurrency), cuda_graphs=cuda_graphs),
                           EngineModel(model, codec))
    # Rows sized for these requests, not for the model's longest context: memory is rows x length.
    max_model_len = min(model.config.max_position, max(len(p) for p in prompts) + max_tokens + 1)
    # No prefix cache: the batch and the one-at-a-time run send the same prompts, again and again
    # across the turns, so each would restore the other's prompts whole, which no workload does.
    config = ArEngineConfig(kind="ar", max_num_seqs=max(concurrency),
                            max_num_batched_tokens=max(max_num_batched_tokens, max(concurrency)),
                            max_model_len=max_model_len, prefix_cache_tokens=0, structured=False,
                            cuda_graphs=cuda_graphs)
    return engine_from(config, EngineModel(model, codec))


def split_turns(n: int, rounds: int) -> list[range]:
    """Indices 0..n-1 in `rounds` consecutive, nearly equal parts (empty ones when n < rounds)."""
    cuts = [n * r // rounds for r in range(rounds + 1)]
    return [range(cuts[r], cuts[r + 1]) for r in range(rounds)]


def measure_batching(model: Transformer, codec: TextCodec, docs: list[Document],
                     concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY, max_tokens: int = ANSWER_TOKENS,
                     max_num_batched_tokens: int = 4096, structured: bool = False, rounds: int = 3,
                     peak_flops: float | None = None, cuda_graphs: bool | None = None) -> list[dict]:
    """One result per concurrency: batched and sequential output tokens/s, identical outputs.
    `structured` (diffusion): each request fills its kind's schema template. Each run's time per
    model forward sits beside that forward's compute floor (`nowait.bench.step_floor`) over
    `peak_flops` (default: this device's matmul peak, measured here in about a second).
    `cuda_graphs`: the engine's `cuda_graphs` (None: on with a CUDA device).

    The two runs take turns, `rounds` times: the batch, then a part of the one-at-a-time run,
    then the batch again, and so on. A shared machine's load changes over seconds, and the batch
    lasts a tenth as long as the one-at-a-time run; one batch timed before it would catch one
    moment of that load against the other's average. The batch's time is the median of its
    runs, the one-at-a-time time the sum of its parts."""
    from nowait.bench.step_floor import ForwardRecorder, dtype_name, matmul_peak, step_floor
    from nowait.extraction.corpus import schema_for
    from nowait.tokenizer import extraction_prompt

    if max(concurrency) > len(docs):
        raise ValueError(f"concurrency {max(concurrency)} needs at least that many documents, got {len(docs)}")
    if structured and model.config.causal:
        raise ValueError("--structured applies to a diffusion model (AR batching is measured free-form)")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    prompts = [codec.encode(extraction_prompt(d.kind, d.text)) for d in docs]
    schemas = [schema_for(d.kind) if structured else None for d in docs]
    engine = _engine(model, codec, prompts, concurrency, max_tokens, max_num_batched_tokens, cuda_graphs)
    # Warm-up at the largest concurrency: first-call allocations stay out of the numbers. The
    # first batch of a size touches fresh memory for its temporaries (AR: the prefill groups'
    # caches; diffusion: the batch cache, allocated as it goes, at full width), and in the
    # measured run that cost 0.3 s of a 1.9 s AR run at 64, and halved diffusion's templates.
    diffusion = not model.config.causal
    warm = max(concurrency)
    engine.generate(_requests(prompts[:warm], max_tokens if diffusion else 4, schemas[:warm]))
    phases = getattr(engine, "step_seconds", None)  # AR: forward time by step kind
    if peak_flops is None:
        peak_flops = matmul_peak(str(model.output_weight().device), dtype_name(model))
    recorder = ForwardRecorder(model)

    def timed(requests: list) -> tuple[list, float, dict, tuple[int, int]]:
        before = dict(phases or {})
        first = recorder.calls
        started = time.perf_counter()
        completions = engine.generate(requests)
        return (completions, time.perf_counter() - started, {k: phases[k] - before[k] for k in before},
                (first, recorder.calls))

    def floor(seconds: float, spans: list[tuple[int, int]]) -> dict:
        forwards = sum(stop - start for start, stop in spans)
        if not forwards:
            return step_floor(None, None, peak_flops)
        flops = sum(recorder.flops(start, stop) for start, stop in spans)
        return step_floor(seconds / forwards, flops / forwards, peak_flops)

    try:
        results = []
        for c in concurrency:
            batched_runs: list[tuple[list, float, dict, tuple[int, int]]] = []
            sequential: list = []
            sequential_s = 0.0
            sequential_phases = dict.fromkeys(phases or {}, 0.0)
            sequential_spans: list[tuple[int, int]] = []
            for part in split_turns(c, rounds):
                batched_runs.append(timed(_requests(prompts[:c], max_tokens, schemas[:c])))
                for i in part:
                    [completion], seconds, spent, span = timed(_requests([prompts[i]], max_tokens, [schemas[i]]))
                    sequential.append(completion)
                    sequential_s += seconds
                    sequential_phases = {k: sequential_phases[k] + spent[k] for k in sequential_phases}
                    sequential_spans.append(span)
            batched, batched_s, batched_phases, batched_span = sorted(batched_runs, key=lambda run: run[1])[
                len(batched_runs) // 2]
            # Per model forward: the batch's time, and the one-at-a-time run's, each beside its floor.
            batched_floor = floor(batched_s, [batched_span])
            sequential_floor = floor(sequential_s, sequential_spans)
            tokens = sum(x.completion_tokens for x in batched)
            # Prefill is compute-bound already for one prompt, so batching cannot shrink it; the decode
            # phase is where batching pays, and its own ratio shows how much.
            result = {
                "concurrency": c,
                "batched_tokens_per_s": round(tokens / batched_s, 1),
                "sequential_tokens_per_s": round(sum(x.completion_tokens for x in sequential) / sequential_s, 1),
                "speedup": round(sequential_s / batched_s, 2),
                "outputs_identical": all(a.token_ids == b.token_ids for run, _, _, _ in batched_runs
                                         for a, b in zip(run, sequential, strict=True)),
                "output_tokens": tokens,
                "batched_s": round(batched_s, 3),
                "sequential_s": round(sequential_s, 3),
                "batched_runs_s": [round(seconds, 3) for _, seconds, _, _ in batched_runs],
                **batched_floor,
                "forwards": batched_span[1] - batched_span[0],
                **{f"sequential_{key}": value for key, value in sequential_floor.items()},
                "sequential_forwards": sum(stop - start for start, stop in sequential_spans),
                "peak_flops": peak_flops,
            }
            graphed = getattr(getattr(engine, "runner", None), "graphed", None) or getattr(engine, "compiled", None)
            if hasattr(graphed, "captured_graphs"):  # a static-shape step: the CUDA Graphs recorded so far
                result["cuda_graphs"] = {"captured": graphed.capture, "graphs": graphed.captured_graphs}
            if phases is not None:
                result.update({
                    "prefill_s": {"batched": round(batched_phases["prefill"], 3),
                                  "sequential": round(sequential_phases["prefill"], 3)},
                    "decode_s": {"batched": round(batched_phases["decode"], 3),
                                 "sequential": round(sequential_phases["decode"], 3)},
                    "decode_speedup": round(sequential_phases["decode"] / max(batched_phases["decode"], 1e-9), 2),
                })
            results.append(result)
    finally:
        recorder.close()
    return results


@bench_app.command("batching")
def batching(
    concurrency: str = typer.Option("1,4,16,64", help="comma-separated concurrencies, measured in one run"),
    model: str = typer.Option("ar", help="checkpoint directory or bundled model (ar, diffusion); its kind picks the "
                                         "engine"),
    structured: bool = typer.Option(False, "--structured", help="diffusion: fill each kind's schema template"),
    max_tokens: int = typer.Option(None, help="output tokens at most per request (default: 160 free-form, 512 "
                                              "with --structured, the eval's budgets)"),
    max_num_batched_tokens: int = typer.Option(4096, help="token positions per forward, padding included"),
    rounds: int = typer.Option(3, min=1, help="batched runs per concurrency, taking turns with parts of the "
                                              "one-at-a-time run (the median is reported)"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    shape: str = typer.Option(None, help="time engine steps of a real model shape with random weights instead: "
                                         "qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b, llada-8b, dream-7b, "
                                         "diffusiongemma-26b-a4b (its denoiser step)"),
    dtype: str = typer.Option("fp32", help="with --shape: fp32 or bf16"),
    tokens_per_step: float = typer.Option(2.0, help="with --shape: tokens a diffusion step commits per row (a "
                                                    "fixed policy: random weights give no meaningful confidence)"),
    diffusion_concurrency: str = typer.Option("1,8", help="with --shape: batch sizes of the diffusion block step"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    cuda_graphs: str = typer.Option("auto", "--cuda-graphs", help="replay decode steps (AR) and one-request block "
                                                                  "steps (diffusion) as CUDA Graphs: auto (on with a "
                                                                  "CUDA device), on or off"),
    host_budget: float = typer.Option(1.0, min=0.01, help="seconds to measure the matmul peak each step's compute "
                                                          "floor is read against"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Output tokens/s with continuous batching vs the same requests one at a time. With --shape:
    AR decode steps at each --concurrency and diffusion block steps at --diffusion-concurrency on
    a random-weight model of that shape, beside the planner's predicted step times."""
    import torch

    from nowait.engines.factory import ModelCache
    from nowait.extraction.corpus import documents

    graphs = {"auto": None, "on": True, "off": False}.get(cuda_graphs, "bad")
    if graphs == "bad":
        typer.echo(f"error: --cuda-graphs must be auto, on or off, got {cuda_graphs!r}", err=True)
        raise typer.Exit(code=2)
    try:
        levels = tuple(int(x) for x in concurrency.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        typer.echo(f"error: --concurrency must be positive integers separated by commas, got {concurrency!r}",
                   err=True)
        raise typer.Exit(code=2)
    if threads:
        torch.set_num_threads(threads)
    if shape:
        from nowait.bench.shape_command import run_shape_command
        from nowait.bench.shapes import shape_cases

        try:
            diffusion_levels = tuple(int(x) for x in diffusion_concurrency.split(",") if x.strip())
        except ValueError:
            diffusion_levels = (0,)
        if diffusion_levels and min(diffusion_levels) < 1:
            typer.echo(f"error: --diffusion-concurrency must be positive integers, got {diffusion_concurrency!r}",
                       err=True)
            raise typer.Exit(code=2)
        run_shape_command(shape, shape_cases(levels, diffusion_levels, tokens_per_step), dtype, device, 1.0,
                          as_json)
        return
    try:
        from nowait.checkpoints import check_device

        check_device(device)
        loaded = ModelCache().load(model, device=device)
    except ValueError as error:  # an unknown or absent device; CheckpointError is a ValueError too
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    if max_tokens is None:
        from nowait.evaluation import TEMPLATE_MAX_TOKENS

        max_tokens = TEMPLATE_MAX_TOKENS if structured else ANSWER_TOKENS
    docs = documents("test", max(levels))
    from nowait.bench.step_floor import dtype_name, matmul_peak

    peak = matmul_peak(device, dtype_name(loaded.model), host_budget)
    try:
        results = measure_batching(loaded.model, loaded.codec, docs, levels, max_tokens, max_num_batched_tokens,
                                   structured, rounds, peak_flops=peak, cuda_graphs=graphs)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from None
    engine = "ar" if loaded.model.config.causal else "diffusion"
    if as_json:
        print(json.dumps({"results": results, "settings": {"model": str(loaded.path), "engine": engine,
                                                           "structured": structured, "max_tokens": max_tokens,
                                                           "rounds": rounds, "threads": torch.get_num_threads(),
                                                           "device": device, "peak_flops": peak,
                                                           "cuda_graphs": cuda_graphs}}))
        return
    for r in results:
        phases = (f"; decode phase {r['decode_speedup']}x, prefill {r['prefill_s']['sequential']:.2f} s of "
                  f"{r['sequential_s']:.2f} s one at a time" if "decode_speedup" in r else "")
        typer.echo(f"{engine} concurrency {r['concurrency']:>3}: batched {r['batched_tokens_per_s']:>8.1f} tok/s, "
                   f"one at a time {r['sequential_tokens_per_s']:>8.1f} tok/s ({r['speedup']}x{phases}), "
                   f"outputs identical: {r['outputs_identical']}")
        for label, prefix in (("batched", ""), ("one at a time", "sequential_")):
            if r[f"{prefix}step_ms"] is not None:
                typer.echo(f"    {label}: {r[f'{prefix}step_ms']:.3f} ms a step, compute floor "
                           f"{r[f'{prefix}compute_floor_ms']:.4f} ms, overhead {r[f'{prefix}overhead_share']:.1%}")
