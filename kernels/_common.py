"""Helpers shared by the Pallas kernels: implementation dispatch and Mosaic-TPU alignment.

Dispatch (`impl`), the same for every kernel in this package:
  "xla"    the pure-jnp reference (`x_reference`), on any backend.
  "pallas" the Pallas kernel: compiled through Mosaic on TPU; on every other backend it runs in Pallas
           interpret mode (slow; for tests and for checking that the kernel agrees with the reference).
  "auto"   the compiled Pallas kernel on TPU when the shapes are supported, the reference elsewhere.
The kernels are written for Mosaic TPU (scalar prefetch into SMEM, TPU compiler params, blocks that are
not powers of two); they do not lower through Pallas' Triton (GPU) backend, so "auto" on GPU is the
reference, which XLA fuses well there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "xla")

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


def resolve_impl(impl: str, *, name: str, supported: bool, why_unsupported: str = "") -> tuple[str, bool]:
    """-> ("xla", False) or ("pallas", interpret). Raises ValueError for an unknown impl, or for
    impl="pallas" with shapes the kernel does not support (auto falls back to the reference then)."""
    if impl not in IMPLS:
        raise ValueError(f"{name}: 'impl' must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla", False
    on_tpu = jax.default_backend() == "tpu"
    if impl == "auto":
        return ("pallas", False) if (on_tpu and supported) else ("xla", False)
    if not supported:
        raise ValueError(f"{name}: impl='pallas' does not support these shapes ({why_unsupported}); "
                         "use impl='auto' or 'xla'")
    return "pallas", not on_tpu
