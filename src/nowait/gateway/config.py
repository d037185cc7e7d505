"""The gateway's configuration: one YAML file (`nowait serve --config nowait.yaml`), validated by
pydantic, every bad field named in the error.

With no file the gateway serves the bundled demo models as engines `ar`, `spec` and `diffusion`,
and the model name `nowait` lets the router choose. docs/gateway.md is the reference;
examples/nowait.yaml is a full example.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nowait import paths
from nowait.calibration import CALIBRATION_FILE, calibrated_threshold
from nowait.engines.base import InvalidRequestError
from nowait.engines.diffusion.request import DiffusionOptions
from nowait.engines.speculative import BEST_METHOD, SPEC_SETTINGS, SpeculativeConfig
from nowait.planner.hardware import NODES
from nowait.router import DEFAULT_CONFIDENCE_THRESHOLD, DataClass, RemoteEngine, RoutingPolicy

# The one reference price the project quotes (docs/mission.md, planner catalog): an 8xH100 node on
# demand. A default only; set `node_usd_per_hour` to what your node really costs.
REFERENCE_NODE_USD_PER_HOUR = NODES["8xH100-SXM"].on_demand_usd_per_hour or 0.0


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OwnedEngineConfig(Strict):
    """Fields every in-process engine shares."""

    model: str = Field("ar", description="a bundled demo model (ar, draft, diffusion) or a checkpoint directory")
    node_usd_per_hour: float = Field(REFERENCE_NODE_USD_PER_HOUR, ge=0,
                                     description="what the node this engine runs on costs per hour")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # auto: the checkpoint's own
    device: str = "cpu"
    max_queue: int = Field(64, ge=0, description="requests allowed to wait beyond those running; more get 429")


class ArEngineConfig(OwnedEngineConfig):
    kind: Literal["ar"]
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    prefix_cache_tokens: int | None = Field(None, ge=0, description="prompt tokens the prefix cache keeps (default: "
                                                                  "an eighth of the rows' tokens, at least "
                                                                  "max_model_len; 0: off)")
    structured: bool = Field(True, description="build the JSON-schema grammar (response_format)")

    @model_validator(mode="after")
    def _token_cap_holds_a_batch(self) -> ArEngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): a decode step feeds one token per sequence")
        return self


class SpecEngineConfig(ArEngineConfig):
    """AR + speculative decoding. `gamma`, `draft_confidence` and `lookup_gamma` left unset take
    the method's tuned values (`nowait.engines.speculative.SPEC_SETTINGS`), so choosing a method
    gets the settings measured for it rather than another method's."""

    kind: Literal["spec"]  # type: ignore[assignment]
    max_num_seqs: int = Field(4, ge=1)  # speculation pays at small batch (engines/speculative/config.py)
    method: Literal["hybrid", "draft", "ngram", "diffusion"] = Field(
        BEST_METHOD, description="hybrid (prompt lookup, else the draft model), draft, ngram (no draft model), or "
                                 "diffusion (a diffusion model drafts the whole answer)")
    draft: str | None = Field(None, description="the draft checkpoint: a causal draft for methods hybrid and draft "
                                                "(default: draft), a diffusion model for method diffusion (default: "
                                                "diffusion); it must share the target's tokenizer")
    gamma: int | None = Field(None, ge=1, description="proposals per step, at most (default: the method's)")
    draft_confidence: float | None = Field(None, ge=0, lt=1, description="stop drafting after a proposal the "
                                           "draft is less sure of (0: never; default: the method's)")
    lookup_gamma: int | None = Field(None, ge=1, description="tokens one prompt lookup proposes, at most "
                                     "(default: the method's)")
    drafter_tau: float | None = Field(None, gt=0, le=1, description="method diffusion: the drafter's commit "
                                      "threshold (default: the method's)")
    answer_gamma: int | None = Field(None, ge=1, description="tokens of a drafted answer (method diffusion, or a "
                                     "fast engine's answer on fallback) one verify checks (default: 64)")

    def speculative_config(self) -> SpeculativeConfig:
        """The engine's settings: the method's tuned ones, with what this config sets instead."""
        chosen = {name: value for name in ("gamma", "draft_confidence", "lookup_gamma", "drafter_tau", "answer_gamma")
                  if (value := getattr(self, name)) is not None}
        return replace(SPEC_SETTINGS[self.method], **chosen)

    @property
    def draft_model(self) -> str:
        """The draft checkpoint, or the method's bundled one."""
        return self.draft or ("diffusion" if self.method == "diffusion" else "draft")


