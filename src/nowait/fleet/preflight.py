"""What `nowait fleet up` checks before a Ray process starts: every owned engine's checkpoints
(its model, and a spec engine's draft) are directories with a config.json nowait can read, a
tokenizer and the weight files it names. A wrong path then fails in one line, in a second,
instead of as a replica that Ray starts, sees fail and restarts until `serve.run` gives up.

The weights are not read (an 8B checkpoint takes minutes, and each replica reads its own): a
file present but corrupt is still the replica's error.
"""

from __future__ import annotations

from pathlib import Path

from nowait import paths
from nowait.architectures import architecture_for, read_model_config
from nowait.checkpoint_files import CheckpointError, read_json, weight_files
from nowait.engines.config import RemoteEngineConfig, SpecEngineConfig
from nowait.gateway.config import GatewayConfig
from nowait.gemma_checkpoint import ARCHITECTURE as GEMMA_ARCHITECTURE


def check_checkpoint(model: str) -> None:
    """Raises CheckpointError naming what is missing from the checkpoint `model` (a path, or a
    bundled demo model's name)."""
    directory = paths.model_dir(model)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    hf = read_json(directory / "config.json")
    if (hf.get("architectures") or [None])[0] != GEMMA_ARCHITECTURE:  # its own reader checks it on load
        try:
            read_model_config(architecture_for(hf), hf)
        except CheckpointError as error:
            raise CheckpointError(f"{directory}: {error}") from None
    if not any((directory / name).is_file() for name in ("tokenizer.json", "vocab.json")):
        raise CheckpointError(f"{directory}: no tokenizer (tokenizer.json, or vocab.json and merges.txt)")
    weight_files(Path(directory))


def checkpoint_problems(config: GatewayConfig) -> list[str]:
    """One line per checkpoint of an owned engine that cannot serve (none: all can)."""
    problems = []
    for name, spec in config.engines.items():
        if isinstance(spec, RemoteEngineConfig):
            continue
        models = [("model", spec.model)]
        if isinstance(spec, SpecEngineConfig):
            settings = spec.speculative_config()
            if settings.uses_draft or settings.uses_drafter:
                models.append(("draft", spec.draft_model))
        for role, model in models:
            try:
                check_checkpoint(model)
            except CheckpointError as error:
                problems.append(f"engine {name!r} {role}: {error}")
    return problems
