"""DeepSeek MoE as in the V4.1 draft (SPEC 2.6): sqrt-softplus gate, bias-steered top-k selection,
renormalised unbiased weights times route_scale, clamped SwiGLU experts, one shared expert.

Two paths with the same numerics (`MoE.routing`). `moe_ffn` evaluates every expert on every token and
combines with a [N, E] weight matrix that is zero off the selected experts: E/k times the routed work,
right for few experts. `routed_moe_ffn` computes only the N*k routed (token, expert) pairs, dropless:
the way for many experts (below).

Expert parallelism: expert weights carry the logical axis "expert". Under `jax.jit` with the expert axis
sharded, the dense path computes each device's own experts and one all-reduce sums the results; the
routed path is left to XLA's partitioner (a shard_map that computes each device's pairs is not built yet).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.linear import mixed_einsum
from dspark_jax.nn.packed import as_compute
from dspark_jax.nn.params import fan_in_normal, param
from dspark_jax.nn.platform import by_platform
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rounding import to_dtype
from dspark_jax.nn.rows import put_row, readable, take_rows, writable


def gate_scores(x: jax.Array, gate_kernel: jax.Array, score_func: str = "sqrtsoftplus") -> jax.Array:
    """Routing scores in f32, x [.., D], kernel [D, E] -> [.., E]."""
    logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), gate_kernel.astype(jnp.float32),
                        precision="highest")
    if score_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"unknown score_func {score_func!r}")


def moe_route(x: jax.Array, gate_kernel: jax.Array, bias: jax.Array, *, top_k: int, route_scale: float,
              score_func: str = "sqrtsoftplus", norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """-> (weights f32[.., k], expert ids i32[.., k]).

    The bias only steers WHICH experts are chosen; the weights are the unbiased scores of the chosen
    experts, renormalised to sum to one (+1e-20) and multiplied by route_scale.
    """
    scores = gate_scores(x, gate_kernel, score_func)
    _, idx = jax.lax.top_k(scores + bias.astype(jnp.float32), top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * route_scale, idx


def clamped_swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """silu(min(g, limit)) * clip(u, -limit, limit), in f32."""
    g = jnp.minimum(g.astype(jnp.float32), limit)
    u = jnp.clip(u.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(g) * u


def _act(x, act_fp8, fp8_grad):
    """The official activation fp8 rounding before an fp8/fp4 GEMM, when emulated (`act_fp8`)."""
    return fp8_quant_dequant(x, grad=fp8_grad) if act_fp8 else x


def _expert_hidden(xa: jax.Array, w1: jax.Array, w3: jax.Array, spec: str, limit: float) -> jax.Array:
    """swiglu(w1 xa, w3 xa) in f32 from the bf16 outputs of the two linears (SPEC 2.9); `xa` is the input
    already in the weights' dtype and, in fp8 mode, rounded (`_act`)."""
    cd = w1.dtype
    g = to_dtype(mixed_einsum(spec, xa, w1), cd)
    u = to_dtype(mixed_einsum(spec, xa, w3), cd)
    return clamped_swiglu(g, u, limit)


def swiglu_mlp(x: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array, *, limit: float,
               weight: jax.Array | None = None, act_fp8: bool = False, fp8_grad: str = "exact") -> jax.Array:
    """One expert (or the shared expert): w2(weight * swiglu(w1 x, w3 x)), in the weights' dtype.

    The official rounding points: bf16 outputs of w1 and w3, the clamps, silu, product and routing
    weight in f32, one cast to bf16 (then fp8 in fp8 mode) before w2, a bf16 output.
    """
    cd = w1.dtype
    h = _expert_hidden(_act(x.astype(cd), act_fp8, fp8_grad), w1, w3, "...d,di->...i", limit)
    if weight is not None:  # routing weight is applied BEFORE w2, as the reference does
        h = h * weight[..., None]
    h = _act(to_dtype(h, cd), act_fp8, fp8_grad)
    return to_dtype(mixed_einsum("...i,id->...d", h, w2), cd)