class DiffusionEngineConfig(OwnedEngineConfig):
    kind: Literal["diffusion"]
    model: str = "diffusion"
    max_batch: int = Field(8, ge=1)
    options: dict[str, Any] = Field(default_factory=dict, description="DiffusionOptions overrides")

    @field_validator("options")
    @classmethod
    def _known_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        known = set(DiffusionOptions.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown diffusion option(s) {unknown}; known: {sorted(known)}")
        try:
            DiffusionOptions(**options).validate()
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        return options


class RemoteEngineConfig(Strict):
    """An OpenAI-compatible upstream: an external API, or a vLLM/SGLang server in the building."""

    kind: Literal["remote"]
    base_url: str = Field(description="the upstream's /v1 root, e.g. https://api.example.com/v1")
    model: str = Field(description="the model name the upstream knows")
    api_key_env: str | None = Field(None, description="environment variable holding the upstream's API key")
    on_premises: bool = Field(False, description="inside the building: may receive every data class")
    data_classes: list[DataClass] = Field(default_factory=lambda: [DataClass.public],
                                          description="external upstreams: the data classes they may receive")
    input_usd_per_mtok: float = Field(ge=0)
    output_usd_per_mtok: float = Field(ge=0)
    timeout_s: float = Field(60.0, gt=0)
    max_concurrency: int = Field(64, ge=1, description="requests in flight upstream; more get 429")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _restricted_never_leaves(self) -> RemoteEngineConfig:
        if not self.on_premises and DataClass.restricted in self.data_classes:
            raise ValueError("restricted data never leaves: an external upstream cannot list 'restricted' "
                             "(set on_premises: true for a server inside the building)")
        return self


EngineSpec = Annotated[ArEngineConfig | SpecEngineConfig | DiffusionEngineConfig | RemoteEngineConfig,
                       Field(discriminator="kind")]


class RoutingConfig(Strict):
    high_value_usd_per_mtok: float = Field(5.0, ge=0)
    confidence_threshold: float | None = Field(
        None, ge=0, le=1, description="diffusion answers below it re-run on the fallback engine (default: the "
                                      "threshold `nowait calibrate` wrote beside the fast engine's model, else "
                                      f"{DEFAULT_CONFIDENCE_THRESHOLD:g})")
    batchable_budget_ms: float | None = Field(None, gt=0)
    batch_engine: str = "ar"
    fast_engine: str | None = "diffusion"
    fallback_engine: str = "ar"
    owned_frontier_engine: str = "ar"
    frontier_remotes: list[str] | None = Field(
        None, description="external upstreams high-value work may go to, in order (default: all of them)")


class RequestDefaults(Strict):
    """Metadata a request does not state. The data class defaults to restricted: data leaves the
    building only when the caller says it may."""

    latency_budget_ms: float | None = Field(None, gt=0)
    token_value_usd_per_mtok: float = Field(1.0, ge=0)
    data_class: DataClass = DataClass.restricted
    batchable: bool = False
    max_tokens: int = Field(160, ge=1, description="when a request gives none (the demo models answer in 160)")


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    router_model: str = Field("nowait", description="the model name that lets the router choose")
    request_timeout_s: float = Field(300.0, gt=0)
    torch_threads: int | None = Field(None, ge=1)
    max_request_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="largest request body (a batch input "
                                                                           "file included); more gets 413")


