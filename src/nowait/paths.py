"""Where the bundled assets live (package data), how models are named, and how a file is
replaced whole."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEMO_MODELS = ("ar", "draft", "diffusion")


def tokenizer_path() -> Path:
    return ASSETS / "tokenizer.json"


def model_dir(name: str) -> Path:
    """The bundled demo model `name` (ar, draft, diffusion), or `name` itself if it is a path."""
    return ASSETS / name if name in DEMO_MODELS else Path(name)


def sample_document() -> Path:
    """A KYC form bundled for `nowait extract` with no file (from the test split's stream)."""
    return ASSETS / "samples" / "kyc_form.txt"


def write_replacing(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)` to a file beside `path`, then one rename over it: a process killed while
    it writes leaves the old file whole (a checkpoint written in place was left truncated)."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)
