"""`nowait bench cache-modes`: the diffusion engine's cache modes on the same documents, taking
turns on each one.

Each document is decoded once per configuration, one configuration after another, before the
next document: a shared machine's changing load falls on every configuration alike, and the
per-document latency ratio against the fast default is read from decodes seconds apart. Field
accuracy, forwards and latency of each, from one run; measurements, never assertions.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from nowait.bench.app import bench_app

if TYPE_CHECKING:
    from nowait.engines.diffusion.request import DiffusionOptions
    from nowait.extraction.corpus import Document
    from nowait.model import Transformer
    from nowait.tokenizer import TextCodec

# name -> DiffusionOptions changes from the fast default (threshold, tau 0.999, block 32).
CACHE_CONFIGS: dict[str, dict] = {
    "none": {"cache": "none"},
    "prompt": {"cache": "prompt"},
    "prefix": {"cache": "prefix"},
    "dual, window refresh": {"cache": "dual", "refresh": "window", "cache_decoded": False},  # Fast-dLLM's
    "dual, blocks refresh": {"cache": "dual", "refresh": "blocks", "cache_decoded": False},
    "dual, blocks refresh, settled tokens": {},  # the fast default
}
DEFAULT_CONFIG = "dual, blocks refresh, settled tokens"


def measure_cache_modes(model: Transformer, codec: TextCodec, docs: list[Document],
                        configs: dict[str, DiffusionOptions]) -> list[dict]:
    """One entry per configuration: the eval fields and the median per-document latency over
    the first configuration's (the ratio of decodes of the same document, seconds apart)."""
    import numpy as np

    from nowait.engines.config import DiffusionEngineConfig
    from nowait.engines.factory import EngineModel, engine_from
    from nowait.evaluation import completion_metrics, document_request

    engines = {name: engine_from(DiffusionEngineConfig.with_options(options, max_batch=1), EngineModel(model, codec))
               for name, options in configs.items()}
    completions: dict[str, list] = {name: [] for name in configs}
    for doc in docs:
        for name, engine in engines.items():
            completions[name] += engine.generate([document_request(doc, codec)])
    baseline = completions[next(iter(configs))]
    results = []
    for name, decoded in completions.items():
        metrics = completion_metrics(decoded, docs)
        ratio = np.median([c.timings.total_s / b.timings.total_s for c, b in zip(decoded, baseline, strict=True)])
        results.append({"name": name, **{k: metrics[k] for k in ("field_accuracy", "json_valid_rate",
                                                                  "forwards_per_doc", "tokens_per_forward",
                                                                  "latency_ms_p50", "latency_ms_p95")},
                        "latency_ratio_median": round(float(ratio), 3)})
    return results


@bench_app.command("cache-modes")
def cache_modes(
    n: int = typer.Option(100, help="test documents, each decoded once per configuration at batch size 1"),
    split: str = typer.Option("test", help="validation or test"),
    model: str = typer.Option("diffusion", help="diffusion checkpoint directory (default: the bundled model)"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Accuracy, forwards and latency of each diffusion cache mode, taking turns on each document;
    `latency_ratio_median` is each one's per-document latency over the fast default's."""
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from nowait.checkpoints import check_device
    from nowait.cli_errors import fail
    from nowait.engines.diffusion.request import DiffusionOptions
    from nowait.engines.factory import ModelCache
    from nowait.extraction.corpus import documents

    if n < 1:
        fail("--n must be at least 1")
    if split not in ("validation", "test"):
        fail(f"unknown split {split!r}; choose validation or test")
    import torch

    if threads:
        torch.set_num_threads(threads)
    try:
        check_device(device)
        loaded = ModelCache().load(model, device=device)
    except ValueError as error:  # an absent device, or a CheckpointError
        fail(str(error))
    if loaded.model.config.causal:
        fail(f"{model} is an AR model; cache modes are the diffusion engine's")
    # The default first: every ratio is read against it.
    names = [DEFAULT_CONFIG, *(name for name in CACHE_CONFIGS if name != DEFAULT_CONFIG)]
    configs = {name: replace(DiffusionOptions(), **CACHE_CONFIGS[name]) for name in names}
    results = measure_cache_modes(loaded.model.eval(), loaded.codec, documents(split, n), configs)
    report = {"modes": results, "n": n, "split": split, "batch_size": 1, "threads": torch.get_num_threads(),
              "device": device, "model": str(loaded.path)}
    if as_json:
        print(json.dumps(report))
        return
    table = Table(title=f"nowait bench cache-modes (n={n}, {split}, batch size 1, taking turns)")
    for column in ("configuration", "field acc", "valid", "fwd/doc", "tok/fwd", "p50 ms", "latency / default"):
        table.add_column(column, justify="left" if column == "configuration" else "right",
                         no_wrap=column == "configuration")
    for r in results:
        table.add_row(r["name"], f"{r['field_accuracy']:.3f}", f"{r['json_valid_rate']:.3f}",
                      f"{r['forwards_per_doc']:.1f}", f"{r['tokens_per_forward']:.2f}", f"{r['latency_ms_p50']:.1f}",
                      f"{r['latency_ratio_median']:.2f}")
    Console().print(table)
