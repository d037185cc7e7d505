"""The autoregressive engine: continuous batching split as nano-vllm splits it (scheduler,
sequence, runner), prefix caching and sampling. Import-only: each name lives in its module."""

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig, greedy_decode, resolve_end_ids
from nowait.engines.ar.prefix_cache import PrefixCache
from nowait.engines.ar.scheduler import QueueFullError, SchedulerConfig

__all__ = [
    "AutoregressiveEngine",
    "EngineConfig",
    "PrefixCache",
    "QueueFullError",
    "SchedulerConfig",
    "greedy_decode",
    "resolve_end_ids",
]
