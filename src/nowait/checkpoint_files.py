"""The files of a Hugging Face checkpoint directory, read defensively.

JSON files (config.json, tokenizer_config.json, generation_config.json) and the weights: one
model.safetensors, or shards listed by model.safetensors.index.json. Every failure becomes a
`CheckpointError` that names the file and what is wrong with it, so a user with a half-copied
8B checkpoint reads "model-00003-of-00004.safetensors: corrupted or truncated", not a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says which file and why."""


def read_json(path: Path, required: bool = True) -> dict:
    """The JSON object in `path`; {} for a missing optional file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if not required:
            return {}
        raise CheckpointError(f"{path.parent}: missing {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards of the index, or the single file."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        shards = [directory / name for name in dict.fromkeys(weight_map.values())]
        absent = [path.name for path in shards if not path.is_file()]
        if absent:
            raise CheckpointError(f"{directory}: the index lists shards that are missing: {absent[:5]}")
        return shards
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise CheckpointError(f"{directory}: missing {SINGLE_FILE} (or {INDEX_FILE} and its shards)")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: missing {path.name}") from None
    except (SafetensorError, OSError, ValueError) as error:
        # safetensors checks the header and that the data covers every tensor it declares, so a
        # truncated download fails here, before any tensor is read.
        raise CheckpointError(f"{path}: corrupted or truncated safetensors file ({error})") from None


def tensor_names(files: list[Path]) -> dict[str, Path]:
    """Each tensor's name and the file holding it (reads headers only); a name in two files is an error."""
    where: dict[str, Path] = {}
    for path in files:
        with _open(path) as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name in where:
                    raise CheckpointError(f"{path}: tensor {name!r} is also in {where[name].name}")
                where[name] = path
    return where


def iter_tensors(files: list[Path], wanted: Container[str],
                 convert: Callable[[str, torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, convert(name, tensor)) for every wanted tensor, one file and one tensor at a time.

    Each tensor is read from disk and converted (dtype, device) before the next is read, so
    loading never holds a second full copy of the weights; at most one tensor in its file dtype.
    """
    for path in files:
        with _open(path) as handle:
            for name in handle.keys():  # noqa: SIM118
                if name not in wanted:
                    continue
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as error:
                    raise CheckpointError(f"{path}: cannot read tensor {name!r} ({error})") from None
                yield name, convert(name, tensor)
