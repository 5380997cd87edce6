"""The f32 LM head over a head stored in bf16, without an f32 copy of the whole head.

The official forward holds the tied head in f32 (SPEC 3); bf16 -> f32 is exact, so keeping the stored
bf16 head and widening it where it is read is the same math. Written as `x @ head.astype(f32).T`, XLA
materialises the widened head: at V4.1-Flash size an f32 temporary of 2.65 GB in every call, twice the
weight itself. `f32_head_logits` widens one tile of vocabulary rows at a time instead (a loop over
row tiles), so the temporary is one tile; each logit is still one f32 dot product over the model dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.nn.rows import slice_rows

HEAD_TILE_ROWS = 8192  # vocabulary rows widened at once: 8192 x 5120 x 4 B = 160 MiB at V4.1-Flash size


def f32_head_logits(x: jax.Array, head: jax.Array, tile_rows: int = HEAD_TILE_ROWS) -> jax.Array:
    """x [.., D] (widened to f32) @ head [V, D]^T -> f32 [.., V], at Precision.HIGHEST."""
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    x = x.astype(f32)
    if head.shape[0] <= tile_rows:
        return jnp.einsum("...d,vd->...v", x, head.astype(f32), precision=hi)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])

    v, d = head.shape
    n_tiles = -(-v // tile_rows)

    def tile(i, out):  # out f32 [N, V]
        # The last tile starts at V - tile_rows (overlapping the one before: the same rows get the same
        # values), so no padded copy of the head is ever made. The tile is read through `nn.rows`: a bf16
        # dynamic slice is an f32 copy of the whole head on XLA:CPU (hoisted out of the loop, barrier or
        # not). The barrier keeps XLA from moving the widening before the slice.
        start = jnp.minimum(i * tile_rows, v - tile_rows)
        rows = jax.lax.optimization_barrier(slice_rows(head, start, tile_rows))
        logits = jnp.einsum("nd,td->nt", flat, rows.astype(f32), precision=hi)
        return jax.lax.dynamic_update_slice_in_dim(out, logits, start, axis=1)

    out = jax.lax.fori_loop(0, n_tiles, tile, jnp.zeros((flat.shape[0], v), f32))
    return out.reshape(*lead, v)
