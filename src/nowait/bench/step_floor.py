"""Per-step time beside the model's compute floor: how much of an engine step is the model's math.

An engine step is one forward of the model plus everything the engine does around it (sampling,
scheduling, Python, kernel launches). Its compute floor is the FLOPs that forward does, from the
one cost formula (`ModelConfig.forward_cost`), over this machine's measured matmul peak: no
implementation of that forward can take less. `overhead_share = (step - floor) / step` is the
part of the step spent on something other than the matmuls' arithmetic; on the bundled 1.8M
parameter models it is nearly all of it (issue 28).

`ForwardRecorder` watches a `Transformer` while an engine runs: a forward pre-hook keeps each
call's shape (rows, new tokens, each row's cached and valid lengths, the positions projected onto
the vocabulary). It keeps tensors, not numbers, so that recording never waits on a GPU; the FLOPs
are summed after the run, outside the timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Transformer.forward's positional order, for calls that pass these without their names.
_CACHE, _VALID, _OUTPUTS = 1, 2, 6


@dataclass
class _Call:
    batch: int
    new_tokens: int
    cached: Tensor | None  # [B] cached positions before the call
    valid: Tensor | None  # [B] real tokens per row (the rest is padding)
    output_tokens: int | None  # positions per row projected onto the vocabulary


class ForwardRecorder:
    """Records every forward of `model` (a `nowait.model.Transformer`) until `close()`.

    `calls` counts them; `flops(start, stop)` sums the FLOPs of calls[start:stop] (real tokens
    only: padding rows and positions are work the engine chose, part of its overhead)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.records: list[_Call] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    @property
    def calls(self) -> int:
        return len(self.records)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        def argument(name: str, index: int):
            return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)

        ids = argument("input_ids", 0)
        cache, valid, outputs = argument("cache", _CACHE), argument("valid_lengths", _VALID), argument(
            "output_positions", _OUTPUTS)
        batch, length = ids.shape
        self.records.append(_Call(batch, length, cache.lengths.clone() if cache is not None else None,
                                  valid.clone() if valid is not None else None,
                                  int(outputs.shape[1]) if outputs is not None else None))

    def flops(self, start: int = 0, stop: int | None = None) -> float:
        config = self.model.config
        total = 0.0
        for call in self.records[start:stop]:
            cached = call.cached.tolist() if call.cached is not None else [0] * call.batch
            valid = call.valid.tolist() if call.valid is not None else [call.new_tokens] * call.batch
            for row_cached, row_valid in zip(cached, valid, strict=True):
                if row_valid <= 0:
                    continue
                outputs = row_valid if call.output_tokens is None else min(call.output_tokens, row_valid)
                total += config.forward_cost(int(row_valid), int(row_cached), 1, output_tokens=outputs).flops
        return total

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self) -> ForwardRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dtype_name(model: nn.Module) -> str:
    """The peak to compare with: bf16 for 16-bit weights, fp32 otherwise."""
    dtype = next(model.parameters()).dtype
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def matmul_peak(device: str, dtype: str, budget_s: float = 1.0) -> float:
    """FLOP/s of a best-of square matmul on `device` in `dtype`, measured as `bench physics` and
    `--shape` measure it (`nowait.bench.shapes.device_accelerator`)."""
    from nowait.bench.shapes import device_accelerator

    return device_accelerator(device, budget_s).peak_flops(dtype)


def _significant(value: float) -> float:
    return float(f"{value:.6g}")


def step_floor(step_s: float | None, flops_per_step: float | None, peak_flops: float) -> dict:
    """`step_ms` (wall time per forward, the engine's work around it included), `compute_floor_ms`
    (that forward's FLOPs over the peak), `overhead_share` ((step - floor) / step, at least 0) and
    `step_flops`. None where a figure is unknown: no forward recorded (an engine that does not
    call the model's forward, e.g. a captured graph) or an entry that mixes engines."""
    floor_s = flops_per_step / peak_flops if flops_per_step is not None else None
    share = (max(0.0, (step_s - floor_s) / step_s) if step_s and floor_s is not None else None)
    return {"step_ms": _significant(step_s * 1000) if step_s else None,
            "compute_floor_ms": _significant(floor_s * 1000) if floor_s is not None else None,
            "overhead_share": _significant(share) if share is not None else None,
            "step_flops": flops_per_step}
