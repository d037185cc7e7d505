"""The one engine factory: an engine config (engines/config.py, the models of the gateway YAML's
`engines.<name>`) to a ready engine, with the model and codec it runs.

    build_engine(config, models)   the checkpoints the config names, loaded through `models`
                                   (a ModelCache, so engines sharing a checkpoint share its weights)
    engine_from(config, target)    models already in memory (a bench's, a test's)

`nowait serve` (gateway/engines.py), `generate`, `eval`, `extract`, `calibrate` and every bench
build their engines here, so an engine measured by a bench is the engine the gateway serves, and a
fleet replica builds the same from the same config. Only owned engines are built: a `remote` one
is an upstream reached over HTTP (gateway/remote.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nowait import paths
from nowait.checkpoints import CheckpointError, LoadedModel, load_pretrained
from nowait.engines.ar import AutoregressiveEngine, EngineConfig
from nowait.engines.config import (
    ArEngineConfig,
    DiffusionEngineConfig,
    OwnedEngineSpec,
    RemoteEngineConfig,
    SpecEngineConfig,
)
from nowait.engines.diffusion import DiffusionEngine
from nowait.engines.diffusion.gemma_engine import DiffusionGemmaEngine
from nowait.engines.diffusion.gemma_sampler import GemmaSampling
from nowait.engines.speculative import SpeculativeEngine, build_drafter
from nowait.model.diffusion_gemma import DiffusionGemma

if TYPE_CHECKING:
    from nowait.conventions import ModelConventions
    from nowait.engines.structured.grammar import GrammarCompiler
    from nowait.model import Transformer
    from nowait.tokenizer import TextCodec

OwnedEngine = AutoregressiveEngine | SpeculativeEngine | DiffusionEngine | DiffusionGemmaEngine


class EngineConfigError(ValueError):
    """A config the factory cannot turn into an engine: a remote upstream, or a model of the
    other kind than the engine's (a diffusion model for `ar`)."""


@dataclass(frozen=True)
class EngineModel:
    """A model as an engine needs it: weights, tokenizer, and the ids that end an answer (None:
    the demo tokenizer's end token)."""

    model: Transformer
    codec: TextCodec
    end_ids: tuple[int, ...] | None = None
    generation: dict = field(default_factory=dict)  # generation_config.json (DiffusionGemma's sampler reads it)

    @classmethod
    def of(cls, loaded: LoadedModel) -> EngineModel:
        return cls(loaded.model, loaded.codec, loaded.conventions.end_ids, loaded.generation)


