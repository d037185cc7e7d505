"""The scenario file (YAML) as pydantic models: workloads, model, hardware, engines, prices, policy.

Every field has a default where a published or stated figure exists; a wrong field is reported
as one line naming it (`workloads[1].arrival_rate_per_s: must be greater than 0 (got -3)`).
See examples/bank.yaml for a complete file and docs/planner.md for each field's meaning.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nowait.planner.engines import DIFFUSION_CACHE_MODES
from nowait.planner.hardware import ACCELERATORS, NODES, Accelerator, Node, host_node
from nowait.planner.roofline import (
    Efficiency,
    ModelSpec,
    ModelSpecError,
    model_spec_from_hf,
    preset_model,
    read_hf_config,
)
from nowait.router import DataClass, RemoteEngine, RoutingPolicy


class ScenarioError(ValueError):
    """A scenario that cannot be planned; the message names the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRef(Strict):
    """A model by preset name, by a Hugging Face config.json (file or checkpoint directory), or inline."""

    preset: str | None = None
    hf_config: str | None = None
    config: dict[str, Any] | None = None
    name: str | None = None
    _spec: ModelSpec | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _name_is_a_preset(cls, value: Any) -> Any:
        return {"preset": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> ModelRef:
        given = [key for key in ("preset", "hf_config", "config") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of preset, hf_config or config")
        try:
            if self.preset is not None:
                spec = preset_model(self.preset)
            elif self.hf_config is not None:
                base = Path((info.context or {}).get("base_dir", "."))
                path = Path(self.hf_config)
                spec = model_spec_from_hf(read_hf_config(path if path.is_absolute() else base / path),
                                          self.name or path.name)
            else:
                spec = model_spec_from_hf(self.config or {}, self.name or "inline model")
        except (ModelSpecError, ValueError) as error:
            raise ValueError(str(error)) from None
        if self.name:
            spec = replace(spec, name=self.name)
        self._spec = spec
        return self

    @property
    def spec(self) -> ModelSpec:
        assert self._spec is not None
        return self._spec


class LengthDistribution(Strict):
    """Token lengths: a plain number is fixed; otherwise a distribution by mean and standard deviation."""

    distribution: Literal["fixed", "normal", "lognormal", "uniform", "exponential"] = "lognormal"
    mean: float = Field(gt=0)
    sd: float = Field(0.0, ge=0)
    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _number_is_fixed(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return {"distribution": "fixed", "mean": value}
        return value

    @model_validator(mode="after")
    def _bounds_in_order(self) -> LengthDistribution:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        mean, sd = self.mean, self.sd
        if self.distribution == "fixed" or (sd == 0 and self.distribution != "exponential"):
            values = np.full(count, mean)
        elif self.distribution == "normal":
            values = rng.normal(mean, sd, count)
        elif self.distribution == "lognormal":  # parameters that give exactly this mean and sd
            sigma2 = math.log(1 + (sd / mean) ** 2)
            values = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), count)
        elif self.distribution == "uniform":  # mean +- sd * sqrt(3) has this mean and sd
            half = sd * math.sqrt(3)
            values = rng.uniform(mean - half, mean + half, count)
        else:
            values = rng.exponential(mean, count)
        return np.clip(np.rint(values), self.min, self.max or np.inf)


class Workload(Strict):
    name: str = Field(min_length=1)
    description: str = ""
    arrival_rate_per_s: float | None = Field(None, gt=0)
    requests: int | None = Field(None, gt=0, description="with window_hours: a batch spread over a window")
    window_hours: float | None = Field(None, gt=0)
    input_tokens: LengthDistribution
    output_tokens: LengthDistribution
    shared_prefix_tokens: int = Field(0, ge=0, description="prompt tokens every request starts with (a system "
                                      "prompt, an instruction): the AR engines' prefix cache restores them, the "
                                      "diffusion engine computes them")
    p99_latency_s: float = Field(gt=0, description="end-to-end target, arrival to last token")
    token_value_usd_per_mtok: float = Field(ge=0)
    data_class: DataClass = DataClass.internal
    batchable: bool = False

    @model_validator(mode="after")
    def _one_rate(self) -> Workload:
        by_rate = self.arrival_rate_per_s is not None
        by_batch = self.requests is not None or self.window_hours is not None
        if by_rate == by_batch:
            raise ValueError("give arrival_rate_per_s, or requests with window_hours, not both")
        if by_batch and (self.requests is None or self.window_hours is None):
            raise ValueError("requests and window_hours go together")
        return self

    @property
    def rate_per_s(self) -> float:
        if self.arrival_rate_per_s is not None:
            return self.arrival_rate_per_s
        return self.requests / (self.window_hours * 3600)


class HardwareChoice(Strict):
    node: str
    price: Literal["committed", "on_demand"] = "committed"
    price_usd_per_hour: float | None = Field(None, ge=0, description="overrides the catalog price")


class EfficiencySettings(Strict):
    compute: float = Field(0.6, gt=0, le=1)
    memory: float = Field(0.7, gt=0, le=1)
    collective_latency_us: float = Field(15.0, ge=0)
    forward_overhead_ms: float = Field(2.0, ge=0)
    memory_reserved_fraction: float = Field(0.1, ge=0, lt=1)

    def to_efficiency(self) -> Efficiency:
        return Efficiency(compute=self.compute, memory=self.memory,
                          collective_latency_s=self.collective_latency_us * 1e-6,
                          forward_overhead_s=self.forward_overhead_ms * 1e-3,
                          memory_reserved_fraction=self.memory_reserved_fraction)


class ArSettings(Strict):
    max_batch: int = Field(256, ge=1)


class SpecSettings(Strict):
    gamma: int = Field(4, ge=1, description="drafted tokens per target pass")
    acceptance_rate: float = Field(0.75, ge=0, le=1)
    draft_cost_ratio: float = Field(0.05, ge=0, description="a draft forward / a target forward (when no draft_model)")
    draft_model: ModelRef | None = None
    max_batch: int = Field(256, ge=1)


class DiffusionSettings(Strict):
    model: ModelRef | None = Field(None, description="default: the scenario's model, as a diffusion LM")
    block_width: int = Field(32, ge=1)
    tokens_per_forward: float = Field(4.0, gt=0, description="tokens committed per forward, on average")
    cache: Literal["none", "prefix", "dual", "dual-blocks", "block"] = "dual"
    max_batch: int = Field(64, ge=1)
    fallback_rate: float = Field(0.03, ge=0, le=1, description="share of answers below the confidence threshold")
    fallback: Literal["decode", "verify"] = Field(
        "decode", description="how a doubted answer is re-run on the target: decoded from scratch (a plain AR "
                              "fallback engine), or verified as a draft (a speculative fallback engine)")
    verify_gamma: int = Field(64, ge=1, description="verify: drafted tokens one target forward checks")
    verify_acceptance: float = Field(0.9, ge=0, le=1, description="verify: share of the doubted answer's tokens "
                                     "the target keeps (0.998 on the fast default's answers; doubted ones miss more)")

    @model_validator(mode="after")
    def _commit_within_block(self) -> DiffusionSettings:
        if self.tokens_per_forward > self.block_width:
            raise ValueError(f"tokens_per_forward ({self.tokens_per_forward:g}) cannot exceed block_width "
                             f"({self.block_width})")
        assert self.cache in DIFFUSION_CACHE_MODES
        return self


class EngineSettings(Strict):
    ar: ArSettings = ArSettings()
    spec: SpecSettings = SpecSettings()
    diffusion: DiffusionSettings = DiffusionSettings()


class Api(Strict):
    name: str
    input_usd_per_mtok: float = Field(ge=0)
    output_usd_per_mtok: float = Field(ge=0)
    data_classes: list[DataClass] = [DataClass.public]
    frontier: bool = Field(False, description="the router may send high-value requests here")
    source: str = ""

    @field_validator("data_classes")
    @classmethod
    def _restricted_never_leaves(cls, classes: list[DataClass]) -> list[DataClass]:
        if DataClass.restricted in classes:
            raise ValueError("restricted data never leaves: an API cannot list 'restricted'")
        return classes


class RoutingSettings(Strict):
    high_value_usd_per_mtok: float = Field(5.0, ge=0)
    confidence_threshold: float = Field(0.9, ge=0, le=1)
    batchable_budget_ms: float | None = Field(None, gt=0)
    owned_frontier_engine: Literal["ar", "spec"] = "ar"


class SimulationSettings(Strict):
    requests: int = Field(2000, ge=200, le=200_000, description="simulated arrivals per fleet size")
    seed: int = 0
    max_utilization: float = Field(0.9, gt=0, le=1, description="headroom: no fleet is planned fuller than this")
    warmup_fraction: float = Field(0.1, ge=0, lt=0.9)


class Scenario(Strict):
    name: str = "scenario"
    description: str = ""
    accelerators: list[Accelerator] = []
    nodes: list[Node] = []
    hardware: HardwareChoice
    model: ModelRef
    dtype: Literal["bf16", "fp16", "fp8", "fp32", "int8"] = "bf16"
    tensor_parallel: int = Field(1, ge=1)
    efficiency: EfficiencySettings = EfficiencySettings()
    engines: EngineSettings = EngineSettings()
    apis: list[Api] = []
    routing: RoutingSettings = RoutingSettings()
    workloads: list[Workload] = Field(min_length=1)
    simulation: SimulationSettings = SimulationSettings()
    _node: Node | None = PrivateAttr(None)
    _accelerator: Accelerator | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve_hardware(self, info: ValidationInfo) -> Scenario:
        names = [w.name for w in self.workloads]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"workloads: duplicate name(s) {', '.join(duplicates)}")
        host: Accelerator | None = (info.context or {}).get("host")
        accelerators = {**ACCELERATORS, **({"host": host} if host else {}), **{a.name: a for a in self.accelerators}}
        nodes = {**NODES, **{n.name: n for n in self.nodes}}
        if "host" in accelerators and "host" not in nodes:
            nodes["host"] = host_node(accelerators["host"])
        choice = self.hardware.node
        if choice not in nodes:
            if choice == "host":
                raise ValueError("hardware.node: 'host' is this machine, measured at run time: add --measure-host "
                                 "(or paste the figures `nowait plan --measure-host` prints under accelerators:)")
            raise ValueError(f"hardware.node: unknown node {choice!r}; known: {', '.join(sorted(nodes))}")
        node = nodes[choice]
        if node.accelerator not in accelerators:
            raise ValueError(f"nodes: node {node.name!r} names unknown accelerator {node.accelerator!r}; "
                             f"known: {', '.join(sorted(accelerators))}")
        accelerator = accelerators[node.accelerator]
        if self.dtype not in accelerator.peak_tflops:
            raise ValueError(f"dtype: {accelerator.name} lists no {self.dtype} peak "
                             f"(it has {', '.join(sorted(accelerator.peak_tflops))})")
        if node.accelerators % self.tensor_parallel:
            raise ValueError(f"tensor_parallel: {self.tensor_parallel} does not divide the {node.accelerators} "
                             f"accelerators of {node.name}")
        if self.tensor_parallel > 1 and node.interconnect_gb_s <= 0:
            raise ValueError(f"tensor_parallel: {node.name} has no interconnect_gb_s for a tensor-parallel group")
        if self.hardware.price_usd_per_hour is None:
            catalog_price = (node.committed_usd_per_hour if self.hardware.price == "committed"
                             else node.on_demand_usd_per_hour)
            if catalog_price is None:
                raise ValueError(f"hardware.price_usd_per_hour: {node.name} has no {self.hardware.price} reference "
                                 "price; give one")
        self._node, self._accelerator = node, accelerator
        return self

    @property
    def node(self) -> Node:
        assert self._node is not None
        return self._node

    @property
    def accelerator(self) -> Accelerator:
        assert self._accelerator is not None
        return self._accelerator

    @property
    def node_usd_per_hour(self) -> float:
        if self.hardware.price_usd_per_hour is not None:
            return self.hardware.price_usd_per_hour
        price = (self.node.committed_usd_per_hour if self.hardware.price == "committed"
                 else self.node.on_demand_usd_per_hour)
        assert price is not None
        return price

    def routing_policy(self) -> RoutingPolicy:
        remotes = tuple(RemoteEngine(name=api.name, data_classes=tuple(api.data_classes))
                        for api in self.apis if api.frontier)
        r = self.routing
        return RoutingPolicy(high_value_usd_per_mtok=r.high_value_usd_per_mtok,
                             confidence_threshold=r.confidence_threshold, batchable_budget_ms=r.batchable_budget_ms,
                             owned_frontier_engine=r.owned_frontier_engine, remote_frontier_engines=remotes)


