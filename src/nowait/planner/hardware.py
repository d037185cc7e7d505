"""Accelerators and nodes: the figures the roofline needs, each with its source and date.

Figures are dense (no structured sparsity) peak throughput per accelerator, as the vendors'
datasheets state them; prices are list prices at the date given and change often, so a scenario
can override every entry. `measure_host` adds this machine, measured with torch in a few seconds.
"""

from __future__ import annotations

import math
import os
import time
from datetime import date
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from torch import Tensor  # the planner imports torch only to measure

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


class Accelerator(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    peak_tflops: dict[str, float] = Field(description="dense peak TFLOP/s per dtype (bf16, fp16, fp8, fp32)")
    memory_bandwidth_tb_s: float = Field(gt=0)
    memory_gb: float = Field(gt=0)
    source: str = "user-supplied"
    date: str = ""
    read_bandwidth_tb_s: float | None = Field(None, gt=0, description="the rate a one-row matmul streams a weight "
                                                                      "larger than the caches, where measured: a "
                                                                      "forward mostly reads its weights, so the "
                                                                      "roofline's memory time uses it")
    gemm_efficiency: dict[str, dict[int, float]] | None = Field(
        None, description="per dtype, the fraction of its peak a matmul of that many rows reaches (measured: "
                          "rows x 2048 times 2048 x 4096); the planner's compute efficiency at a forward's "
                          "width, in place of the assumed one")

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise KeyError(f"accelerator {self.name!r} has no peak for dtype {dtype!r} "
                           f"(it lists {sorted(self.peak_tflops)})")
        return self.peak_tflops[dtype] * 1e12

    @property
    def memory_bandwidth(self) -> float:
        """Bytes per second."""
        return self.memory_bandwidth_tb_s * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def stream_bandwidth(self) -> float:
        """Bytes per second a forward's reads stream at: the measured read bandwidth where there
        is one, else the datasheet's (or the copy's) figure."""
        return (self.read_bandwidth_tb_s or self.memory_bandwidth_tb_s) * 1e12

    def compute_efficiency(self, dtype: str, rows: float) -> float | None:
        """The measured fraction of the `dtype` peak a matmul of `rows` rows reaches, or None
        where none was measured."""
        curve = (self.gemm_efficiency or {}).get(dtype)
        return interpolate_log2(curve, rows) if curve else None


# Linear in log2(x) between measured points, flat outside them: a matmul's efficiency rises with
# its row count roughly per doubling (more rows reuse each loaded weight tile), then saturates.
def interpolate_log2(points: dict[int, float], x: float) -> float:
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    upper = next(i for i, point in enumerate(xs) if point >= x)
    low, high = xs[upper - 1], xs[upper]
    share = (math.log2(x) - math.log2(low)) / (math.log2(high) - math.log2(low))
    return points[low] + share * (points[high] - points[low])


class Node(BaseModel):
    """A machine one rents or buys: N accelerators, their interconnect, and what an hour of it costs."""

    model_config = ConfigDict(extra="forbid")

    name: str
    accelerator: str
    accelerators: int = Field(1, ge=1)
    interconnect_gb_s: float = Field(0.0, ge=0, description="per accelerator, per direction (NVLink), GB/s")
    on_demand_usd_per_hour: float | None = Field(None, ge=0)
    committed_usd_per_hour: float | None = Field(None, ge=0)
    price_source: str = ""
    price_date: str = ""


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in [
    Accelerator(name="H100-SXM", peak_tflops={"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67},
                memory_bandwidth_tb_s=3.35, memory_gb=80,
                source="NVIDIA H100 Tensor Core GPU datasheet (SXM5; dense = half the sparsity figures)",
                date="2023"),
    Accelerator(name="H200-SXM", peak_tflops={"bf16": 989, "fp16": 989, "fp8": 1979, "fp32": 67},
                memory_bandwidth_tb_s=4.8, memory_gb=141,
                source="NVIDIA H200 Tensor Core GPU datasheet (SXM)", date="2024"),
    Accelerator(name="B200", peak_tflops={"bf16": 2250, "fp16": 2250, "fp8": 4500},
                memory_bandwidth_tb_s=8.0, memory_gb=180,
                source="NVIDIA HGX/DGX B200 datasheet, per GPU (180-192 GB depending on the SKU)", date="2024"),
    Accelerator(name="A100-80GB", peak_tflops={"bf16": 312, "fp16": 312, "fp32": 19.5},
                memory_bandwidth_tb_s=2.0, memory_gb=80,
                source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB, 2,039 GB/s)", date="2021"),
    Accelerator(name="L40S", peak_tflops={"bf16": 362, "fp16": 362, "fp8": 733, "fp32": 91.6},
                memory_bandwidth_tb_s=0.864, memory_gb=48,
                source="NVIDIA L40S datasheet (dense = half the sparsity figures)", date="2023"),
]}

NODES: dict[str, Node] = {n.name: n for n in [
    Node(name="8xH100-SXM", accelerator="H100-SXM", accelerators=8, interconnect_gb_s=450,
         on_demand_usd_per_hour=55.0, committed_usd_per_hour=33.0,
         price_source="AWS p5.48xlarge, us-east-1 list after the June 2025 price cut; one-year plan for committed "
                      "(as quoted in docs/mission.md; check current prices)",
         price_date="2025-06"),
    Node(name="8xH200-SXM", accelerator="H200-SXM", accelerators=8, interconnect_gb_s=450,
         price_source="no reference price: set hardware.price_usd_per_hour"),
    Node(name="8xB200", accelerator="B200", accelerators=8, interconnect_gb_s=900,
         price_source="no reference price: set hardware.price_usd_per_hour"),
    Node(name="8xA100-80GB", accelerator="A100-80GB", accelerators=8, interconnect_gb_s=300,
         price_source="no reference price: set hardware.price_usd_per_hour"),
    Node(name="4xL40S", accelerator="L40S", accelerators=4, interconnect_gb_s=32,  # PCIe Gen4 x16, no NVLink
         price_source="no reference price: set hardware.price_usd_per_hour"),
]}


def time_best(run, repeats: int, budget_s: float) -> float:
    """The fastest of `repeats` runs (the least disturbed by other work), within a time budget."""
    best = float("inf")
    started = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - started > budget_s:
            break
    return best


def measure_host(budget_s: float = 3.0, threads: int | None = None) -> Accelerator:
    """This machine as an accelerator: fp32/bf16 matmul peak, the fp32 matmul's efficiency by row
    count, copy and read bandwidth, measured with torch.

    A best-of-several square matmul gives the peak (2 n^3 FLOPs each); narrower ones give the
    efficiency curve (`gemm_efficiency_curve`); copying a tensor much larger than the caches gives
    the bandwidth (each byte read once and written once), a one-row matmul against a weight as
    large the bandwidth a weight-bound step reads at (`weight_stream_bandwidth`).
    `budget_s` bounds the whole measurement; the figures are lower bounds of what tuned kernels
    reach.
    """
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        peaks: dict[str, float] = {}
        share = budget_s / 3
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            n = 1024 if budget_s >= 1 else 256
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            a @ b  # warm-up: first call pays for allocation and kernel selection
            seconds = time_best(lambda a=a, b=b: a @ b, repeats=20, budget_s=share)
            # significant digits, not decimals: a slow bf16 path must not round to 0
            peaks[dtype_name] = float(f"{2 * n**3 / seconds / 1e12:.4g}")
        # 32 MiB of fp32 weight at the full budget, beyond a server CPU's L2 and most L3 slices.
        inner, outer = (2048, 4096) if budget_s >= 1 else (256, 512)
        efficiency = {"fp32": gemm_efficiency_curve(inner, outer, peaks["fp32"] * 1e12, budget_s / 6)}
        elements = (64 if budget_s >= 1 else 8) * 2**20  # 256 MiB of fp32 at the full budget
        source, target = torch.ones(elements), torch.empty(elements)
        target.copy_(source)
        seconds = time_best(lambda: target.copy_(source), repeats=10, budget_s=share / 2)
        bandwidth_tb_s = 2 * elements * 4 / seconds / 1e12
        read_tb_s = weight_stream_bandwidth(source, share / 2) / 1e12  # the same 256 MiB, read as a weight
    finally:
        torch.set_num_threads(previous_threads)
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        memory_gb = 8.0
    return Accelerator(name="host", peak_tflops=peaks, memory_bandwidth_tb_s=float(f"{bandwidth_tb_s:.4g}"),
                       read_bandwidth_tb_s=float(f"{read_tb_s:.4g}"), gemm_efficiency=efficiency,
                       memory_gb=round(memory_gb, 1),
                       source=f"measured by `nowait plan --measure-host` ({os.cpu_count()} CPU threads)",
                       date=date.today().isoformat())


GEMM_ROWS = (1, 4, 16, 32, 64, 128, 256, 512)


def gemm_efficiency_curve(inner: int, outer: int, peak_flops: float, budget_s: float) -> dict[int, float]:
    """Rows -> the fraction of `peak_flops` (a square matmul's) that a rows x inner times inner x
    outer fp32 matmul reaches, best of several within `budget_s` shared by the widths. A decode
    step's matmuls have as many rows as the batch, a diffusion block's the block times the batch:
    far from square. The weight should be larger than the CPU's caches, as a model's are: a
    cached one makes narrow matmuls look as fast as square ones."""
    import torch

    weight = torch.randn(inner, outer)
    curve: dict[int, float] = {}
    for rows in GEMM_ROWS:
        x = torch.randn(rows, inner)
        x @ weight
        seconds = time_best(lambda x=x: x @ weight, repeats=20, budget_s=budget_s / len(GEMM_ROWS))
        curve[rows] = float(f"{min(1.0, 2 * rows * inner * outer / seconds / peak_flops):.3g}")
    return curve


def weight_stream_bandwidth(buffer: Tensor, budget_s: float) -> float:
    """Bytes per second a one-row fp32 matmul reads its weight at, the weight the contiguous fp32
    `buffer` (larger than the caches, as a model's are; a whole number of 4,096-float rows): the
    kernel a weight-bound decode step is made of. It reads every weight once and writes almost
    nothing, yet on the development CPU it streamed at 12-19 GB/s for weights of 256-545 MB,
    where a plain sum read 27 GB/s."""
    import torch

    inner = 4096
    weight = buffer.view(-1, inner)
    x = torch.ones(1, inner)
    x @ weight.T
    seconds = time_best(lambda: x @ weight.T, repeats=10, budget_s=budget_s)
    return weight.numel() * 4 / seconds


def host_node(accelerator: Accelerator) -> Node:
    return Node(name="host", accelerator=accelerator.name, accelerators=1,
                price_source="this machine: set hardware.price_usd_per_hour (0 if already paid for)")
