"""The gateway's engines from its config: each owned one built by the engine factory
(engines/factory.py) and put behind a worker thread, each remote one an HTTP client; one that
cannot serve is kept as unavailable, with a warning, so the server starts without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nowait import paths
from nowait.checkpoints import CheckpointError
from nowait.engines.config import DiffusionEngineConfig, OwnedEngineSpec, RemoteEngineConfig, SpecEngineConfig
from nowait.engines.factory import ModelCache, build_engine
from nowait.engines.speculative import IncompatibleDraftError
from nowait.gateway.config import GatewayConfig
from nowait.gateway.domain import Backend
from nowait.gateway.engine_stats import EngineStats
from nowait.gateway.owned import OwnedBackend, UnavailableBackend
from nowait.gateway.remote import RemoteBackend
from nowait.gateway.workers import ArWorker, DiffusionWorker, EngineWorker

log = logging.getLogger("nowait.gateway")


def build_backends(config: GatewayConfig,
                   owned: Callable[[str, OwnedEngineSpec], Backend] | None = None) -> dict[str, Backend]:
    """Every configured engine; one that cannot serve is kept as unavailable, with a warning.
    `owned`: what an owned engine becomes instead of an in-process worker (a fleet gateway's
    handle to the engine's replicas); remote upstreams are always reached from here."""
    cache = ModelCache()
    backends: dict[str, Backend] = {}
    for name, spec in config.engines.items():
        if isinstance(spec, RemoteEngineConfig):
            # The fast engine's answers need a confidence: its upstream is asked for token logprobs.
            remote = RemoteBackend(name, spec, config.metrics_window_s, confidence=name == config.routing.fast_engine)
            if not remote.available:
                log.warning("engine %r is not available: %s", name, remote.unavailable_reason)
                backends[name] = UnavailableBackend(name, "remote", remote.unavailable_reason,
                                                    config.metrics_window_s, owned=spec.on_premises)
            else:
                backends[name] = remote
        elif owned is not None:
            backends[name] = owned(name, spec)
        else:
            backends[name] = build_owned(name, spec, cache, config.metrics_window_s, config.defaults.max_tokens)
    return backends


def build_owned(name: str, spec: OwnedEngineSpec, cache: ModelCache, window_s: float,
                default_max_tokens: int) -> OwnedBackend | UnavailableBackend:
    """Load one owned engine; a missing or unsuitable model gives an UnavailableBackend and a warning."""
    try:
        built = build_engine(spec, cache, name)
    except IncompatibleDraftError as error:
        return _unavailable(name, spec, _draft_refusal(spec, error), window_s)
    except (CheckpointError, ValueError) as error:
        return _unavailable(name, spec, str(error), window_s)
    stats = EngineStats(window_s, spec.node_usd_per_hour)
    if built.engine.kind == "diffusion":  # DiffusionEngine, DiffusionGemmaEngine
        worker: EngineWorker = DiffusionWorker(name, built.engine, built.codec, stats)
    else:
        worker = ArWorker(name, built.engine, built.codec, stats)
    capacity = spec.max_batch if isinstance(spec, DiffusionEngineConfig) else spec.max_num_seqs
    return OwnedBackend(name, spec.kind, worker, built.codec, built.max_model_len, capacity, spec.max_queue,
                        spec.node_usd_per_hour, default_max_tokens, conventions=built.conventions)


def _unavailable(name: str, spec: OwnedEngineSpec, reason: str, window_s: float) -> UnavailableBackend:
    log.warning("engine %r is not available: %s", name, reason)
    return UnavailableBackend(name, spec.kind, reason, window_s)


def _draft_refusal(spec: OwnedEngineSpec, error: IncompatibleDraftError) -> str:
    """Why a spec engine's draft cannot serve, and what to do, in the config's words."""
    draft = spec.draft_model if isinstance(spec, SpecEngineConfig) else "?"
    hint = f" (`nowait train {draft}`)" if draft in paths.DEMO_MODELS else ""
    return (f"draft {draft!r} cannot serve model {spec.model!r}: {error}. Use a draft trained with the "
            f"target's tokenizer{hint}, or method: ngram (no draft)")
