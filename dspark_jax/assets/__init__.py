"""Shipped model files (the embedded default bundle, when trained and committed)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def default_bundle_path() -> Path | None:
    path = HERE / "default"
    return path if (path / "bundle.json").is_file() else None
