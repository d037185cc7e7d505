"""The gateway's configuration: one YAML file (`nowait serve --config nowait.yaml`), validated by
pydantic, every bad field named in the error.

With no file the gateway serves the bundled demo models as engines `ar`, `spec` and `diffusion`,
and the model name `nowait` lets the router choose. docs/gateway.md is the reference;
examples/nowait.yaml is a full example.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from nowait import paths
from nowait.calibration import CALIBRATION_FILE, calibrated_threshold, calibrated_thresholds

# The engine models are the engine factory's input (engines/config.py); this file holds a mapping of them.
from nowait.engines.config import (
    ArEngineConfig,
    DiffusionEngineConfig,
    EngineSpec,
    OwnedEngineConfig,
    RemoteEngineConfig,
    SpecEngineConfig,
    Strict,
)
from nowait.router import DEFAULT_CONFIDENCE_THRESHOLD, DataClass, LowConfidenceMode, RemoteEngine, RoutingPolicy
from nowait.store.url import StoreError, StoreURL, parse_store_url


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and the field."""


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
    low_confidence: LowConfidenceMode = Field(
        "flag", description="an answer below its engine's confidence_floor: flag it (nowait.low_confidence and "
                            "x-nowait-low-confidence), re-run it on the frontier engine its data class may reach "
                            "(frontier), or answer 422 low_confidence (reject)")


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
    torch_threads: int | None = Field(None, ge=1, description="torch's CPU threads for the in-process engines "
                                                         "(default: the cores less reserved_cores, shared out "
                                                         "among them, at least 1)")
    reserved_cores: int = Field(1, ge=0, description="cores the engines' threads leave to the server's own work "
                                                     "(HTTP, tokenizing, streaming) when torch_threads is unset")
    max_request_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="largest request body (a batch input "
                                                                           "file included); more gets 413")
    max_concurrent_streams: int = Field(256, ge=1, description="server-sent event streams open at once; one more "
                                                              "gets 429 too_many_streams")
    stream_stall_timeout_s: float = Field(30.0, gt=0, description="a stream whose client reads nothing this long "
                                                                  "is dropped (its engine work cancelled)")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, how long running requests may take to "
                                                          "finish once no new ones are accepted; then they are "
                                                          "cancelled and the server stops")


def _keys_from(listed: list[str], env: str | None) -> set[str]:
    keys = set(listed)
    if env and os.environ.get(env):
        keys |= {k.strip() for k in os.environ[env].split(",") if k.strip()}
    return keys


class AuthConfig(Strict):
    api_keys: list[str] = Field(default_factory=list, description="keys of the tenant `default`, without limits")
    api_keys_env: str | None = Field("NOWAIT_API_KEYS", description="comma-separated keys in this variable")
    admin_keys: list[str] = Field(default_factory=list, description="keys for /admin/keys (and nothing else)")
    admin_keys_env: str | None = Field("NOWAIT_ADMIN_KEYS", description="comma-separated admin keys")
    database: Path | None = Field(None, description="SQLite file of the tenants' keys (`nowait keys`; default "
                                                    "keys.sqlite beside the batch store)")

    def keys(self) -> set[str]:
        return _keys_from(self.api_keys, self.api_keys_env)

    def admin(self) -> set[str]:
        return _keys_from(self.admin_keys, self.admin_keys_env)


class StoreConfig(Strict):
    url: str | None = Field(None, description="sqlite:///PATH (the default: DATA_DIR/batches.sqlite, keys.sqlite and "
                                              "audit.jsonl beside it) or postgresql://USER:PASSWORD@HOST/DB: files, "
                                              "batches, keys and audit in one database that several replicas share")
    replica: str | None = Field(None, description="this replica's name in batch leases and its audit chain "
                                                  "(default HOST:PORT)")
    lease_s: float = Field(30.0, gt=0, description="how long a batch line a replica claimed stays its own without "
                                                   "renewal (a killed replica's lines run elsewhere after it)")
    pool_size: int = Field(10, ge=1, description="PostgreSQL connections this replica keeps at most")

    @model_validator(mode="after")
    def _url_parses(self) -> StoreConfig:
        if self.url is not None:
            try:
                parse_store_url(self.url)
            except StoreError as error:
                raise ValueError(str(error)) from None
        return self


class BatchConfig(Strict):
    database: Path | None = Field(None, description="SQLite file of files and batches "
                                                    "(default DATA_DIR/batches.sqlite)")
    max_concurrent_lines: int = Field(32, ge=1, description="batch lines in flight at once")
    # OpenAI's limits for a batch input file.
    max_file_lines: int = Field(50_000, ge=1, description="requests in one batch input file; more gets 400")
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1, description="bytes of one batch input file; more gets 400")
    data_class: DataClass | None = Field(None, description="for lines that state none (default: defaults.data_class)")


class FleetConfig(Strict):
    """`nowait fleet up`: where the Ray Serve application runs and listens (docs/fleet.md); each
    owned engine's replicas are under `engines.<name>.fleet`."""

    ray_address: str | None = Field(None, description="the Ray cluster (ray://HOST:10001 or HOST:6379); unset: a "
                                                      "local cluster is started")
    gateway_replicas: int = Field(2, ge=1, description="gateway (ingress) replicas; more than one needs a "
                                                       "PostgreSQL store.url")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    direct_ingress: bool = Field(False, description="each gateway replica serves HTTP on its own port (Ray Serve's "
                                                    "direct ingress), no proxy hop; `fleet status` gives the URLs")
    throughput_optimized: bool = Field(False, description="Ray Serve's throughput-optimized mode in every Serve "
                                                          "process of the application: direct ingress, gRPC between "
                                                          "the gateway and the engine replicas, replica code on its "
                                                          "event loop (docs/fleet.md)")
    worker_niceness: int = Field(0, ge=0, le=19, description="the niceness of the replicas' processes on a local "
                                                             "cluster `fleet up` starts (Ray's own default, 15, "
                                                             "puts the engines below every other process); a "
                                                             "cluster at ray_address sets it at its `ray start`")