class AuthConfig(Strict):
    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = Field("NOWAIT_API_KEYS", description="comma-separated keys in this variable")

    def keys(self) -> set[str]:
        keys = set(self.api_keys)
        if self.api_keys_env and os.environ.get(self.api_keys_env):
            keys |= {k.strip() for k in os.environ[self.api_keys_env].split(",") if k.strip()}
        return keys


class BatchConfig(Strict):
    database: Path | None = Field(None, description="SQLite file of files and batches "
                                                    "(default DATA_DIR/batches.sqlite)")
    max_concurrent_lines: int = Field(32, ge=1, description="batch lines in flight at once")
    data_class: DataClass | None = Field(None, description="for lines that state none (default: defaults.data_class)")


DEFAULT_ENGINES: dict[str, EngineSpec] = {
    "ar": ArEngineConfig(kind="ar", model="ar"),
    "spec": SpecEngineConfig(kind="spec", model="ar", draft="draft"),  # the best method, tuned
    "diffusion": DiffusionEngineConfig(kind="diffusion", model="diffusion"),
}


class GatewayConfig(Strict):
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    data_dir: Path = Field(Path("nowait-data"), description="where the batch store and the audit log live")
    audit_log: Path | None = Field(None, description="JSONL audit log (default DATA_DIR/audit.jsonl)")
    metrics_window_s: float = Field(60.0, gt=0, description="window of the live utilization and cost gauges")
    # A file without `engines` serves the bundled demo models (`default_config`'s).
    engines: dict[str, EngineSpec] = Field(default_factory=lambda: dict(DEFAULT_ENGINES), min_length=1)
    routing: RoutingConfig = RoutingConfig()
    defaults: RequestDefaults = RequestDefaults()
    batches: BatchConfig = BatchConfig()

    @model_validator(mode="after")
    def _names_resolve(self) -> GatewayConfig:
        if self.server.router_model in self.engines:
            raise ValueError(f"server.router_model: {self.server.router_model!r} is also an engine name")
        owned = set(self.owned_engine_names())
        r = self.routing
        for field in ("batch_engine", "fallback_engine", "owned_frontier_engine", "fast_engine"):
            name = getattr(r, field)
            if name is None:
                continue
            if name not in self.engines:
                raise ValueError(f"routing.{field}: {name!r} is not a configured engine "
                                 f"(engines: {', '.join(self.engines)})")
            if name not in owned:
                raise ValueError(f"routing.{field}: {name!r} is an external upstream; this role needs an "
                                 "engine inside the building")
        for name in r.frontier_remotes or []:
            if name not in self.external_engine_names():
                raise ValueError(f"routing.frontier_remotes: {name!r} is not an external remote engine")
        return self

    def owned_engine_names(self) -> list[str]:
        """Engines inside the building: in process, or remote with on_premises: true."""
        return [n for n, e in self.engines.items() if not isinstance(e, RemoteEngineConfig) or e.on_premises]

    def external_engine_names(self) -> list[str]:
        return [n for n, e in self.engines.items() if isinstance(e, RemoteEngineConfig) and not e.on_premises]

    def remote_engines(self) -> dict[str, RemoteEngine]:
        """The external upstreams as the router sees them (name and allowed data classes)."""
        return {n: RemoteEngine(name=n, data_classes=tuple(self.engines[n].data_classes))
                for n in self.external_engine_names()}

    def confidence_threshold(self) -> tuple[float, str]:
        """The fallback threshold and where it came from (the config, a calibration file, the default)."""
        r = self.routing
        if r.confidence_threshold is not None:
            return r.confidence_threshold, "routing.confidence_threshold"
        fast = self.engines.get(r.fast_engine) if r.fast_engine else None
        if isinstance(fast, OwnedEngineConfig):
            model_dir = paths.model_dir(fast.model)
            calibrated = calibrated_threshold(model_dir)
            if calibrated is not None:
                return calibrated, str(model_dir / CALIBRATION_FILE)
        return DEFAULT_CONFIDENCE_THRESHOLD, "default"

    def routing_policy(self) -> RoutingPolicy:
        r = self.routing
        remotes = self.remote_engines()
        frontier = r.frontier_remotes if r.frontier_remotes is not None else list(remotes)
        return RoutingPolicy(high_value_usd_per_mtok=r.high_value_usd_per_mtok,
                             confidence_threshold=self.confidence_threshold()[0],
                             batchable_budget_ms=r.batchable_budget_ms,
                             owned_engines=tuple(self.owned_engine_names()), batch_engine=r.batch_engine,
                             fast_engine=r.fast_engine, fallback_engine=r.fallback_engine,
                             owned_frontier_engine=r.owned_frontier_engine,
                             remote_frontier_engines=tuple(remotes[n] for n in frontier))

    @property
    def batch_database(self) -> Path:
        return self.batches.database or self.data_dir / "batches.sqlite"

    @property
    def audit_log_path(self) -> Path:
        return self.audit_log or self.data_dir / "audit.jsonl"