def moe_ffn(x: jax.Array, weights: jax.Array, idx: jax.Array, experts: dict, shared: dict | None, *,
            limit: float, act_fp8: bool = False, fp8_grad: str = "exact") -> jax.Array:
    """x [N, D], routing (weights, idx) [N, k], experts {w1,w3: [E, D, I], w2: [E, I, D]} -> [N, D] in the
    experts' dtype.

    Every expert runs on every token; experts a token did not pick get routing weight 0, so their output
    is exactly 0. Each expert's output is rounded to the compute dtype on its own and the outputs are
    summed in f32 (the official MoE's accumulator: routed experts in ascending index, then the shared
    expert), then rounded once more. Summing inside the w2 contraction instead would skip the per-expert
    rounding, which at bf16 is a different model (SPEC 2.9).
    """
    n_experts = experts["w1"].shape[0]
    combine = jnp.sum(jax.nn.one_hot(idx, n_experts, dtype=jnp.float32) * weights[..., None], axis=-2)  # [N, E]
    cd = experts["w1"].dtype
    # Expert-major [E, N, ..] with E as the dots' batch axis: each expert's weights are read where they lie.
    # (Contracting [N, D] with [E, D, I] directly makes XLA:CPU copy the weights to [D, E*I] on every call.)
    # The input is rounded once, then shared by every expert.
    xa = _act(x.astype(cd), act_fp8, fp8_grad)
    h = _expert_hidden(jnp.broadcast_to(xa, (n_experts, *xa.shape)), experts["w1"], experts["w3"], "end,edi->eni",
                       limit)
    h = _act(to_dtype(h * combine.T[..., None], cd), act_fp8, fp8_grad)
    per_expert = to_dtype(mixed_einsum("eni,eid->end", h, experts["w2"]), cd)  # [E, N, D]
    y = jnp.sum(per_expert.astype(jnp.float32), axis=0)
    if shared is not None:
        y = y + swiglu_mlp(x, shared["w1"], shared["w3"], shared["w2"], limit=limit, act_fp8=act_fp8,
                           fp8_grad=fp8_grad).astype(jnp.float32)
    return to_dtype(y, cd)


# ---- routed MoE: the work follows the (token, expert) pairs ----------------------------------------------
# `moe_ffn` above runs every expert on every token (E/k times the routed work). `routed_moe_ffn` computes
# only the N*k routed pairs, with the same numerics: each pair's output rounded to the compute dtype on its
# own, a token's k outputs summed in f32 in ascending expert index (the official order, which the
# all-experts sum also follows: the experts a token did not pick add exact zeros), then the shared expert.
#   gather  (N*k <= E: decode sizes) each pair reads its expert's matrices by index; no expert is read
#           that no token picked, and there is no padding.
#   grouped (more pairs than experts: prefill, training) on TPU / GPU: the pairs sorted by expert, one
#           `jax.lax.ragged_dot` per matrix (grouped matmuls, lowered natively there, no padding).
#   tiles   the same on CPU, where ragged_dot computes every group densely: the pairs sorted by expert
#           and cut into fixed tiles of T pairs, each tile one expert's; a loop over the tiles reads each
#           tile's expert by index. Dropless: a static bound on the tile count holds every routing.
#           Padding is at most T - 1 rows per expert; T is chosen so that it stays under half the pairs.
#           The loop has its own backward pass (see `_tile_loop`).


