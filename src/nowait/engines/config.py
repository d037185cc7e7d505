"""One engine as a configuration says it: the models of `engines.<name>` in the gateway's YAML
(docs/gateway.md), the input of the engine factory (engines/factory.py).

Owned engines (`ar`, `spec`, `diffusion`) are built in process from these by the factory, for
`nowait serve`, the CLI and the benches alike; a `remote` one is an OpenAI-compatible upstream the
gateway reaches over HTTP. The gateway's own file format (gateway/config.py) holds a mapping of
these under `engines`; nothing here knows about the gateway.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nowait.engines.base import InvalidRequestError
from nowait.engines.diffusion import DiffusionOptions
from nowait.engines.speculative import BEST_METHOD, SPEC_SETTINGS, SpeculativeConfig
from nowait.planner.hardware import NODES
from nowait.router import DataClass

# The one reference price the project quotes (docs/mission.md, planner catalog): an 8xH100 node on
# demand. A default only; set `node_usd_per_hour` to what your node really costs.
REFERENCE_NODE_USD_PER_HOUR = NODES["8xH100-SXM"].on_demand_usd_per_hour or 0.0


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaRange(Strict):
    min: int = Field(1, ge=0, description="replicas kept running (0: scale to zero when idle)")
    max: int = Field(1, ge=1, description="replicas at most")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.min > self.max:
            raise ValueError(f"replicas.min ({self.min}) is more than replicas.max ({self.max})")
        return self


class FleetEngineConfig(Strict):
    """How `nowait fleet up` deploys one owned engine on Ray Serve (nowait.fleet); `nowait
    serve` ignores it. Without a `fleet` section an engine gets one replica."""

    replicas: ReplicaRange = ReplicaRange()
    gpus_per_replica: float = Field(0.0, ge=0, description="GPUs each replica holds (fractions share one)")
    cpus_per_replica: float = Field(1.0, ge=0, description="CPUs each replica holds (fractions allowed)")
    target_ongoing_requests: float = Field(8.0, gt=0, description="requests per replica the autoscaler aims "
                                                                  "at (replicas.min < replicas.max)")
    placement: Literal["replicas", "gateway"] = Field(
        "replicas", description="replicas: a deployment of its own, reached from the gateway replicas through a "
                                "handle; gateway: inside every gateway replica's process, as in `nowait serve` "
                                "(no hop between gateway and engine; one copy per gateway replica)")

    @model_validator(mode="after")
    def _one_copy_per_gateway(self) -> FleetEngineConfig:
        # In the gateway, the engine's copies are the gateway's replicas: a count of its own cannot hold.
        if self.placement == "gateway" and self.replicas != ReplicaRange():
            raise ValueError("replicas has no effect with placement: gateway (the engine runs once in each of "
                             "fleet.gateway_replicas): leave it out, or use placement: replicas")
        return self


class OwnedEngineConfig(Strict):
    """Fields every in-process engine shares."""

    model: str = Field("ar", description="a bundled demo model (ar, draft, diffusion) or a checkpoint directory")
    node_usd_per_hour: float = Field(REFERENCE_NODE_USD_PER_HOUR, ge=0,
                                     description="what the node this engine runs on costs per hour")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # auto: the checkpoint's own
    device: str = "cpu"
    max_queue: int = Field(64, ge=0, description="requests allowed to wait beyond those running; more get 429")
    confidence_floor: float | None = Field(None, ge=0, le=1, description="an answer less sure than this is "
                                           "low-confidence: `routing.low_confidence` decides (default: "
                                           "the router's DEFAULT_CONFIDENCE_FLOOR)")
    fleet: FleetEngineConfig | None = Field(None, description="replicas and resources on a Ray Serve fleet")


class ArEngineConfig(OwnedEngineConfig):
    kind: Literal["ar"]
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    prefix_cache_tokens: int | None = Field(None, ge=0, description="prompt tokens the prefix cache keeps (default: "
                                                                  "an eighth of the rows' tokens, at least "
                                                                  "max_model_len; 0: off)")
    structured: bool = Field(True, description="build the JSON-schema grammar (response_format)")
    compile: bool = Field(False, description="run a step that feeds one token to one sequence as a compiled graph "
                                             "(torch.compile; compiled when the engine starts, seconds to a minute)")
    cuda_graphs: bool | None = Field(None, description="replay decode steps (one token to every running sequence) "
                                                       "as CUDA Graphs, one per batch and key-length bucket, captured "
                                                       "when the engine starts; null: on when the model is on a CUDA "
                                                       "device")

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
    compile: bool = Field(False, description="run a forward of one request (the dual cache's steps and refreshes) "
                                             "as a compiled graph (torch.compile; compiled when the engine starts, "
                                             "tens of seconds)")
    cuda_graphs: bool | None = Field(None, description="replay those forwards of one request as CUDA Graphs, "
                                                       "captured per span and key-length bucket on first use "
                                                       "(in place of compile); null: on when the model is on a "
                                                       "CUDA device")

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

    def diffusion_options(self) -> DiffusionOptions:
        """The engine's options: its defaults with what `options` sets instead."""
        return DiffusionOptions(**self.options)

    @classmethod
    def with_options(cls, options: DiffusionOptions, max_batch: int) -> DiffusionEngineConfig:
        """The config of an engine that runs `options` (a caller that already holds them)."""
        return cls(kind="diffusion", max_batch=max_batch, options=asdict(options))


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
    confidence_floor: float | None = Field(None, ge=0, le=1, description="an answer less sure than this is "
                                           "low-confidence: `routing.low_confidence` decides (default: "
                                           "the router's DEFAULT_CONFIDENCE_FLOOR)")

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


OwnedEngineSpec = ArEngineConfig | SpecEngineConfig | DiffusionEngineConfig  # what the factory builds
EngineSpec = Annotated[ArEngineConfig | SpecEngineConfig | DiffusionEngineConfig | RemoteEngineConfig,
                       Field(discriminator="kind")]
