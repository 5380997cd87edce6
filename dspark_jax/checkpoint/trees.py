"""Param trees <-> flat {path tuple: leaf} dicts, the form the checkpoint mapping tables work in."""

from __future__ import annotations

from typing import Any, Mapping


def flatten_paths(tree, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Nested mappings -> {("a", "b", "c"): leaf}."""
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            out.update(flatten_paths(v, prefix + (str(k),)))
        return out
    return {prefix: tree}


def unflatten_paths(flat: Mapping[tuple[str, ...], Any]) -> dict:
    """The inverse of `flatten_paths`."""
    root: dict = {}
    for path, v in flat.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return root
