"""What `--shape NAME` does on `bench physics`, `batching` and `engines`: a dense family's steps
(`nowait.bench.shapes`) or DiffusionGemma's denoiser step (`nowait.bench.gemma_shape`), with one
clear line for a bad shape, dtype or device."""

from __future__ import annotations

import json

from nowait.bench import gemma_shape, shapes
from nowait.bench.shapes import SHAPE_DTYPES, ShapeError, StepCase


def known_shapes() -> list[str]:
    return [*shapes.SHAPES, *gemma_shape.GEMMA_SHAPES]


def measure(name: str, cases: list[StepCase], dtype: str, device: str, budget_s: float,
            host_budget_s: float = 3.0) -> dict:
    """The report of `name`'s steps. DiffusionGemma has no AR step: its cases are the denoiser
    step at the batch sizes of the diffusion cases asked for (batch 1 when none were)."""
    if name in gemma_shape.GEMMA_SHAPES:
        config = gemma_shape.gemma_shape_config(name)
        batches = tuple(dict.fromkeys(c.batch for c in cases if not c.causal)) or (1,)
        per_step = next((c.tokens_per_step for c in cases if not c.causal), 2.0)
        return gemma_shape.measure_gemma_shape(name, gemma_shape.gemma_cases(config, batches, per_step), dtype,
                                               device, budget_s, host_budget_s)
    return shapes.measure_shape(name, cases, dtype, device, budget_s, host_budget_s)


def run_shape_command(name: str, cases: list[StepCase], dtype: str, device: str, budget_s: float,
                      as_json: bool, host_budget_s: float = 3.0) -> None:
    from nowait.checkpoints import check_device
    from nowait.cli_errors import fail

    try:
        check_device(device)
        if name not in known_shapes():
            raise ShapeError(f"unknown shape {name!r}; known: {', '.join(known_shapes())}")
        if dtype not in SHAPE_DTYPES:
            raise ShapeError(f"unknown dtype {dtype!r}; use fp32 or bf16")
        report = measure(name, cases, dtype, device, budget_s, host_budget_s)
    except ValueError as error:
        fail(str(error))
    if as_json:
        print(json.dumps(report))
    else:
        shapes.print_shape_report(report)
