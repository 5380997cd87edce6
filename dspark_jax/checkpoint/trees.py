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


def _shown(key) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


def _shape_of(x) -> tuple[int, ...]:
    return tuple(int(d) for d in (x.shape if hasattr(x, "shape") else x))


def _dtype_of(x) -> str:
    d = x.dtype
    return d if isinstance(d, str) else np.dtype(d).name


def _listed(keys: list[str]) -> str:
    more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
    return f"[{', '.join(repr(k) for k in keys[:5])}]{more}"


def check_tree(got: Mapping[Any, Any], want: Mapping[Any, Any], what: str, *, noun: str = "tensor",
               dtypes: bool = False) -> None:
    """The one strict tree check: `got` holds exactly the leaves of `want`, each with its shape (and, with
    `dtypes`, its dtype).

    Both are flat: keys are names ("a.b.c") or path tuples (shown joined by "/"); values are anything with
    a `.shape` (arrays, `jax.ShapeDtypeStruct`, `TensorInfo`, packed blocks) or a plain shape. Dtypes are
    compared by name (numpy / JAX dtypes, or safetensors names when both sides use them). A mismatch raises
    `CheckpointError` starting with `what` (the file or tree checked) that lists the missing and unexpected
    leaves (sorted, the first five of each), or names the first mis-shaped / mis-typed leaf in `want`'s
    order with what it has and what was expected.
    """
    missing = sorted(_shown(k) for k in want if k not in got)
    extra = sorted(_shown(k) for k in got if k not in want)
    if missing or extra:
        parts = ([f"missing {_listed(missing)}"] if missing else []) + (
            [f"unexpected {_listed(extra)}"] if extra else [])
        raise CheckpointError(f"{what}: {noun}s do not match: {', '.join(parts)}")
    for k, spec in want.items():
        g, w = _shape_of(got[k]), _shape_of(spec)
        if g != w:
            raise CheckpointError(f"{what}: {noun} '{_shown(k)}' has shape {list(g)}, expected {list(w)}")
        if dtypes and _dtype_of(got[k]) != _dtype_of(spec):
            raise CheckpointError(f"{what}: {noun} '{_shown(k)}' has dtype {_dtype_of(got[k])}, "
                                  f"expected {_dtype_of(spec)}")


def match_table(params, items, what: str) -> dict[tuple[str, ...], Any]:
    """Flatten `params` and check it against a mapping table's expanded items (each with `.path` and
    `.our_shape`): the same leaves, each with its shape (`check_tree`). -> the flat tree."""
    flat = flatten_paths(params)
    check_tree(flat, {it.path: it.our_shape for it in items}, f"{what} params tree (vs this config's table)",
               noun="param")
    return flat
