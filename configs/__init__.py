"""The model and run configs shipped with the package (this folder installs as `dspark_jax.configs`).

Everything that reads a config at run time goes through here, so it works in a wheel install as well as
from the source tree:

    from dspark_jax import configs
    configs.path("tiny_v41.json")      # -> Path of the shipped file (FileNotFoundError names what exists)
    configs.CONFIGS / "tiny_v41.json"  # the same folder as a Path
    configs.names()                    # ["deepseek_v41_flash.json", ...]
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# A regular package on disk (wheel and editable installs alike), so the Traversable is a real folder.
CONFIGS = Path(str(files(__name__)))
_SUFFIXES = (".json", ".yaml")


def names() -> list[str]:
    """The shipped config files, sorted."""
    return sorted(p.name for p in CONFIGS.iterdir() if p.suffix in _SUFFIXES)


def path(name: str) -> Path:
    """The shipped config `name` (e.g. "tiny_v41.json")."""
    p = CONFIGS / name
    if p.suffix not in _SUFFIXES or not p.is_file():
        raise FileNotFoundError(f"no shipped config {name!r} in {CONFIGS}; there are: {', '.join(names())}")
    return p
