"""The draft-family registry: `family` name -> the `DraftFamily` object implementing it.

Everything that needs a family (the speculative round, the engine, the trainer, bundles, the converter)
asks here; nothing outside `drafts/` tests which family a config belongs to.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from dspark_jax.validation import ConfigError, read_json_config

# family name -> module whose `DRAFT_FAMILY` implements it. The first entry is the default: a config dict no
# other family claims is read as a V4.1 config (its three spellings carry no family marker).
_FAMILY_MODULES = {
    "deepseek_v41": "dspark_jax.drafts.v41",
    "qwen3": "dspark_jax.drafts.deepspec",
}
DEFAULT_FAMILY = "deepseek_v41"
FAMILY_NAMES = tuple(_FAMILY_MODULES)


def family_named(name: str):
    """The family object registered under `name`; an unknown name is a ConfigError listing the known."""
    if name not in _FAMILY_MODULES:
        raise ConfigError(f"config field 'family': expected one of {list(FAMILY_NAMES)}, got {name!r}")
    return importlib.import_module(_FAMILY_MODULES[name]).DRAFT_FAMILY


def family_of(cfg):
    """The family of a draft config object (every family's config has a `family` field)."""
    return family_named(cfg.family)


def claiming_family(raw: Any):
    """The family that recognises `raw` (a config dict) as its own, or None."""
    if not isinstance(raw, dict):
        return None
    for name in FAMILY_NAMES:
        fam = family_named(name)
        if fam.claims(raw):
            return fam
    return None


def config_from_dict(raw: Any, **overrides):
    """A draft config of any family from a dict; `overrides` set fields (e.g. dtypes)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a JSON object, got {type(raw).__name__}")
    if "family" in raw:
        family_named(raw["family"])  # an unknown family is named as such, not read as a V4.1 config
    fam = claiming_family(raw) or family_named(DEFAULT_FAMILY)
    return fam.config_from_dict(raw, **overrides)


def load_config(path: str | Path, **overrides):
    """A draft config of any family from a JSON file (a folder means its config.json)."""
    return read_json_config(path, lambda raw: config_from_dict(raw, **overrides))
