"""Where the bundled assets live (package data) and how models are named."""

from __future__ import annotations

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