@dataclass(frozen=True)
class BuiltEngine:
    """A ready engine and the checkpoints it runs (`draft`: the spec engine's draft or drafter)."""

    engine: OwnedEngine
    target: LoadedModel
    draft: LoadedModel | None = None

    @property
    def codec(self) -> TextCodec:
        return self.target.codec

    @property
    def model(self) -> Transformer:
        return self.target.model

    @property
    def conventions(self) -> ModelConventions:
        return self.target.conventions

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens one request may hold."""
        if isinstance(self.engine, AutoregressiveEngine):
            return self.engine.max_model_len
        return self.target.model.config.max_position


class ModelCache:
    """Checkpoints loaded once per (path, dtype, device): `ar` and `spec` share the target's weights."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str, str], LoadedModel] = {}

    def load(self, model: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
        """A bundled demo model by name, or a checkpoint directory."""
        path = paths.model_dir(model)
        key = (str(Path(path).resolve()), dtype, device)
        if key not in self._loaded:
            try:
                self._loaded[key] = load_pretrained(path, dtype=dtype, device=device)
            except CheckpointError as error:
                hint = f" (train it with `nowait train {model}`)" if model in paths.DEMO_MODELS else ""
                raise CheckpointError(f"{error}{hint}") from None
        return self._loaded[key]

    def loaded(self) -> list[LoadedModel]:
        """Every checkpoint loaded so far, in loading order."""
        return list(self._loaded.values())


def build_engine(config: OwnedEngineSpec | RemoteEngineConfig, models: ModelCache | None = None,
                 name: str | None = None) -> BuiltEngine:
    """The engine `config` describes, on the checkpoints it names (`model`, and a spec engine's
    `draft` when its method uses one). Raises CheckpointError (a missing or broken checkpoint, the
    draft's named as such), IncompatibleDraftError (a draft that cannot serve the target) or
    EngineConfigError."""
    _refuse_remote(config)
    models = models or ModelCache()
    target = models.load(config.model, config.dtype, config.device)
    draft = None
    if isinstance(config, SpecEngineConfig):
        settings = config.speculative_config()
        if settings.uses_draft or settings.uses_drafter:
            try:
                draft = models.load(config.draft_model, config.dtype, config.device)
            except CheckpointError as error:
                raise CheckpointError(f"draft model: {error}") from None
    engine = engine_from(config, EngineModel.of(target), EngineModel.of(draft) if draft else None, name,
                         where=str(target.path))
    return BuiltEngine(engine, target, draft)


def engine_from(config: OwnedEngineSpec, target: EngineModel, draft: EngineModel | None = None,
                name: str | None = None, where: str = "the model") -> OwnedEngine:
    """The engine `config` describes, on models already in memory; `config.model` and
    `config.draft` are not read. `name` (default: the engine's own) is what its completions say
    produced them; `where` names the model in errors."""
    _refuse_remote(config)
    _check_kind(config, target.model, where)
    engine = _engine(config, target, draft)
    if name:
        engine.name = name
    return engine


def _engine(config: OwnedEngineSpec, target: EngineModel, draft: EngineModel | None) -> OwnedEngine:
    if isinstance(config, DiffusionEngineConfig) and isinstance(target.model, DiffusionGemma):
        return DiffusionGemmaEngine(target.model, target.codec, GemmaSampling.from_generation_config(target.generation),
                                    end_ids=target.end_ids or ())
    if isinstance(config, DiffusionEngineConfig):
        return DiffusionEngine(target.model, target.codec, config.diffusion_options(), max_batch=config.max_batch,
                               end_ids=target.end_ids, compile=config.compile, cuda_graphs=config.cuda_graphs)
    engine_config = EngineConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                                 max_model_len=config.max_model_len, prefix_cache_tokens=config.prefix_cache_tokens,
                                 compile_decode=config.compile, cuda_graphs=config.cuda_graphs)
    grammar = _grammar(target) if config.structured else None
    if isinstance(config, SpecEngineConfig):
        return _speculative(config, target, draft, engine_config, grammar)
    return AutoregressiveEngine(target.model, target.codec, engine_config, grammar=grammar, end_ids=target.end_ids)


def _refuse_remote(config: OwnedEngineSpec | RemoteEngineConfig) -> None:
    if isinstance(config, RemoteEngineConfig):
        raise EngineConfigError(f"engine kind 'remote' ({config.base_url}) is an upstream the gateway reaches over "
                                "HTTP; the factory builds the owned kinds: ar, spec, diffusion")


def _check_kind(config: OwnedEngineSpec, model: Transformer, where: str) -> None:
    wants_causal = isinstance(config, ArEngineConfig)  # ar and spec
    if model.config.causal != wants_causal:
        has = "causal (AR)" if model.config.causal else "bidirectional (diffusion)"
        needs = "a causal (AR)" if wants_causal else "a bidirectional (diffusion)"
        raise EngineConfigError(f"engine kind {config.kind!r} needs {needs} model; {where} is {has}")


def _grammar(target: EngineModel) -> GrammarCompiler:
    from nowait.engines.structured.grammar import GrammarCompiler  # llguidance only when structured output is on

    return GrammarCompiler.from_codec(target.codec, vocab_size=target.model.config.vocab_size,
                                      end_id=target.end_ids[0] if target.end_ids else None)


def _speculative(config: SpecEngineConfig, target: EngineModel, draft: EngineModel | None,
                 engine_config: EngineConfig, grammar: GrammarCompiler | None) -> SpeculativeEngine:
    """The target with its draft (methods hybrid and draft) or diffusion drafter (method
    diffusion). The draft's tokenizer goes in too, so a draft trained with another tokenizer of
    the same size is refused (IncompatibleDraftError) instead of proposing tokens that mean
    something else to the target: every proposal would be rejected and the engine would run
    slower than plain AR. A method that needs a draft and gets none is refused the same way."""
    settings = config.speculative_config()
    common = {"grammar": grammar, "speculative": settings, "end_ids": target.end_ids}
    if settings.uses_drafter:
        drafter = (build_drafter(draft.model, draft.codec, config.max_num_seqs, draft.end_ids)
                   if draft is not None else None)
        return SpeculativeEngine(target.model, target.codec, engine_config, drafter=drafter, **common)
    return SpeculativeEngine(target.model, target.codec, engine_config, draft=draft.model if draft else None,
                             draft_codec=draft.codec if draft else None, **common)