def ascending_routes(weights: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's k routes reordered by ascending expert index (the order its outputs are summed in)."""
    order = jnp.argsort(idx, axis=-1)
    return jnp.take_along_axis(weights, order, axis=-1), jnp.take_along_axis(idx, order, axis=-1)


def _pair_outputs(xa: jax.Array, weight: jax.Array, w1, w3, w2, *, limit, act_fp8, fp8_grad, spec_in: str,
                  spec_out: str) -> jax.Array:
    """The routed expert on its pairs: w2(weight * swiglu(w1 xa, w3 xa)) rounded to the compute dtype, in
    f32 (`swiglu_mlp`'s rounding points; the weight multiplies before w2, as the all-experts path does)."""
    cd = w1.dtype
    h = _expert_hidden(xa, w1, w3, spec_in, limit)
    h = _act(to_dtype(h * weight[..., None], cd), act_fp8, fp8_grad)
    return to_dtype(mixed_einsum(spec_out, h, w2), cd).astype(jnp.float32)


def expert_matrices(experts: dict, index: jax.Array, dtype) -> tuple:
    """(w1, w3, w2) of the experts `index` names (any shape of ids), read at their stored precision and only
    then turned into the compute dtype: a packed (fp8 / fp4) stack is dequantised for the selected experts
    only, a bf16 stack is read without an f32 copy of it (`nn.rows`), and the gradient of an f32 stack is
    gathered in f32."""
    return tuple(as_compute(jax.tree.map(lambda a: take_rows(jnp.asarray(a), index), experts[name]), dtype)
                 for name in ("w1", "w3", "w2"))


def _gathered_pairs(xa, weights, idx, experts, **kw) -> jax.Array:
    """[N, k, D] f32: each pair's expert matrices read by index (decode sizes: N*k <= E)."""
    n, k = idx.shape
    xk = jnp.broadcast_to(xa[:, None, :], (n, k, xa.shape[-1]))
    w1, w3, w2 = expert_matrices(experts, idx, xa.dtype)
    return _pair_outputs(xk, weights, w1, w3, w2, spec_in="nkd,nkdi->nki", spec_out="nki,nkid->nkd", **kw)


def tile_size(pairs: int, n_experts: int) -> int:
    """Pairs per tile: the largest power of two <= pairs / (2 E), so that the padding (< T rows for each
    expert) stays under half the pairs, at least 1."""
    return 1 << max(0, (pairs // (2 * n_experts)).bit_length() - 1)


def expert_tiles(expert_of_pair: jax.Array, n_experts: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cut the pairs, sorted by expert, into tiles of `tile` pairs each belonging to one expert.

    expert_of_pair i32[P] -> (tile_expert i32[M], tile_pairs i32[M, T] pair indices, valid bool[M, T]).
    M = ceil(P / T) + min(E, P) is a static bound on the tiles any routing needs (each expert with pairs
    wastes less than one tile); tiles past the routing's own count hold no valid row."""
    p = expert_of_pair.shape[0]
    order = jnp.argsort(expert_of_pair, stable=True)
    counts = jnp.bincount(expert_of_pair, length=n_experts)
    first_pair = jnp.cumsum(counts) - counts
    tiles = (counts + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles)
    m = -(-p // tile) + min(n_experts, p)
    t = jnp.arange(m)
    expert = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), n_experts - 1)
    within = (t - (tiles_end - tiles)[expert])[:, None] * tile + jnp.arange(tile)  # row within the expert's pairs
    valid = (t < tiles_end[-1])[:, None] & (within < counts[expert][:, None])
    pairs = order[jnp.where(valid, first_pair[expert][:, None] + within, 0)]
    return expert.astype(jnp.int32), pairs, valid


def _tiled_pairs(xa, weights, idx, experts, **kw) -> jax.Array:
    """[N, k, D] f32: the pairs in expert tiles, one tile per loop step (prefill and training sizes)."""
    n, k = idx.shape
    n_experts = _n_experts(experts)
    tile = tile_size(n * k, n_experts)
    tile_expert, tile_pairs, valid = expert_tiles(idx.reshape(-1), n_experts, tile)
    tile_weight = jnp.where(valid, weights.reshape(-1)[tile_pairs], 0.0)
    stacks = {name: experts[name] for name in ("w1", "w3", "w2")}
    out = _tile_loop((k, *sorted(kw.items())), xa, tile_weight, stacks, tile_expert, tile_pairs)  # [M, T, D]
    dest = jnp.where(valid, tile_pairs, n * k)  # padding rows are dropped
    flat = jnp.zeros((n * k, xa.shape[-1]), jnp.float32).at[dest.reshape(-1)].set(
        out.reshape(-1, xa.shape[-1]), mode="drop", unique_indices=True)
    return flat.reshape(n, k, -1)


def _tile_outputs(config, x_rows, weight, slices) -> jax.Array:
    """[T, D] f32: one tile's rows through its expert (`slices`: that expert's w1, w3, w2 as stored)."""
    _, *kw = config
    w1, w3, w2 = (as_compute(slices[name], x_rows.dtype) for name in ("w1", "w3", "w2"))
    return _pair_outputs(x_rows, weight, w1, w3, w2, spec_in="td,di->ti", spec_out="ti,id->td", **dict(kw))


def _expert_slices(stacks: dict, e: jax.Array) -> dict:
    return {name: jax.tree.map(lambda a: take_rows(jnp.asarray(a), e), stack) for name, stack in stacks.items()}


# The loop over tiles has its own backward pass. Differentiated automatically, the cotangent of each step's
# expert read (a dynamic slice of the [E, D, I] stacks) becomes a whole-stack zero array plus that slice,
# added to the running gradient: every step moves all E experts' bytes (measured on CPU: slower than the
# all-experts MoE at 40 tokens of 64 experts). The rule below runs the tiles again and adds each tile's
# weight gradient into its expert's slice of the accumulator, in place.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tile_loop(config, xa, tile_weight, stacks, tile_expert, tile_pairs) -> jax.Array:
    """[M, T, D] f32: each tile's rows through its expert. `config` = (k, sorted static options)."""
    k = config[0]

    def one_tile(_, xs):
        e, pairs, weight = xs
        return None, _tile_outputs(config, xa[pairs // k], weight, _expert_slices(stacks, e))

    return jax.lax.scan(one_tile, None, (tile_expert, tile_pairs, tile_weight))[1]


def _tile_loop_forward(config, xa, tile_weight, stacks, tile_expert, tile_pairs):
    out = _tile_loop(config, xa, tile_weight, stacks, tile_expert, tile_pairs)
    return out, (xa, tile_weight, stacks, tile_expert, tile_pairs)


def _tile_loop_backward(config, residuals, d_out):
    xa, tile_weight, stacks, tile_expert, tile_pairs = residuals
    k = config[0]
    dtypes = jax.tree.map(lambda a: a.dtype, stacks)

    # The tiles come sorted by expert (`expert_tiles`), so an expert's gradient is a running f32 sum over its
    # consecutive tiles, written into its slice after each tile (the last write holds the whole sum). The
    # write replaces one slice of a table kept in `rows.writable` form: adding into a bf16 stack instead
    # made XLA:CPU convert the whole stack to f32 and back, and copy it, every tile (roofline train/flash).
    def one_tile(carry, xs):
        d_xa, d_stacks, running, previous = carry
        e, pairs, weight, d_tile = xs
        rows = pairs // k
        _, tile_vjp = jax.vjp(functools.partial(_tile_outputs, config), xa[rows], weight, _expert_slices(stacks, e))
        d_rows, d_weight, d_slices = tile_vjp(d_tile)
        d_xa = d_xa.at[rows].add(d_rows.astype(jnp.float32))  # padding rows carry a zero cotangent
        running = jax.tree.map(lambda r, d: jnp.where(e == previous, r, 0.0) + d.astype(r.dtype), running, d_slices)
        d_stacks = jax.tree.map(lambda acc, r, dt: put_row(acc, e, r, dt), d_stacks, running, dtypes)
        return (d_xa, d_stacks, running, e), d_weight

    zeros = jax.tree.map(lambda a: writable(jnp.zeros_like(a)), stacks)
    running = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.promote_types(a.dtype, jnp.float32)), stacks)
    init = (jnp.zeros(xa.shape, jnp.float32), zeros, running, jnp.int32(-1))
    (d_xa, d_stacks, _, _), d_weight = jax.lax.scan(one_tile, init, (tile_expert, tile_pairs, tile_weight, d_out))
    d_stacks = jax.tree.map(readable, d_stacks, dtypes)
    return d_xa.astype(xa.dtype), d_weight, d_stacks, None, None


_tile_loop.defvjp(_tile_loop_forward, _tile_loop_backward)


def _ragged_pairs(xa, weights, idx, experts, *, limit, act_fp8, fp8_grad) -> jax.Array:
    """[N, k, D] f32 by grouped matmuls (`jax.lax.ragged_dot`, which TPU and GPU lower natively): the
    pairs sorted by expert, one contiguous group per expert, no padding. On CPU ragged_dot computes every
    group densely, so the CPU takes `_tiled_pairs`. The stacks are needed whole in the compute dtype (a
    no-op for bf16 stacks; packed stacks are dequantised whole here: the quantized grouped-matmul kernels
    that would avoid it are not wired yet)."""
    n, k = idx.shape
    cd = xa.dtype
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=_n_experts(experts)).astype(jnp.int32)
    w1, w3, w2 = (as_compute(experts[name], cd) for name in ("w1", "w3", "w2"))

    def grouped(a, w):
        return to_dtype(jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32), cd)

    xs = xa[order // k]
    h = clamped_swiglu(grouped(xs, w1), grouped(xs, w3), limit) * weights.reshape(-1)[order][:, None]
    out = grouped(_act(to_dtype(h, cd), act_fp8, fp8_grad), w2).astype(jnp.float32)
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(n, k, -1)


def _grouped_pairs(xa, weights, idx, experts, **kw) -> jax.Array:
    """More pairs than experts: grouped matmuls on TPU / GPU, expert tiles on CPU (chosen when lowering)."""
    return by_platform(xa, weights, idx, experts, cpu=functools.partial(_tiled_pairs, **kw),
                       default=functools.partial(_ragged_pairs, **kw), dense_on_cpu=True)


def _n_experts(experts: dict) -> int:
    return jax.tree.leaves(experts["w1"])[0].shape[0]


def routed_moe_ffn(x: jax.Array, weights: jax.Array, idx: jax.Array, experts: dict, shared: dict | None, *,
                   compute_dtype, limit: float, act_fp8: bool = False, fp8_grad: str = "exact") -> jax.Array:
    """`moe_ffn` computing only the routed pairs. `experts` are the STORED stacks (f32, bf16 or packed),
    read per selected expert (`expert_matrices`); `shared` is in the compute dtype. The result equals
    `moe_ffn` on the stacks in the compute dtype up to the summation order inside each dot (bit for bit
    at bf16 in every case measured; XLA:CPU's f32 dots round the last bit by their row count)."""
    n, k = idx.shape
    cd = jnp.dtype(compute_dtype)
    weights, idx = ascending_routes(weights, idx)
    xa = _act(x.astype(cd), act_fp8, fp8_grad)
    pairs = _gathered_pairs if n * k <= _n_experts(experts) else _grouped_pairs
    out = pairs(xa, weights, idx, experts, limit=limit, act_fp8=act_fp8, fp8_grad=fp8_grad)
    y = out[:, 0]
    for j in range(1, k):  # ascending expert index, one f32 add at a time
        y = y + out[:, j]
    if shared is not None:
        y = y + swiglu_mlp(x, shared["w1"], shared["w3"], shared["w2"], limit=limit, act_fp8=act_fp8,
                           fp8_grad=fp8_grad).astype(jnp.float32)
    return to_dtype(y, cd)


class MoE(nn.Module):
    dim: int
    n_experts: int
    top_k: int
    inter_dim: int
    n_shared: int
    route_scale: float
    score_func: str
    norm_topk_prob: bool
    swiglu_limit: float
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    act_fp8: bool = False
    vision: bool = False  # the router has `bias_vl` (models with a vision tower)
    fp8_grad: str = "exact"  # gradient through the activation fp8 rounding (nn.quant)
    # "routed": only the routed pairs (`routed_moe_ffn`); "dense": every expert on every token (`moe_ffn`);
    # "auto": routed when it does less than half the dense work (E > 2k: the V4.1-Flash draft's 128 experts
    # top-3), dense for few experts (the embedded defaults' 4, top-2), where one batched dot beats the loop.
    routing: str = "auto"

    def setup(self):
        if self.routing not in ("auto", "routed", "dense"):
            raise ValueError(f"MoE routing must be 'auto', 'routed' or 'dense', got {self.routing!r}")
        d, e, i = self.dim, self.n_experts, self.inter_dim
        self.gate = _Gate(d, e, self.param_dtype, self.vision)
        self.experts = _SwiGLUWeights(d, i, e, self.param_dtype)
        if self.n_shared:
            self.shared = _SwiGLUWeights(d, self.n_shared * i, 0, self.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.dim)
        kernel, bias = self.gate()
        weights, idx = moe_route(flat, kernel, bias, top_k=self.top_k, route_scale=self.route_scale,
                                 score_func=self.score_func, norm_topk_prob=self.norm_topk_prob)
        cd = jnp.dtype(self.compute_dtype)
        # Packed (fp8 / fp4) weights are dequantised here, inside the computation (`nn.packed`): the routed
        # path dequantises only the experts it reads.
        shared = {k: as_compute(v, cd) for k, v in self.shared().items()} if self.n_shared else None
        kw = dict(limit=self.swiglu_limit, act_fp8=self.act_fp8, fp8_grad=self.fp8_grad)
        if self.routing == "routed" or (self.routing == "auto" and self.n_experts > 2 * self.top_k):
            y = routed_moe_ffn(flat, weights, idx, self.experts(), shared, compute_dtype=cd, **kw)
        else:
            experts = {k: as_compute(v, cd) for k, v in self.experts().items()}
            y = moe_ffn(flat, weights, idx, experts, shared, **kw)
        return y.astype(cd).reshape(*lead, self.dim)


class _Gate(nn.Module):
    dim: int
    n_experts: int
    param_dtype: str
    vision: bool = False

    @nn.compact
    def __call__(self):
        kernel = param(self, "kernel", fan_in_normal(self.dim), (self.dim, self.n_experts), self.param_dtype,
                       ("embed", "expert_gate"))
        bias = param(self, "bias", nn.initializers.zeros, (self.n_experts,), "float32", ("expert_gate",))
        # In the checkpoint, unused by drafts; kept so an export round-trips every tensor.
        if self.vision:  # only models with a vision tower have it; unused by drafts, kept to round-trip
            param(self, "bias_vl", nn.initializers.zeros, (self.n_experts,), "float32", ("expert_gate",))
        return kernel, bias


class _SwiGLUWeights(nn.Module):
    """w1, w3 [(E,) D, I] and w2 [(E,) I, D]; n_experts = 0 means a single (shared) expert."""

    dim: int
    inter_dim: int
    n_experts: int
    param_dtype: str

    @nn.compact
    def __call__(self) -> dict:
        d, i = self.dim, self.inter_dim
        lead, lead_axes = ((self.n_experts,), ("expert",)) if self.n_experts else ((), ())
        return {
            "w1": param(self, "w1", fan_in_normal(d), (*lead, d, i), self.param_dtype, (*lead_axes, "embed", "mlp")),
            "w3": param(self, "w3", fan_in_normal(d), (*lead, d, i), self.param_dtype, (*lead_axes, "embed", "mlp")),
            "w2": param(self, "w2", fan_in_normal(i), (*lead, i, d), self.param_dtype, (*lead_axes, "mlp", "embed")),
        }
