"""Window-only latent MQA with a per-head sink (SPEC 2.5): the draft block's attention core.

    o[b, k, h] = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m)),
    s_j = <q[b, k, h], key_j> * scale (f32),  m = max(max_j s_j, sink_h)

Keys = values = [the valid ring rows of request b ; its K draft rows]: ring slot i is valid iff
i < min(W, ring_len[b]); every query sees every draft row (the block is bidirectional). RoPE, the fp8
rounding of the KV rows and the inverse RoPE of o are the caller's; o comes back in q's dtype.

Three entry points plus the dispatcher (see kernels/_common.py for `impl`):
  window_attention_reference  pure jnp, f32 math; the definition the kernel is tested against.
  window_attention_pallas     the Pallas kernel (Mosaic TPU; interpret=True runs it anywhere).
  window_attention            impl = "auto" | "pallas" | "xla".

Kernel layout. The K*H query rows of one request are folded into one [K*H, hd] matrix (row
k*H + h), so the MXU sees [K*H, hd] x [hd, W] for the ring and [K*H, hd] x [hd, Kp] for the draft rows:
the two halves of the W+K key block, kept as two products so the ring never has to be copied next
to the draft rows (in HBM or in VMEM). The draft rows are zero-padded to Kp = a multiple of the
sublane tile and masked, which keeps every in-kernel shape tile-aligned. ring_len is scalar-prefetched
into SMEM; the per-row sink comes in as a [K*H, 1] f32 column.

Grid = (B, K*H / TQ), both axes "parallel". Block-size rule (`plan_row_block`): the ring [W, hd], the
padded draft rows [Kp, hd] and hd are always whole blocks (full dims, legal for Mosaic); the query row
block TQ is all K*H rows when K*H <= 512, else the largest divisor of K*H that is a multiple of the
query dtype's sublane tile (8 for f32, 16 for bf16) and <= 512 (all rows if there is none); TQ is then
halved (staying such a divisor) while the estimated per-step VMEM exceeds the budget. Shapes with no
fitting block are "unsupported": impl="auto" uses the reference and impl="pallas" raises.
At V4.1-Flash (K=5, H=64, hd=512, W=128) TQ = 320: one grid step per request, ~3 MiB of VMEM.

Numerics: scores and the softmax are f32. When q, ring and draft rows are all bf16 the score product
runs on bf16 operands with f32 accumulation (bf16 x bf16 products are exact in f32, so this equals the
f32 reference up to summation order) and the probability-value product splits p into bf16 hi + lo
parts (two bf16 passes, relative error ~2^-17, far below the bf16 rounding of the output). Every other
dtype combination runs both products in f32 at Precision.HIGHEST.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dspark_jax.kernels._common import (LANES, VMEM_BUDGET_BYTES, VMEM_LIMIT_BYTES, resolve_impl, round_up,
                                        sublanes)

MAX_ROW_BLOCK = 512
_NT = (((1,), (1,)), ((), ()))  # contract the last dims of both operands: x @ y.T
_NN = (((1,), (0,)), ((), ()))


def window_attention_reference(q: jax.Array, ring_kv: jax.Array, ring_len: jax.Array, draft_kv: jax.Array,
                               sink: jax.Array, *, scale: float) -> jax.Array:
    """q [B, K, H, hd], ring_kv [B, W, hd], ring_len i32[B], draft_kv [B, K, hd], sink f32[H] -> o [B, K, H, hd]."""
    _check_shapes(q, ring_kv, ring_len, draft_kv, sink)
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    b, k, _, _ = q.shape
    w = ring_kv.shape[1]
    n = jnp.clip(ring_len.astype(jnp.int32), 0, w)
    valid = jnp.arange(w)[None, :] < n[:, None]  # [B, W]
    # Unwritten ring slots may hold anything (even NaN): zero them so they cannot leak into o.
    ring = jnp.where(valid[..., None], ring_kv.astype(f32), 0.0)
    keys = jnp.concatenate([ring, draft_kv.astype(f32)], axis=1)  # [B, W+K, hd], also the values
    mask = jnp.concatenate([valid, jnp.ones((b, k), bool)], axis=1)  # [B, W+K]
    s = jnp.einsum("bkhd,bjd->bkhj", q.astype(f32), keys, precision=hi) * scale
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    sink_ = sink.astype(f32)[None, None, :, None]
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink_)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink_ - m)
    o = jnp.einsum("bkhj,bjd->bkhd", p, keys, precision=hi) / denom
    return o.astype(q.dtype)


def _check_shapes(q, ring_kv, ring_len, draft_kv, sink) -> None:
    if q.ndim != 4:
        raise ValueError(f"window_attention: 'q' must be [B, K, H, hd], got shape {q.shape}")
    b, k, h, hd = q.shape
    want = {"ring_kv": (b, None, hd), "ring_len": (b,), "draft_kv": (b, k, hd), "sink": (h,)}
    for name, arr in (("ring_kv", ring_kv), ("ring_len", ring_len), ("draft_kv", draft_kv), ("sink", sink)):
        shape = want[name]
        if arr.ndim != len(shape) or any(s is not None and s != a for s, a in zip(shape, arr.shape)):
            pretty = tuple("W" if s is None else s for s in shape)
            raise ValueError(f"window_attention: '{name}' must have shape {pretty} for q of shape "
                             f"{q.shape}, got {arr.shape}")


def _fast_path(q_dtype, ring_dtype, draft_dtype) -> bool:
    return all(jnp.dtype(d) == jnp.bfloat16 for d in (q_dtype, ring_dtype, draft_dtype))


def _vmem_bytes(tq: int, hd: int, w: int, kp: int, q_item: int, kv_item: int) -> int:
    """Estimated per-step VMEM: double-buffered q/o/ring/draft/sink blocks plus f32 temporaries."""
    hdp, keys = round_up(hd, LANES), round_up(w, LANES) + round_up(kp, LANES)
    blocks = 2 * (2 * tq * hdp * q_item + (w + kp) * hdp * kv_item + tq * LANES * 4)
    temps = 3 * tq * keys * 4 + 2 * tq * hdp * 4 + (w + kp) * hdp * 4
    return blocks + temps


def plan_row_block(rows: int, hd: int, w: int, num_draft: int, q_dtype, kv_dtype) -> int | None:
    """The query row block TQ for K*H = rows (see the module docstring), or None if nothing fits."""
    sub = sublanes(q_dtype)
    kp = round_up(num_draft, sublanes(kv_dtype))
    q_item, kv_item = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    if rows <= MAX_ROW_BLOCK:
        tq = rows
    else:
        cands = [d for d in range(sub, MAX_ROW_BLOCK + 1, sub) if rows % d == 0]
        tq = max(cands) if cands else rows
    while _vmem_bytes(tq, hd, w, kp, q_item, kv_item) > VMEM_BUDGET_BYTES:
        smaller = [d for d in range(sub, tq // 2 + 1, sub) if rows % d == 0]
        if not smaller:
            return None
        tq = max(smaller)
    return tq


def _kernel(len_ref, q_ref, ring_ref, draft_ref, sink_ref, o_ref, *, scale: float, num_draft: int, fast: bool):
    f32 = jnp.float32
    w = ring_ref.shape[0]
    n = jnp.clip(len_ref[pl.program_id(0)], 0, w)
    q, ring, draft = q_ref[...], ring_ref[...], draft_ref[...]
    ring = jnp.where(lax.broadcasted_iota(jnp.int32, ring.shape, 0) < n, ring, jnp.zeros_like(ring))

    if fast:
        def scores(keys):
            return lax.dot_general(q, keys, _NT, preferred_element_type=f32)

        def weighted(p, vals):  # p f32 = hi + lo, each exact in bf16 up to ~2^-17 relative
            p_hi = p.astype(jnp.bfloat16)
            p_lo = (p - p_hi.astype(f32)).astype(jnp.bfloat16)
            return (lax.dot_general(p_hi, vals, _NN, preferred_element_type=f32)
                    + lax.dot_general(p_lo, vals, _NN, preferred_element_type=f32))
    else:
        hi = lax.Precision.HIGHEST
        qf = q.astype(f32)

        def scores(keys):
            return lax.dot_general(qf, keys.astype(f32), _NT, precision=hi, preferred_element_type=f32)

        def weighted(p, vals):
            return lax.dot_general(p, vals.astype(f32), _NN, precision=hi, preferred_element_type=f32)

    s_ring = scores(ring) * scale  # [TQ, W]
    s_draft = scores(draft) * scale  # [TQ, Kp]
    s_ring = jnp.where(lax.broadcasted_iota(jnp.int32, s_ring.shape, 1) < n, s_ring, -jnp.inf)
    s_draft = jnp.where(lax.broadcasted_iota(jnp.int32, s_draft.shape, 1) < num_draft, s_draft, -jnp.inf)
    sink = sink_ref[...]  # [TQ, 1]
    m = jnp.maximum(jnp.maximum(jnp.max(s_ring, axis=1, keepdims=True), jnp.max(s_draft, axis=1, keepdims=True)),
                    sink)
    p_ring = jnp.exp(s_ring - m)
    p_draft = jnp.exp(s_draft - m)
    denom = (jnp.sum(p_ring, axis=1, keepdims=True) + jnp.sum(p_draft, axis=1, keepdims=True)
             + jnp.exp(sink - m))
    o = weighted(p_ring, ring) + weighted(p_draft, draft)
    o_ref[...] = (o / denom).astype(o_ref.dtype)


def window_attention_pallas(q: jax.Array, ring_kv: jax.Array, ring_len: jax.Array, draft_kv: jax.Array,
                            sink: jax.Array, *, scale: float, interpret: bool = False,
                            row_block: int | None = None) -> jax.Array:
    """The Pallas kernel; same contract as `window_attention_reference`. `row_block` overrides TQ
    (it must divide K*H and be a multiple of the query dtype's sublane tile, or equal K*H)."""
    _check_shapes(q, ring_kv, ring_len, draft_kv, sink)
    b, k, h, hd = q.shape
    w = ring_kv.shape[1]
    rows = k * h
    if row_block is None:
        tq = plan_row_block(rows, hd, w, k, q.dtype, ring_kv.dtype)
        if tq is None:
            raise ValueError(f"window_attention_pallas: no query row block fits the VMEM budget for "
                             f"q {q.shape}, ring {ring_kv.shape}; use the reference")
    else:
        tq = int(row_block)
        if rows % tq or (tq != rows and tq % sublanes(q.dtype)):
            raise ValueError(f"window_attention_pallas: 'row_block' must divide K*H={rows} and be a multiple "
                             f"of {sublanes(q.dtype)} (or equal {rows}), got {row_block}")
    kp = round_up(k, max(sublanes(draft_kv.dtype), sublanes(ring_kv.dtype)))
    draft = jnp.pad(draft_kv, ((0, 0), (0, kp - k), (0, 0)))
    q_rows = q.reshape(b, rows, hd)  # row k*H + h
    sink_rows = jnp.tile(sink.astype(jnp.float32), k).reshape(rows, 1)

    kernel = functools.partial(_kernel, scale=float(scale), num_draft=k,
                               fast=_fast_path(q.dtype, ring_kv.dtype, draft.dtype))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, rows // tq),
        in_specs=[
            pl.BlockSpec((None, tq, hd), lambda i, r, lens: (i, r, 0)),
            pl.BlockSpec((None, w, hd), lambda i, r, lens: (i, 0, 0)),
            pl.BlockSpec((None, kp, hd), lambda i, r, lens: (i, 0, 0)),
            pl.BlockSpec((tq, 1), lambda i, r, lens: (r, 0)),
        ],
        out_specs=pl.BlockSpec((None, tq, hd), lambda i, r, lens: (i, r, 0)),
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, rows, hd), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="window_attention",
    )(ring_len.astype(jnp.int32), q_rows, ring_kv, draft, sink_rows)
    return out.reshape(b, k, h, hd)


def window_attention(q: jax.Array, ring_kv: jax.Array, ring_len: jax.Array, draft_kv: jax.Array, sink: jax.Array,
                     *, scale: float, impl: str = "auto") -> jax.Array:
    """Dispatcher: impl "auto" (Pallas on TPU, reference elsewhere), "pallas" (interpret mode off TPU)
    or "xla" (reference). Same contract as `window_attention_reference`."""
    _check_shapes(q, ring_kv, ring_len, draft_kv, sink)
    _, k, h, hd = q.shape
    tq = plan_row_block(k * h, hd, ring_kv.shape[1], k, q.dtype, ring_kv.dtype)
    which, interpret = resolve_impl(impl, name="window_attention", supported=tq is not None,
                                    why_unsupported="no query row block fits the VMEM budget")
    if which == "xla":
        return window_attention_reference(q, ring_kv, ring_len, draft_kv, sink, scale=scale)
    return window_attention_pallas(q, ring_kv, ring_len, draft_kv, sink, scale=scale, interpret=interpret)