def _field_path(loc: tuple, data: Any) -> str:
    """('workloads', 0, 'arrival_rate_per_s') -> "workloads[0].arrival_rate_per_s" (workload names added)."""
    path, node = "", data
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str) and path.startswith("workloads"):
                path += f" ({node['name']})"
        else:
            path += f".{part}" if path else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return path


def _message(error: dict) -> str:
    kind, message = error["type"], error["msg"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "too_short":
        return f"needs at least {error.get('ctx', {}).get('min_length', 1)} entry"
    message = message.removeprefix("Value error, ")
    message = message.replace("Input should be", "must be")
    if kind.startswith(("greater", "less", "int_", "float_", "bool_", "literal", "enum", "string")):
        message += f" (got {error.get('input')!r})"
    return message


def format_validation_error(error: ValidationError, data: Any, source: str) -> str:
    lines = []
    for item in error.errors():
        message = _message(item)
        where = _field_path(tuple(item["loc"]), data)
        # A message from a cross-field check already starts with the field it is about.
        lines.append(f"{source}: {message}" if not where else f"{source}: {where}: {message}")
    return "\n".join(lines)


def parse_scenario(data: Any, source: str = "scenario", base_dir: str | Path = ".",
                   host: Accelerator | None = None) -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: a scenario is a mapping of fields (workloads, model, hardware, ...)")
    try:
        return Scenario.model_validate(data, context={"base_dir": str(base_dir), "host": host})
    except ValidationError as error:
        raise ScenarioError(format_validation_error(error, data, source)) from None


def load_scenario(path: str | Path, host: Accelerator | None = None) -> Scenario:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ScenarioError(f"{path}: cannot read ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ScenarioError(f"{path}: not valid YAML ({error})") from None
    return parse_scenario(data, str(path), path.parent, host)
