"""Sharding by names: parameters carry logical axis names; one rule table maps them to mesh axes.

Mesh axes: `data` (batch), `fsdp` (batch and parameter sharding), `expert` (MoE experts), `tensor`
(reserved for head/mlp tensor parallelism). A rule whose mesh axis is missing from the mesh is dropped,
so the same table serves a one-device run and a pod.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical name -> mesh axis (or tuple of axes, or None = replicated)
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("expert", "expert"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
)


def make_mesh(data: int = 1, fsdp: int = 1, expert: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with all four named axes (size-1 axes are free)."""
    devices = list(devices if devices is not None else jax.devices())
    need = data * fsdp * expert * tensor
    if need > len(devices):
        raise ValueError(f"mesh data={data} fsdp={fsdp} expert={expert} tensor={tensor} needs {need} devices, "
                         f"only {len(devices)} available")
    grid = np.asarray(devices[:need]).reshape(data, fsdp, expert, tensor)
    return Mesh(grid, MESH_AXES)


def parse_mesh_spec(text: str) -> dict[str, int]:
    """"data=2,expert=4" -> {"data": 2, "expert": 4} (the CLI's --mesh); ValueError naming the bad part."""
    axes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1 or name in axes:
            raise ValueError(f"mesh: expected comma-separated AXIS=N (N >= 1, each axis once) with AXIS in "
                             f"{MESH_AXES}, got {part!r} in {text!r}")
        axes[name] = int(size)
    return axes


def _rules_for(mesh: Mesh, rules=LOGICAL_RULES):
    """Drop mesh axes that are absent or of size 1, and never shard a dim over an axis twice."""
    out = []
    for name, axes in rules:
        if axes is None:
            out.append((name, None))
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
        out.append((name, kept if len(kept) > 1 else (kept[0] if kept else None)))
    return tuple(out)


def logical_shardings(logical_axes, mesh: Mesh, rules=LOGICAL_RULES):
    """Tree of PartitionSpec-of-logical-names -> tree of NamedSharding on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_axes, mesh, _rules_for(mesh, rules))


def fit_shardings(shardings, shapes):
    """Replicate any dimension that its mesh axes do not divide (tiny test configs, odd vocab sizes)."""

    def fit(sh: NamedSharding, shape):
        spec = []
        for dim, axes in zip(shape.shape, tuple(sh.spec) + (None,) * (len(shape.shape) - len(sh.spec))):
            names = (axes,) if isinstance(axes, str) else (axes or ())
            size = math.prod(sh.mesh.shape[a] for a in names)
            spec.append(axes if size and dim % size == 0 else None)
        return NamedSharding(sh.mesh, PartitionSpec(*spec))

    return jax.tree.map(fit, shardings, shapes)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading axis over (data, fsdp), the rest replicated."""
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    lead = axes if len(axes) > 1 else (axes[0] if axes else None)
    return NamedSharding(mesh, PartitionSpec(lead, *([None] * (ndim - 1))))
