"""The fused Markov sampler (SPEC 2.7): Markov bias, temperature, Gumbel-max and log q, tiled over V.

For k = 1..K (prev_1 = anchor, prev_k = tokens[:, k-2]):
    e_k      = w1[prev_k]                                   (markov_emb[:, k-1], w1's dtype)
    biased_k = base_logits[:, k-1] + f32(e_k) @ f32(w2).T   f32[B, V] (returned: before temperature)
    T > 0:   scaled = (biased_k - max_v biased_k) / T
             token = argmax(scaled + noise_k),  logq = log_softmax(scaled)[token]
    T == 0:  token = argmax(biased_k) (first max; the noise is ignored),  logq = 0
The shift by the row max changes nothing mathematically (scaled is biased / T up to a per-row
constant); it is exactly what `dspark_jax.sampling.process_logits` does before dividing (so a tiny T
cannot overflow), which makes this `sampling.sample` with top_k = 0 and top_p = 1, float op for float
op, when noise[:, k-1] = sampling.gumbel(seeds, position of token k, Stream.DRAFT, V). No randomness
here: the noise is an input.

Entry points: `markov_sample_reference` (pure jnp), `markov_sample_pallas` (interpret=True runs it
anywhere) and the dispatcher `markov_sample(impl="auto" | "pallas" | "xla")` (kernels/_common.py).

Kernel structure. The K loop is OUTSIDE the kernels: a lax.scan over k, whose body gathers
e_k = w1[prev_k] (a tiny [B, r] XLA gather) and runs two pallas_calls over the vocabulary tiles (k is
scalar-prefetched and only steers the index maps). Token k+1's bias needs token k, so each step needs
a full pass; every pass handles all B requests at once, so each [TV, r] tile of w2 is read from HBM once
per step for the whole batch.
  pass 1 (markov_bias), per tile j:  biased = base_tile + e @ w2_tile.T  -> written to the logits
      buffer, plus the running row max (kept in the resident (B, 1) output block).
  pass 2 (markov_sample), per tile j: scaled = (biased - rowmax) / T, z = scaled + noise (greedy rows:
      z = biased), masked to -inf past V; the tile's first maximum of z (max, then the min of the
      matching column indices); a later tile wins only with a strictly larger value, which is
      jnp.argmax's first-index tie rule; the scaled logit at the winner; and sum(exp(scaled)), which
      needs no online rescaling because the row max of scaled is exactly 0. logq = s[token] - log(sum).
Pass 2 exists because the shift must be known before z is formed; it re-reads the biased logits
([B, V] f32, ~4 MiB at B=8: about 5% of a step's HBM traffic, which is dominated by w2's 66 MB).
Column indices are carried as f32 (exact below 2^24; larger V falls back to the reference).
The logits buffer (the [B, K*V] view or [K, B, V], see below) is carried through the scan and aliased
input->output, so each step writes only its own k and no stacking copy is needed.

Block-size rule (`plan_vocab_tile`). Blocks are (B, TV) for base/noise/logits (all B rows, vocab on
the lanes), (TV, r) for w2, and whole (B, r) / (B, 1) arrays for e, T and the outputs. TV is a multiple
of 128 (or all of V when V fits one tile): the largest one <= 16384 whose estimated per-step VMEM
(double-buffered w2/base/noise/logits tiles + f32 temporaries) fits the budget; if a multiple of 128
dividing V lies within a factor 2 below it, that one is used instead. Mosaic needs the second-minor
block dim to be a multiple of 8 or whole, so a single k of [B, K, V] cannot be a block directly:
  * TV divides V and is a multiple of 128 ("view" layout): base/noise/logits are viewed as
    [B, K*V] (a free reshape) and step k reads block column k*V/TV + j;
  * otherwise ("transpose" layout): they are transposed once to [K, B, V] and step k reads the block
    (k, 0, j); the last tile runs past V and is masked.
`vocab_tile` overrides TV (a multiple of 128, or >= V for a single tile). At V4.1-Flash (B=8,
V=129280, r=256, bf16 w2) the rule gives TV = 12928 = 129280/10: view layout, 10 tiles per step.

Numerics: when w1 and w2 are both bf16 the bias product runs on bf16 operands with f32 accumulation
(exact products, so it equals the f32 reference up to summation order); otherwise both are cast to
f32 and multiplied at Precision.HIGHEST. NaN logits are not special-cased.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dspark_jax.kernels._common import (LANES, VMEM_BUDGET_BYTES, VMEM_LIMIT_BYTES, resolve_impl, round_up,
                                        shard_kernel)

MAX_VOCAB_TILE = 16384
_MAX_EXACT_INDEX = 2**24  # column indices are carried in f32
_NT = (((1,), (1,)), ((), ()))


def _check_shapes(base_logits, anchor, w1, w2, temperature, noise) -> None:
    if base_logits.ndim != 3:
        raise ValueError(f"markov_sample: 'base_logits' must be [B, K, V], got shape {base_logits.shape}")
    b, k, v = base_logits.shape
    if w1.ndim != 2 or w1.shape[0] != v:
        raise ValueError(f"markov_sample: 'w1' must be [V={v}, r], got {w1.shape}")
    r = w1.shape[1]
    for name, arr, shape in (("anchor", anchor, (b,)), ("w2", w2, (v, r)), ("temperature", temperature, (b,)),
                             ("noise", noise, (b, k, v))):
        if tuple(arr.shape) != shape:
            raise ValueError(f"markov_sample: '{name}' must have shape {shape}, got {tuple(arr.shape)}")


def markov_sample_reference(base_logits: jax.Array, anchor: jax.Array, w1: jax.Array, w2: jax.Array,
                            temperature: jax.Array, noise: jax.Array, *, return_logits: bool = True):
    """-> (tokens i32[B, K], logq f32[B, K], markov_emb [B, K, r], biased logits f32[B, K, V] or None)."""
    _check_shapes(base_logits, anchor, w1, w2, temperature, noise)
    f32 = jnp.float32
    t = temperature.astype(f32)[:, None]
    greedy = t <= 0.0
    w2f = w2.astype(f32)

    def step(prev, k):
        e = jnp.take(w1, prev, axis=0)
        base_k = lax.dynamic_index_in_dim(base_logits, k, axis=1, keepdims=False).astype(f32)
        noise_k = lax.dynamic_index_in_dim(noise, k, axis=1, keepdims=False).astype(f32)
        biased = base_k + jnp.einsum("br,vr->bv", e.astype(f32), w2f, precision=lax.Precision.HIGHEST)
        # as sampling.process_logits: shift the row max to 0, then divide (no overflow for tiny T)
        scaled = (biased - jnp.max(biased, axis=-1, keepdims=True)) / jnp.where(greedy, 1.0, t)
        z = jnp.where(greedy, biased, scaled + noise_k)
        tok = jnp.argmax(z, axis=-1).astype(jnp.int32)
        lq = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tok[:, None], axis=-1)[:, 0]
        lq = jnp.where(greedy[:, 0], 0.0, lq)
        return tok, (tok, lq, e, biased if return_logits else None)

    def greedy_step(prev, k):  # `step` when every row is greedy: z = biased, logq = 0, noise unread
        e = jnp.take(w1, prev, axis=0)
        base_k = lax.dynamic_index_in_dim(base_logits, k, axis=1, keepdims=False).astype(f32)
        biased = base_k + jnp.einsum("br,vr->bv", e.astype(f32), w2f, precision=lax.Precision.HIGHEST)
        tok = jnp.argmax(biased, axis=-1).astype(jnp.int32)
        return tok, (tok, jnp.zeros(tok.shape, f32), e, biased if return_logits else None)

    k_steps = base_logits.shape[1]
    scan = lambda body: lax.scan(body, anchor.astype(jnp.int32), jnp.arange(k_steps, dtype=jnp.int32))  # noqa: E731
    _, (toks, logqs, embs, logits) = lax.cond(jnp.all(greedy), lambda: scan(greedy_step), lambda: scan(step))
    sw = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)  # noqa: E731  [K, B, ..] -> [B, K, ..]
    return sw(toks), sw(logqs), sw(embs), sw(logits)


def _vmem_bytes(b: int, tile: int, r: int, w2_item: int, e_item: int) -> int:
    """Estimated per-step VMEM of the larger of the two passes (double-buffered tiles + f32 temporaries)."""
    bp, rp = round_up(b, 8), round_up(r, LANES)
    row_tile = bp * tile * 4  # one f32 [B, TV] array
    bias_pass = 2 * tile * rp * w2_item + 2 * 2 * row_tile + 3 * row_tile + 2 * bp * rp * max(e_item, 4)
    sample_pass = 2 * 2 * row_tile + 6 * row_tile
    return max(bias_pass, sample_pass)


def _single_tile_layout(v: int) -> str:
    # A (B, V) block of the [B, K*V] view is only legal for Mosaic when V is a multiple of 128.
    return "view" if v % LANES == 0 else "transpose"


def plan_vocab_tile(b: int, v: int, r: int, w2_dtype, e_dtype=None, *,
                    vocab_tile: int | None = None) -> tuple[int, str] | None:
    """-> (TV, "view" | "transpose") by the rule in the module docstring, or None if no tile fits."""
    w2_item = jnp.dtype(w2_dtype).itemsize
    e_item = jnp.dtype(e_dtype if e_dtype is not None else w2_dtype).itemsize
    if vocab_tile is not None:
        tile = int(vocab_tile)
        if tile >= v:
            return v, _single_tile_layout(v)
        if tile <= 0 or tile % LANES:
            raise ValueError(f"markov_sample: 'vocab_tile' must be a positive multiple of {LANES} "
                             f"(or >= V={v}), got {vocab_tile}")
        return tile, ("view" if v % tile == 0 else "transpose")
    tile = min(MAX_VOCAB_TILE, round_up(v, LANES))
    while tile >= LANES and _vmem_bytes(b, tile, r, w2_item, e_item) > VMEM_BUDGET_BYTES:
        tile -= LANES
    if tile < LANES:
        return None
    if tile >= v:
        return v, _single_tile_layout(v)
    for cand in range(tile, tile // 2 - 1, -LANES):
        if cand > 0 and v % cand == 0:
            return cand, "view"
    return tile, "transpose"


def _columns(shape, tile: int, vocab: int):
    col = pl.program_id(0) * tile + lax.broadcasted_iota(jnp.int32, shape, 1)
    return col, col < vocab


def _bias_kernel(k_ref, e_ref, w2_ref, base_ref, _buf_in, out_ref, max_ref, *, vocab: int, tile: int,
                 fast: bool):
    """Pass 1 over the vocabulary: biased = base + e @ w2_tile.T (written out) and its running row max."""
    del k_ref  # only the index maps use the draft position
    f32 = jnp.float32
    if fast:
        bias = lax.dot_general(e_ref[...], w2_ref[...], _NT, preferred_element_type=f32)
    else:
        bias = lax.dot_general(e_ref[...].astype(f32), w2_ref[...].astype(f32), _NT,
                               precision=lax.Precision.HIGHEST, preferred_element_type=f32)
    biased = base_ref[...] + bias  # [B, TV]
    out_ref[...] = biased
    _, valid = _columns(biased.shape, tile, vocab)
    tile_max = jnp.max(jnp.where(valid, biased, -jnp.inf), axis=1, keepdims=True)

    @pl.when(pl.program_id(0) == 0)
    def _first():
        max_ref[...] = tile_max

    @pl.when(pl.program_id(0) > 0)
    def _rest():
        max_ref[...] = jnp.maximum(max_ref[...], tile_max)


def _sample_kernel(k_ref, t_ref, max_ref, biased_ref, noise_ref, tok_ref, logq_ref, best_z, best_i, best_s, run_l,
                   *, vocab: int, tile: int):
    """Pass 2: Gumbel-max / greedy argmax and sum(exp(scaled)) of scaled = (biased - rowmax) / T."""
    del k_ref
    f32 = jnp.float32

    @pl.when(pl.program_id(0) == 0)
    def _init():
        best_z[...] = jnp.full(best_z.shape, -jnp.inf, f32)
        best_i[...] = jnp.zeros(best_i.shape, f32)
        best_s[...] = jnp.zeros(best_s.shape, f32)
        run_l[...] = jnp.zeros(run_l.shape, f32)

    t = t_ref[...]  # [B, 1]
    greedy = t <= 0.0
    biased = biased_ref[...]
    scaled = (biased - max_ref[...]) / jnp.where(greedy, 1.0, t)  # as sampling.process_logits: <= 0
    z = jnp.where(greedy, biased, scaled + noise_ref[...])
    col, valid = _columns(biased.shape, tile, vocab)
    colf = col.astype(f32)
    z = jnp.where(valid, z, -jnp.inf)
    s = jnp.where(valid, scaled, -jnp.inf)

    # This tile's first maximum of z and the scaled logit there.
    z_max = jnp.max(z, axis=1, keepdims=True)
    idx = jnp.min(jnp.where(z == z_max, colf, jnp.inf), axis=1, keepdims=True)
    s_at = jnp.max(jnp.where(colf == idx, s, -jnp.inf), axis=1, keepdims=True)
    better = z_max > best_z[...]  # strict: an earlier tile keeps ties
    best_i[...] = jnp.where(better, idx, best_i[...])
    best_s[...] = jnp.where(better, s_at, best_s[...])
    best_z[...] = jnp.where(better, z_max, best_z[...])
    run_l[...] += jnp.sum(jnp.exp(s), axis=1, keepdims=True)  # the row max of scaled is exactly 0

    @pl.when(pl.program_id(0) == pl.num_programs(0) - 1)
    def _finish():
        tok_ref[...] = best_i[...].astype(jnp.int32)
        logq_ref[...] = jnp.where(greedy, 0.0, best_s[...] - jnp.log(run_l[...]))


def _unsupported_reason(b, v, r, w2_dtype, e_dtype, vocab_tile) -> str | None:
    if v >= _MAX_EXACT_INDEX:
        return f"V={v} >= 2^24 (column indices are carried in f32)"
    if plan_vocab_tile(b, v, r, w2_dtype, e_dtype, vocab_tile=vocab_tile) is None:
        return "no vocabulary tile fits the VMEM budget"
    return None


def markov_sample_pallas(base_logits: jax.Array, anchor: jax.Array, w1: jax.Array, w2: jax.Array,
                         temperature: jax.Array, noise: jax.Array, *, return_logits: bool = True,
                         vocab_tile: int | None = None, interpret: bool = False):
    """The Pallas kernels (two passes per draft position, in a lax.scan); same contract as the reference."""
    _check_shapes(base_logits, anchor, w1, w2, temperature, noise)
    b, k_steps, v = base_logits.shape
    r = w1.shape[1]
    why = _unsupported_reason(b, v, r, w2.dtype, w1.dtype, vocab_tile)
    if why:
        raise ValueError(f"markov_sample_pallas: unsupported shapes: {why}")
    tile, layout = plan_vocab_tile(b, v, r, w2.dtype, w1.dtype, vocab_tile=vocab_tile)
    n_tiles = pl.cdiv(v, tile)
    f32 = jnp.float32
    fast = jnp.dtype(w1.dtype) == jnp.bfloat16 and jnp.dtype(w2.dtype) == jnp.bfloat16

    if layout == "view":
        base = base_logits.astype(f32).reshape(b, k_steps * v)
        nz = noise.astype(f32).reshape(b, k_steps * v)
    else:
        base = jnp.swapaxes(base_logits.astype(f32), 0, 1)  # [K, B, V]
        nz = jnp.swapaxes(noise.astype(f32), 0, 1)

    if layout == "view":
        row_tiles = pl.BlockSpec((b, tile), lambda j, k_ref: (0, k_ref[0] * n_tiles + j))
    else:
        row_tiles = pl.BlockSpec((None, b, tile), lambda j, k_ref: (k_ref[0], 0, j))
    whole = lambda shape: pl.BlockSpec(shape, lambda j, k_ref: (0,) * len(shape))  # noqa: E731
    params = pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_LIMIT_BYTES)
    common = dict(vocab=v, tile=tile)

    bias_pass = pl.pallas_call(
        functools.partial(_bias_kernel, fast=fast, **common),
        out_shape=[jax.ShapeDtypeStruct(base.shape, f32), jax.ShapeDtypeStruct((b, 1), f32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n_tiles,),
            in_specs=[whole((b, r)), pl.BlockSpec((tile, r), lambda j, k_ref: (j, 0)), row_tiles,
                      pl.BlockSpec(memory_space=pl.ANY)],  # the logits buffer: only written, via the alias
            out_specs=[row_tiles, whole((b, 1))]),
        input_output_aliases={4: 0},  # operand 4 = the buffer (operand 0 is the scalar-prefetched k)
        compiler_params=params, interpret=interpret, name="markov_bias",
    )
    sample_pass = pl.pallas_call(
        functools.partial(_sample_kernel, **common),
        out_shape=[jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, 1), f32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n_tiles,),
            in_specs=[whole((b, 1)), whole((b, 1)), row_tiles, row_tiles],
            out_specs=[whole((b, 1)), whole((b, 1))],
            scratch_shapes=[pltpu.VMEM((b, 1), f32) for _ in range(4)]),
        compiler_params=params, interpret=interpret, name="markov_sample",
    )
    t2 = temperature.astype(f32).reshape(b, 1)

    def step(carry, k):
        prev, buf = carry
        e = jnp.take(w1, prev, axis=0)
        kk = k.reshape(1)
        buf, row_max = bias_pass(kk, e, w2, base, buf)
        tok, logq = sample_pass(kk, t2, row_max, buf, nz)
        return (tok[:, 0], buf), (tok[:, 0], logq[:, 0], e)

    buf0 = jnp.zeros(base.shape, f32)
    (_, buf), (toks, logqs, embs) = lax.scan(step, (anchor.astype(jnp.int32), buf0),
                                             jnp.arange(k_steps, dtype=jnp.int32))
    logits = None
    if return_logits:
        logits = buf.reshape(b, k_steps, v) if layout == "view" else jnp.swapaxes(buf, 0, 1)
    sw = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731
    return sw(toks), sw(logqs), sw(embs), logits


def markov_sample(base_logits: jax.Array, anchor: jax.Array, w1: jax.Array, w2: jax.Array,
                  temperature: jax.Array, noise: jax.Array, *, return_logits: bool = True, impl: str = "auto",
                  vocab_tile: int | None = None):
    """Dispatcher: impl "auto" (Pallas on TPU, reference elsewhere), "pallas" (interpret mode off TPU)
    or "xla" (reference), optionally "@<platform>" (kernels/_common.py); under a mesh the kernel runs per
    device on its batch rows, the Markov weights replicated. -> (tokens i32[B, K], logq f32[B, K], markov_emb [B, K, r],
    biased logits f32[B, K, V] or None). `vocab_tile` only affects the Pallas path."""
    _check_shapes(base_logits, anchor, w1, w2, temperature, noise)
    b, _, v = base_logits.shape
    why = _unsupported_reason(b, v, w1.shape[1], w2.dtype, w1.dtype, vocab_tile)
    which, interpret = resolve_impl(impl, name="markov_sample", supported=why is None, why_unsupported=why or "")
    if which == "xla":
        return markov_sample_reference(base_logits, anchor, w1, w2, temperature, noise, return_logits=return_logits)
    kernel = functools.partial(markov_sample_pallas, return_logits=return_logits, vocab_tile=vocab_tile,
                               interpret=interpret)
    out_dims = ("b.", "b.", "b..", "b.." if return_logits else None)
    return shard_kernel(kernel, (base_logits, anchor, w1, w2, temperature, noise), ("b..", "b", "", "", "b", "b.."),
                        out_dims, batch=b)