def default_config() -> GatewayConfig:
    """No file: the bundled demo models, `ar` for batches and fallback, `diffusion` for fast work."""
    return GatewayConfig()


def _field_path(loc: tuple, data: Any) -> str:
    """('engines', 'ar', 'ar', 'max_num_seqs') -> 'engines.ar.max_num_seqs' (the union's tag dropped)."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if i == 2 and loc[0] == "engines" and isinstance(data, dict):
            engine = (data.get("engines") or {}).get(loc[1])
            if isinstance(engine, dict) and engine.get("kind") == part:
                continue
        parts.append(f"[{part}]" if isinstance(part, int) else str(part))
    return ".".join(parts).replace(".[", "[")


def format_validation_error(error: ValidationError, data: Any, source: str) -> str:
    lines = []
    for problem in error.errors():
        where = _field_path(problem["loc"], data)
        message = problem["msg"].removeprefix("Value error, ")
        # Our own messages already quote the value; pydantic's type and bound errors do not.
        quiet = problem["type"] in ("value_error", "missing", "extra_forbidden", "union_tag_invalid")
        got = "" if quiet or isinstance(problem.get("input"), dict | list) else f" (got {problem['input']!r})"
        lines.append(f"{source}: {where + ': ' if where else ''}{message}{got}")
    return "\n".join(lines)


def _resolve_paths(config: GatewayConfig, base: Path) -> GatewayConfig:
    """Relative paths in a file are relative to the file, not to wherever the server starts."""
    def resolve(path: Path | None) -> Path | None:
        return path if path is None or path.is_absolute() else base / path

    engines = {}
    for name, engine in config.engines.items():
        update: dict[str, Any] = {}
        if not isinstance(engine, RemoteEngineConfig):
            if engine.model not in paths.DEMO_MODELS and not Path(engine.model).is_absolute():
                update["model"] = str(base / engine.model)
            if isinstance(engine, SpecEngineConfig) and engine.draft is not None \
                    and engine.draft not in paths.DEMO_MODELS and not Path(engine.draft).is_absolute():
                update["draft"] = str(base / engine.draft)
        engines[name] = engine.model_copy(update=update)
    batches = config.batches.model_copy(update={"database": resolve(config.batches.database)})
    return config.model_copy(update={"engines": engines, "data_dir": resolve(config.data_dir),
                                     "audit_log": resolve(config.audit_log), "batches": batches})


def parse_config(data: Any, source: str = "config", base: Path | None = None) -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}")
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, data, source)) from None
    return _resolve_paths(config, base) if base is not None else config


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read ({error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from None
    return parse_config(data, str(path), base=path.resolve().parent)


__all__ = ["ConfigError", "GatewayConfig", "default_config", "load_config", "parse_config"]
