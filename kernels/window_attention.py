"""Window-only latent MQA with a per-head sink (SPEC 2.5): the draft block's attention core.

    o[b, k, h] = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m)),
    s_j = <q[b, k, h], key_j> * scale (f32),  m = max_j s_j

Keys = values = [the valid ring rows of request b ; its K draft rows]: ring slot i is valid iff
i < min(W, ring_len[b]); every query sees every draft row (the block is bidirectional). RoPE, the fp8
rounding of the KV rows and the inverse RoPE of o are the caller's; o comes back in q's dtype.

Three entry points plus the dispatcher (see kernels/_common.py for `impl`):
  window_attention_reference  pure jnp; the definition the kernel is tested against.
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

Numerics (SPEC 2.9, shared by the reference and the kernel: `blocked_softmax_values`): f32 scores, an
online softmax over consecutive blocks of 64 keys with running max and sum in f32, the sink in the final
denominator. The keys are in the draft's official order (SPEC 2.5, `draft_key_rank`): the valid ring
slots in slot order, then the draft rows. When q, ring and draft rows are all bf16 (bf16 compute) the score product runs on bf16
operands with f32 accumulation (exact products) and each block's probabilities are rounded to bf16
before the value product, as the official forward does. Every other dtype combination runs both
products in f32 at Precision.HIGHEST without rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dspark_jax.kernels._common import (LANES, VMEM_BUDGET_BYTES, VMEM_LIMIT_BYTES, resolve_impl, round_up,
                                        shard_kernel, sublanes)
from dspark_jax.nn.rounding import to_dtype

MAX_ROW_BLOCK = 512
_NT = (((1,), (1,)), ((), ()))  # contract the last dims of both operands: x @ y.T
_NN = (((1,), (0,)), ((), ()))


KEY_BLOCK = 64  # the official forward's online softmax walks the keys in blocks of 64


def draft_key_rank(row: jax.Array, ring_len: jax.Array, window: int) -> jax.Array:
    """Where draft row `row` (0 .. K-1) stands in the draft's key order (SPEC 2.5).

    The draft's own index list (official `get_dspark_topk_idxs`) is `cat(arange(min(W, p+1)), W +
    arange(K))`: the valid ring SLOTS in slot order (a ring slot's rank is its slot index, also once the
    ring has wrapped and slot 0 no longer holds the oldest row), then the K draft rows right after them.
    The main model's chronological `get_window_topk_idxs` is not used by the draft. The order matters only
    through the 64-key blocks of the online softmax (`blocked_softmax_values`): chronological order puts
    other keys together in a block and moves 12-30% of the outputs of a wrapped ring by one bf16 ulp.
    """
    return jnp.clip(ring_len, 0, window) + row


def blocked_softmax_values(segments, sink: jax.Array, dot, *, num_keys: int, round_probs=None,
                           block: int = KEY_BLOCK):
    """The attention output sum_j p_j v_j / (sum_j p_j + exp(sink - m)) by the official online softmax.

    `segments` = [(scores f32 [.., n_i] with -inf at masked keys, values [n_i, ..], rank), ...]; `rank`
    (int, broadcasting against the scores) is each key's place in the official key order, 0 ..
    num_keys - 1, and the keys are visited in consecutive blocks of `block` places. Per block: running
    max m and running sum l in f32, the block's probabilities exp(s - m) rounded to bf16 by `round_probs`
    when given (bf16 compute: the official code casts them before the value product) and multiplied
    with the values by `dot(p, values)` (f32 accumulation); the running sum adds the unrounded ones. The
    sink enters the final denominator only. Blocks are selected by masks, not gathers or slices, so the
    same code runs inside a Mosaic kernel. `sink` broadcasts against the scores without their key axis.
    """
    first_s = segments[0][0]
    m = jnp.full(first_s.shape[:-1] + (1,), -jnp.inf, jnp.float32)
    l, acc = None, None
    for b0 in range(0, num_keys, block):
        parts = [(jnp.where((rank >= b0) & (rank < b0 + block), s, -jnp.inf), v) for s, v, rank in segments]
        m_new = m
        for s, _ in parts:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep everything at zero
        alpha = jnp.exp(m - m_safe)
        l = 0.0 if l is None else l * alpha
        acc = 0.0 if acc is None else acc * alpha
        for s, v in parts:
            p = jnp.exp(s - m_safe)
            l = l + jnp.sum(p, axis=-1, keepdims=True)
            if round_probs is not None:
                p = round_probs(p)
            acc = acc + dot(p, v)
        m = m_new
    return acc / (l + jnp.exp(sink - m))


def window_attention_reference(q: jax.Array, ring_kv: jax.Array, ring_len: jax.Array, draft_kv: jax.Array,
                               sink: jax.Array, *, scale: float) -> jax.Array:
    """q [B, K, H, hd], ring_kv [B, W, hd], ring_len i32[B], draft_kv [B, K, hd], sink f32[H] -> o [B, K, H, hd].

    f32 scores and softmax; with q, ring and draft rows all bf16 (bf16 compute) the probabilities are
    rounded to bf16 before the value product, as the official forward does (SPEC 2.9).
    """
    _check_shapes(q, ring_kv, ring_len, draft_kv, sink)
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    k, w = q.shape[1], ring_kv.shape[1]
    length = ring_len.astype(jnp.int32)
    n = jnp.clip(length, 0, w)
    valid = jnp.arange(w)[None, :] < n[:, None]  # [B, W]
    # Unwritten ring slots may hold anything (even NaN): zero them so they cannot leak into o.
    ring = jnp.where(valid[..., None], ring_kv.astype(f32), 0.0)
    draft = draft_kv.astype(f32)
    qf = q.astype(f32)
    s_ring = jnp.einsum("bkhd,bjd->bkhj", qf, ring, precision=hi) * scale
    s_ring = jnp.where(valid[:, None, None, :], s_ring, -jnp.inf)
    s_draft = jnp.einsum("bkhd,bjd->bkhj", qf, draft, precision=hi) * scale
    ring_rank = jnp.arange(w)  # a ring slot's rank is its slot index
    draft_rank = draft_key_rank(jnp.arange(k)[None, :], length[:, None], w)[:, None, None, :]  # [B, 1, 1, K]

    def dot(p, v):  # p [B, K, H, n] (bf16 or f32), v [B, n, hd] f32 holding bf16 or f32 values
        return jnp.einsum("bkhj,bjd->bkhd", p.astype(f32), v, precision=hi)

    o = blocked_softmax_values([(s_ring, ring, ring_rank), (s_draft, draft, draft_rank)],
                               sink.astype(f32)[None, None, :, None], dot, num_keys=w + k,
                               round_probs=_bf16_rounding(q.dtype, ring_kv.dtype, draft_kv.dtype, fusion_proof=True))
    return to_dtype(o, q.dtype)


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


def _bf16_rounding(q_dtype, ring_dtype, draft_dtype, *, fusion_proof: bool):
    """How the probabilities are rounded to bf16 before the value product (bf16 compute only, else None).
    Under XLA the rounding must survive fusion (`nn.rounding`); a Mosaic kernel has no such fusion and no
    reduce_precision, so a compiled kernel casts."""
    if not _fast_path(q_dtype, ring_dtype, draft_dtype):
        return None
    if fusion_proof:
        return lambda p: to_dtype(p, jnp.bfloat16)
    return lambda p: p.astype(jnp.bfloat16)


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


def _kernel(len_ref, q_ref, ring_ref, draft_ref, sink_ref, o_ref, *, scale: float, num_draft: int, fast: bool,
            interpret: bool):
    f32 = jnp.float32
    w = ring_ref.shape[0]
    length = len_ref[pl.program_id(0)]
    n = jnp.clip(length, 0, w)
    q, ring, draft = q_ref[...], ring_ref[...], draft_ref[...]
    ring = jnp.where(lax.broadcasted_iota(jnp.int32, ring.shape, 0) < n, ring, jnp.zeros_like(ring))

    if fast:  # bf16 operands, f32 accumulation: bf16 x bf16 products are exact in f32
        def scores(keys):
            return lax.dot_general(q, keys, _NT, preferred_element_type=f32)

        def dot(p, vals):  # p is already bf16 (the official rounding of the probabilities)
            return lax.dot_general(p, vals, _NN, preferred_element_type=f32)
    else:
        hi = lax.Precision.HIGHEST
        qf = q.astype(f32)

        def scores(keys):
            return lax.dot_general(qf, keys.astype(f32), _NT, precision=hi, preferred_element_type=f32)

        def dot(p, vals):
            return lax.dot_general(p, vals.astype(f32), _NN, precision=hi, preferred_element_type=f32)

    s_ring = scores(ring) * scale  # [TQ, W]
    s_draft = scores(draft) * scale  # [TQ, Kp]; the padding rows Kp > K are the segment's tail
    s_ring = jnp.where(lax.broadcasted_iota(jnp.int32, s_ring.shape, 1) < n, s_ring, -jnp.inf)
    s_draft = jnp.where(lax.broadcasted_iota(jnp.int32, s_draft.shape, 1) < num_draft, s_draft, -jnp.inf)
    ring_rank = lax.broadcasted_iota(jnp.int32, s_ring.shape, 1)  # a ring slot's rank is its slot index
    draft_rank = draft_key_rank(lax.broadcasted_iota(jnp.int32, s_draft.shape, 1), length, w)  # padding: -inf
    o = blocked_softmax_values([(s_ring, ring, ring_rank), (s_draft, draft, draft_rank)], sink_ref[...], dot,
                               num_keys=w + num_draft,
                               round_probs=_bf16_rounding(q.dtype, ring.dtype, draft.dtype, fusion_proof=interpret))
    o_ref[...] = to_dtype(o, o_ref.dtype) if interpret else o.astype(o_ref.dtype)


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
                               fast=_fast_path(q.dtype, ring_kv.dtype, draft.dtype), interpret=bool(interpret))
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
    or "xla" (reference), optionally "@<platform>" (kernels/_common.py). Same contract as
    `window_attention_reference`. Under a mesh the kernel runs per device on its batch rows and heads."""
    _check_shapes(q, ring_kv, ring_len, draft_kv, sink)
    _, k, h, hd = q.shape
    tq = plan_row_block(k * h, hd, ring_kv.shape[1], k, q.dtype, ring_kv.dtype)
    which, interpret = resolve_impl(impl, name="window_attention", supported=tq is not None,
                                    why_unsupported="no query row block fits the VMEM budget")
    if which == "xla":
        return window_attention_reference(q, ring_kv, ring_len, draft_kv, sink, scale=scale)
    kernel = functools.partial(window_attention_pallas, scale=scale, interpret=interpret)
    return shard_kernel(kernel, (q, ring_kv, ring_len, draft_kv, sink), ("b.h.", "b..", "b", "b..", "h"), "b.h.",
                        batch=q.shape[0], heads=h)
