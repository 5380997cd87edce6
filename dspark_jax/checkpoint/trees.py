"""Param trees <-> flat {path tuple: leaf} dicts, the form the checkpoint mapping tables work in."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dspark_jax.checkpoint.safetensors_io import CheckpointError


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


def match_table(params, items, what: str) -> dict[tuple[str, ...], Any]:
    """Flatten `params` and check it against a mapping table's expanded items (each with `.path` and
    `.our_shape`): the same leaves, each with its shape; errors name the leaf. -> the flat tree."""
    flat = flatten_paths(params)
    want = {it.path: it for it in items}
    missing = sorted("/".join(p) for p in set(want) - set(flat))
    extra = sorted("/".join(p) for p in set(flat) - set(want))
    if missing or extra:
        raise CheckpointError(f"params tree does not match the {what} of this config: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for it in items:
        got = tuple(np.shape(flat[it.path]))
        if got != it.our_shape:
            raise CheckpointError(f"param '{'/'.join(it.path)}': shape {list(got)}, expected {list(it.our_shape)}")
    return flat
