"""Our native checkpoint: an Orbax (tensorstore / OCDBT) checkpoint of a parameter pytree.

`save_params(path, params)` writes any pytree of numpy / jax arrays (optionally with a config, kept in
the checkpoint's custom metadata). `restore_params(path, target)` reads it back:
  * `target=None`: host numpy arrays, shapes and dtypes as saved;
  * a pytree of `jax.ShapeDtypeStruct` (with `.sharding`): each leaf is read straight into that
    sharding (each device reads only its shard), cast to the given dtype;
  * a pytree of `jax.sharding.Sharding`: as above with the saved shapes and dtypes.
The target's tree must match the saved one leaf for leaf; a mismatch is an error naming the leaf.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspark_jax import drafts
from dspark_jax.checkpoint.safetensors_io import CheckpointError

CONFIG_KEY = "dspark_config"


def _ocp():
    import orbax.checkpoint as ocp  # noqa: PLC0415  (slow import; only when used)

    return ocp


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "_CHECKPOINT_METADATA").exists() or (p / "_METADATA").exists())


def save_params(path: str | os.PathLike, params: Any, *, config=None, overwrite: bool = False,
                concurrent_gb: int | None = None) -> Path:
    """Write `params` (a pytree of arrays) to the new directory `path`; blocks until committed.

    `concurrent_gb` bounds the bytes Orbax stages at once (host copies of jax arrays); None keeps
    Orbax's default (96). Host numpy leaves are staged whole, so a converter holding a large tree
    should pass jax arrays (see `to_device_leafwise`) together with a small `concurrent_gb`.
    """
    ocp = _ocp()
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists (pass overwrite=True to replace it)")
    custom = {CONFIG_KEY: config.to_dict()} if config is not None else None
    handler = (ocp.StandardCheckpointHandler() if concurrent_gb is None
               else ocp.StandardCheckpointHandler(save_concurrent_gb=int(concurrent_gb)))
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path, args=ocp.args.StandardSave(params), force=overwrite, custom_metadata=custom)
    return path


def to_device_leafwise(tree: dict) -> dict:
    """Replace the numpy leaves of a nested dict by jax arrays IN PLACE, one leaf at a time, so the
    tree is never held twice. Returns the same dict."""
    for k, v in tree.items():
        if isinstance(v, dict):
            to_device_leafwise(v)
        elif isinstance(v, np.ndarray):
            tree[k] = jax.device_put(v)
            del v
    return tree


def _flat(tree, is_leaf=None) -> dict[tuple, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in kp): v
            for kp, v in leaves}


def checkpoint_metadata(path: str | os.PathLike):
    """(tree of ArrayMetadata with .shape / .dtype, custom metadata dict)."""
    ocp = _ocp()
    path = Path(path).absolute()
    if not is_orbax_checkpoint(path):
        raise CheckpointError(f"{path}: not an Orbax checkpoint (no _CHECKPOINT_METADATA / _METADATA)")
    items = [] if (path / "_METADATA").exists() else sorted(
        p.name for p in path.iterdir() if p.is_dir() and (p / "_METADATA").exists())
    if items:  # a CheckpointManager step: Orbax's metadata() only warns, and restore() fails with a long
        # traceback about the missing _METADATA
        raise CheckpointError(f"{path}: an Orbax CheckpointManager step holding the item folder(s) {items}, not "
                              "one tree; pass the item folder")
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return tree, dict(getattr(meta, "custom_metadata", None) or {})


def saved_config(path: str | os.PathLike):
    """The DSparkConfig stored by `save_params(..., config=cfg)`, or None."""
    _, custom = checkpoint_metadata(path)
    raw = custom.get(CONFIG_KEY)
    return drafts.config_from_dict(raw) if raw else None


def restore_params(path: str | os.PathLike, target: Any = None) -> Any:
    ocp = _ocp()
    path = Path(path).absolute()
    meta_tree, _ = checkpoint_metadata(path)
    saved = _flat(meta_tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    if target is None:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path)

    is_target_leaf = lambda x: isinstance(x, (jax.ShapeDtypeStruct, jax.sharding.Sharding))  # noqa: E731
    want = _flat(target, is_leaf=is_target_leaf)
    missing = sorted(set(saved) - set(want))
    extra = sorted(set(want) - set(saved))
    if missing or extra:
        raise CheckpointError(f"{path}: restore target does not match the checkpoint tree: leaves not in the "
                              f"target {['/'.join(p) for p in missing[:5]]}, target leaves not in the checkpoint "
                              f"{['/'.join(p) for p in extra[:5]]}")

    def to_abstract(kp, leaf):
        key = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in kp)
        m = saved[key]
        if isinstance(leaf, jax.sharding.Sharding):
            return jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype), sharding=leaf)
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise CheckpointError(f"restore target leaf '{'/'.join(key)}' is {type(leaf).__name__}; expected a "
                                  "jax.ShapeDtypeStruct or a jax.sharding.Sharding")
        if tuple(leaf.shape) != tuple(m.shape):
            raise CheckpointError(f"{path}: leaf '{'/'.join(key)}' has shape {list(m.shape)} in the checkpoint, "
                                  f"the target asks for {list(leaf.shape)}")
        return leaf

    abstract = jax.tree_util.tree_map_with_path(to_abstract, target, is_leaf=is_target_leaf)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract)
