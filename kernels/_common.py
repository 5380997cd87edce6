"""Helpers shared by the Pallas kernels: implementation dispatch and Mosaic-TPU alignment.

Dispatch (`impl`), the same for every kernel in this package:
  "xla"    the pure-jnp reference (`x_reference`), on any backend.
  "pallas" the Pallas kernel: compiled through Mosaic on TPU; on every other platform it runs in Pallas
           interpret mode (slow; for tests and for checking that the kernel agrees with the reference).
  "auto"   the compiled Pallas kernel on TPU when the shapes are supported, the reference elsewhere.
The kernels are written for Mosaic TPU (scalar prefetch into SMEM, TPU compiler params, blocks that are
not powers of two); they do not lower through Pallas' Triton (GPU) backend, so "auto" on GPU is the
reference, which XLA fuses well there.

The platform is the one the program is LOWERED for. Tracing cannot see it (`jax.export(...,
platforms=["tpu"])` from a CPU host traces on the CPU host), so it is part of the impl string:
`"pallas@tpu"` / `"auto@tpu"` (built by `for_platform`) dispatch for TPU wherever they are traced. A bare
impl means the host's default backend, where a jitted call runs. Being part of the (static) impl, the
platform is part of every jit cache key, so a program traced for TPU is never reused for a CPU call.

Meshes. Mosaic kernels cannot be partitioned automatically, so under a mesh (the context mesh of
`jax.set_mesh` / `jax.sharding.use_abstract_mesh`, which the engine sets) every kernel call runs inside
`jax.shard_map` (`shard_kernel`): each device runs the kernel on its own rows of the batch (mesh axes
`data`, `fsdp`) and, where the kernel says so, its own heads (`tensor`); everything else is replicated.
The reference path is left to XLA's partitioner.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

IMPLS = ("auto", "pallas", "xla")
PLATFORMS = ("tpu", "cpu", "gpu", "cuda", "rocm")
BATCH_MESH_AXES = ("data", "fsdp")  # the mesh axes a kernel's batch rows are split over (parallel.py)
HEAD_MESH_AXIS = "tensor"

# Mosaic TPU: the last two block dims must be multiples of (sublanes, 128) or equal the array's dims.
LANES = 128

# What the kernels plan to keep resident in VMEM per grid step (estimated, double-buffered blocks and
# the f32 temporaries), and the scoped-VMEM limit requested from Mosaic. 20 MiB of estimated use fits
# every TPU generation's VMEM with room for Mosaic's own internal scratch.
VMEM_BUDGET_BYTES = 20 * 2**20
VMEM_LIMIT_BYTES = 32 * 2**20


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sublanes(dtype) -> int:
    """Rows per native (sublane x lane) tile: 8 for 32-bit types, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def for_platform(impl: str, platform: str) -> str:
    """The impl that dispatches for `platform` wherever it is traced: for_platform("pallas", "tpu")."""
    kind, _ = parse_impl(impl)
    return f"{kind}@{_check_platform(platform, impl)}"


def parse_impl(impl: str) -> tuple[str, str | None]:
    """"pallas@tpu" -> ("pallas", "tpu"); "auto" -> ("auto", None). Raises ValueError naming the value."""
    kind, _, platform = impl.partition("@") if isinstance(impl, str) else (impl, "", "")
    if kind not in IMPLS:
        raise ValueError(f"'impl' must be one of {IMPLS}, optionally '@<platform>', got {impl!r}")
    return kind, (_check_platform(platform, impl) if platform else None)


def _check_platform(platform: str, impl) -> str:
    if platform not in PLATFORMS:
        raise ValueError(f"impl {impl!r}: unknown platform {platform!r}, expected one of {PLATFORMS}")
    return platform


def resolve_impl(impl: str, *, name: str, supported: bool, why_unsupported: str = "") -> tuple[str, bool]:
    """-> ("xla", False) or ("pallas", interpret). Raises ValueError for an unknown impl, or for
    impl="pallas" with shapes the kernel does not support (auto falls back to the reference then)."""
    try:
        kind, platform = parse_impl(impl)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if kind == "xla":
        return "xla", False
    on_tpu = (platform or jax.default_backend()) == "tpu"
    if kind == "auto":
        return ("pallas", False) if (on_tpu and supported) else ("xla", False)
    if not supported:
        raise ValueError(f"{name}: impl='pallas' does not support these shapes ({why_unsupported}); "
                         "use impl='auto' or 'xla'")
    return "pallas", not on_tpu


def _divisible_axes(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    """The longest prefix of `axes` (those in `mesh` with more than one device) whose product divides
    `size`: a batch of 4 on data=2 x fsdp=4 splits over `data` only."""
    kept = [a for a in axes if mesh.shape.get(a, 1) > 1]
    while kept and size % math.prod(mesh.shape[a] for a in kept):
        kept.pop()
    return tuple(kept)


def shard_kernel(kernel: Callable, args: tuple, arg_dims: tuple[str, ...], out_dims, *, batch: int,
                 heads: int | None = None):
    """Run `kernel(*args)` under the context mesh, each device on its own rows (see the module doc).

    `arg_dims[i]` / `out_dims` (a tree matching the output) spell each array's dims, one character per
    dim: "b" the batch, "h" the heads, "." neither; "" = replicated (b.h. = [B, K, H, hd] with batch and
    heads split). Without a mesh, or on a one-device mesh, the kernel is called as it is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(*args)
    names = {"b": _divisible_axes(mesh, BATCH_MESH_AXES, batch) or None, ".": None,
             "h": (_divisible_axes(mesh, (HEAD_MESH_AXIS,), heads) or None) if heads else None}

    def spec(dims: str) -> PartitionSpec:
        return PartitionSpec(*(names[d] for d in dims))

    return jax.shard_map(kernel, mesh=mesh, in_specs=tuple(spec(d) for d in arg_dims),
                         out_specs=jax.tree.map(spec, out_dims), check_vma=False)(*args)