def shared_threads(cores: int, engines: int, reserved: int) -> int:
    """Each engine's torch threads: the cores less those reserved for the server's own work,
    shared out among the engines, at least one. Engines busy at the same time each ask for that
    many cores, and a torch operation split over threads waits for the slowest of them: with
    torch's default (every core) two engines on two cores ran both slower (the demo's real-time
    p50 56 ms at 2 threads, 40 ms at 1, pinned AR 440 against 212 ms), and one engine alone on
    two cores served a batch-1 stream in 118 ms at 2 threads against 54 ms at 1, because the
    event loop that streams its tokens runs on one of them (docs/gateway.md, "Threads"). vLLM's
    CPU backend keeps a core for its API server for the same reason (VLLM_CPU_NUM_OF_RESERVED_CPU)."""
    return max(1, (cores - reserved) // max(1, engines))


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
    store: StoreConfig = StoreConfig()
    fleet: FleetConfig = FleetConfig()

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

    def in_process_engine_names(self) -> list[str]:
        """Engines this process runs itself (each on a thread of its own)."""
        return [n for n, e in self.engines.items() if not isinstance(e, RemoteEngineConfig)]

    def on_device(self, names: list[str], device: str) -> GatewayConfig:
        """This config with the in-process engines among `names` moved to `device` (a bench's or
        an eval's --device); remote ones are left as they are: they run elsewhere."""
        engines = dict(self.engines)
        for name in names:
            if name in engines and not isinstance(engines[name], RemoteEngineConfig):
                engines[name] = engines[name].model_copy(update={"device": device})
        return self.model_copy(update={"engines": engines})

    def engine_threads(self, cores: int, engines: int | None = None) -> int:
        """torch's CPU threads (intra-op, shared by every engine of the process):
        `server.torch_threads`, or else `shared_threads` over the in-process engines (or
        `engines` of them, where only some run here)."""
        if self.server.torch_threads:
            return self.server.torch_threads
        count = len(self.in_process_engine_names()) if engines is None else engines
        return shared_threads(cores, count, self.server.reserved_cores)

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

    def calibrated_thresholds(self) -> tuple[dict, dict]:
        """Per-schema and per-kind thresholds from the fast engine's calibration file; none when
        the config sets routing.confidence_threshold (the operator's number holds for every request)."""
        fast = self.engines.get(self.routing.fast_engine) if self.routing.fast_engine else None
        if self.routing.confidence_threshold is not None or not isinstance(fast, OwnedEngineConfig):
            return {}, {}
        return calibrated_thresholds(paths.model_dir(fast.model))

    def routing_policy(self) -> RoutingPolicy:
        r = self.routing
        remotes = self.remote_engines()
        frontier = r.frontier_remotes if r.frontier_remotes is not None else list(remotes)
        by_schema, by_kind = self.calibrated_thresholds()
        floors = {n: e.confidence_floor for n, e in self.engines.items() if e.confidence_floor is not None}
        return RoutingPolicy(high_value_usd_per_mtok=r.high_value_usd_per_mtok,
                             confidence_threshold=self.confidence_threshold()[0],
                             schema_thresholds=by_schema, kind_thresholds=by_kind, confidence_floors=floors,
                             low_confidence=r.low_confidence,
                             batchable_budget_ms=r.batchable_budget_ms,
                             owned_engines=tuple(self.owned_engine_names()), batch_engine=r.batch_engine,
                             fast_engine=r.fast_engine, fallback_engine=r.fallback_engine,
                             owned_frontier_engine=r.owned_frontier_engine,
                             remote_frontier_engines=tuple(remotes[n] for n in frontier))

    @property
    def store_url(self) -> StoreURL:
        """The store this gateway uses: `store.url`, else SQLite at the batch database's path."""
        if self.store.url is not None:
            return parse_store_url(self.store.url)
        return StoreURL("sqlite", f"sqlite:///{self.batch_database}", self.batch_database)

    @property
    def replica_name(self) -> str:
        return self.store.replica or f"{socket.gethostname()}:{self.server.port}"

    @property
    def batch_database(self) -> Path:
        """The SQLite file of files and batches (with a SQLite `store.url`, its path)."""
        if self.store.url is not None:
            url = parse_store_url(self.store.url)
            if url.path is not None:
                return url.path
        return self.batches.database or self.data_dir / "batches.sqlite"

    @property
    def key_database(self) -> Path:
        return self.auth.database or self.batch_database.parent / "keys.sqlite"

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
    auth = config.auth.model_copy(update={"database": resolve(config.auth.database)})
    store = config.store
    if store.url is not None and (url := parse_store_url(store.url)).path is not None:
        store = store.model_copy(update={"url": f"sqlite:///{resolve(url.path)}"})
    return config.model_copy(update={"engines": engines, "data_dir": resolve(config.data_dir),
                                     "audit_log": resolve(config.audit_log), "batches": batches, "auth": auth,
                                     "store": store})


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
